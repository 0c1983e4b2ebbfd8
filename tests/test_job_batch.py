"""OpenAI Batch API files through `kvray run`: the format is detected per file, each line gets an OpenAI
batch output line, bad lines get error lines, resume goes by custom_id; kvray's own format is unchanged.
The sample files in examples/ run as they are. Engines: the in-process double (tests/job_helpers.py)."""

import json
import os

import pytest

from cluster.config import EngineConfig
from cluster.job.input import InputReader, Shard, detect_format, resolve_shards
from cluster.job.runner import Job
from cluster.llm import load_client_model
from kvcore.request import SamplingParams
from tests.job_helpers import FakeEngines, expected_tokens

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SP = SamplingParams(max_tokens=3, ignore_eos=True)


def line(cid, url="/v1/completions", **body):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def render(messages):
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def run(tmp_path, inp, render_chat=render, out_name="out.jsonl"):
    out = tmp_path / out_name
    tok = load_client_model(EngineConfig())[0]
    engines = FakeEngines()
    reader = InputReader(resolve_shards(str(inp)), SP, render_chat=render_chat)
    stats = Job(EngineConfig(), engines, tok, str(out), progress=False).run(reader)
    records = {r.get("custom_id", r.get("id")): r for r in map(json.loads, out.read_text().splitlines())}
    return stats, records, tok, engines


def test_completions_and_chat_lines_get_openai_batch_output_lines(tmp_path):
    inp = tmp_path / "batch.jsonl"
    msgs = [{"role": "user", "content": "hi"}]
    inp.write_text(
        "\n".join(
            [
                line("c1", model="m", prompt=[5, 6], max_tokens=4),
                line("c2", model="m", prompt="abc", temperature=0),
                line("chat1", "/v1/chat/completions", model="m", messages=msgs, max_completion_tokens=2),
            ]
        )
        + "\n"
    )
    stats, recs, tok, _ = run(tmp_path, inp)
    assert stats.completed == 3 and stats.errors == 0
    c1 = recs["c1"]
    assert c1["error"] is None and c1["id"].startswith("batch_req_")
    resp = c1["response"]
    assert resp["status_code"] == 200 and resp["body"]["object"] == "text_completion"
    choice = resp["body"]["choices"][0]
    assert choice["text"] == tok.decode(expected_tokens([5, 6], 4)) and choice["finish_reason"] == "length"
    assert resp["body"]["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert resp["body"]["model"] == "m"
    assert recs["c2"]["response"]["body"]["usage"]["completion_tokens"] == 3  # --max-tokens default
    chat = recs["chat1"]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    prompt_ids = tok.encode(render(msgs), add_special_tokens=False) if _has_kw(tok) else tok.encode(render(msgs))
    assert chat["choices"][0]["message"]["content"] == tok.decode(expected_tokens(prompt_ids, 2))


def _has_kw(tok):
    import inspect

    return "add_special_tokens" in inspect.signature(tok.encode).parameters


BAD = {
    "get": (
        json.dumps({"custom_id": "b1", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}),
        "b1",
        "method='GET': must be 'POST'",
    ),
    "url": (line("b2", "/v1/embeddings", input="x"), "b2", "url='/v1/embeddings': must be one of"),
    "unknown_body_field": (line("b3", prompt="x", frobnicate=1), "b3", "body.frobnicate is not a field"),
    "streaming": (line("b4", prompt="x", stream=True), "b4", "body.stream=True is not supported"),
    "n": (line("b5", prompt="x", n=0), "b5", "n=0"),
    "bad_sampling": (line("b6", prompt="x", top_p=0), "b6", "top_p=0: must be in (0, 1]"),
    "no_custom_id": (
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        None,
        "custom_id must be a non-empty string",
    ),
    "not_json": ('{"custom_id": "b8", ', None, "not valid JSON"),
    "engine_refusal": (line("b9", prompt=[1, 999]), "b9", "outside the vocabulary"),
    "messages_not_a_list": (line("b10", "/v1/chat/completions", messages="hi"), "b10", "body.messages must be"),
}


def test_bad_batch_lines_get_error_lines_and_the_rest_run(tmp_path):
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join([line("ok", prompt=[1])] + [b[0] for b in BAD.values()]) + "\n")
    stats, recs, _, _ = run(tmp_path, inp)
    assert stats.completed == 1 and stats.errors == len(BAD)
    assert recs["ok"]["response"]["status_code"] == 200
    for name, (_, cid, message) in BAD.items():
        if cid is None:
            continue  # no usable custom_id: checked below
        rec = recs[cid]
        assert rec["error"] is not None and message in rec["error"]["message"], (name, rec)
        assert rec["response"]["status_code"] == 400 and message in rec["response"]["body"]["error"]["message"]
    nulls = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines() if '"custom_id": null' in x]
    assert len(nulls) == 2 and any("not valid JSON" in r["error"]["message"] for r in nulls)


def test_n_samples_are_choices_and_stop_strings_cut_the_text(tmp_path):
    inp = tmp_path / "batch.jsonl"
    # The double answers (sum(prompt) + i) % 256: prompt [65] -> bytes 65, 66, 67, ... = "ABC..."
    inp.write_text(
        "\n".join(
            [line("n2", prompt=[65], n=2, max_tokens=3, seed=1), line("stop", prompt=[65], max_tokens=6, stop=["C"])]
        )
        + "\n"
    )
    stats, recs, _, engines = run(tmp_path, inp)
    assert stats.completed == 2 and stats.errors == 0
    body = recs["n2"]["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["completion_tokens"] == 6
    assert all(c["text"] == "ABC" for c in body["choices"])
    choice = recs["stop"]["response"]["body"]["choices"][0]
    assert choice["text"] == "AB" and choice["finish_reason"] == "stop"


def test_resume_goes_by_custom_id_and_retries_failed_lines(tmp_path):
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join([line("a", prompt=[1]), line("b", prompt=[2], max_tokens=0)]) + "\n")
    s1, _, _, _ = run(tmp_path, inp)
    assert s1.completed == 1 and s1.errors == 1
    inp.write_text("\n".join([line("a", prompt=[1]), line("b", prompt=[2], max_tokens=2)]) + "\n")
    s2, _, _, engines = run(tmp_path, inp)
    assert s2.skipped == 1 and s2.completed == 1 and engines.submitted == ["b"]


def test_without_a_chat_template_a_chat_line_fails_alone(tmp_path):
    inp = tmp_path / "batch.jsonl"
    inp.write_text(
        "\n".join(
            [line("c", "/v1/chat/completions", messages=[{"role": "user", "content": "x"}]), line("p", prompt=[3])]
        )
        + "\n"
    )
    reader = InputReader(resolve_shards(str(inp)), SP, render_chat=None)
    items = list(reader)
    assert "needs the model's chat template" in items[0].error and items[1].error is None


def test_the_format_is_detected_per_file(tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a.jsonl").write_text(line("x", prompt=[1]) + "\n")
    (d / "b.jsonl").write_text(json.dumps({"id": "y", "prompt_token_ids": [2]}) + "\n")
    stats, _, _, _ = run(tmp_path, d, out_name="mixed-out.jsonl")
    recs = [json.loads(x) for x in (tmp_path / "mixed-out.jsonl").read_text().splitlines()]
    assert stats.completed == 2
    assert {("custom_id" in r, r.get("custom_id") or r.get("id")) for r in recs} == {(True, "x"), (False, "y")}
    assert detect_format(b'{"custom_id": ') == "openai" and detect_format(b'{"id": 1}') == "kvray"


@pytest.mark.parametrize("name", ["prompts.jsonl", "openai-batch.jsonl"])
def test_the_example_files_run_as_they_are(tmp_path, name):
    stats, recs, _, _ = run(tmp_path, os.path.join(REPO, "examples", name))
    assert stats.completed == 3 and stats.errors == 0, recs
    items = list(
        InputReader(
            [Shard(os.path.join(REPO, "examples", name), None)],
            SP,
            load_client_model(EngineConfig())[0],
            render_chat=render,
        )
    )
    assert all(i.error is None for i in items)


def test_chat_lines_use_the_models_chat_template_as_llm_chat_does(tmp_path):
    from cluster.job.openai_batch import make_chat_renderer

    inp = tmp_path / "batch.jsonl"
    msgs = [{"role": "user", "content": "hi"}]
    inp.write_text(line("c", "/v1/chat/completions", messages=msgs, max_tokens=2) + "\n")
    out = tmp_path / "out.jsonl"
    tok = load_client_model(EngineConfig())[0]
    reader = InputReader(resolve_shards(str(inp)), SP)  # no renderer given: the job takes the model's
    stats = Job(EngineConfig(), FakeEngines(), tok, str(out), progress=False).run(reader)
    rec = json.loads(out.read_text())
    assert stats.completed == 1, rec
    rendered = make_chat_renderer(tok)(msgs)
    assert rendered.startswith("<|im_start|>user\nhi")
    ids = tok.encode(rendered, add_special_tokens=False)
    assert rec["response"]["body"]["usage"]["prompt_tokens"] == len(ids)
    assert rec["response"]["body"]["choices"][0]["message"]["content"] == tok.decode(expected_tokens(ids, 2))


def test_logit_bias_reaches_sampling_params_with_token_id_keys(tmp_path):
    inp = tmp_path / "batch.jsonl"
    msgs = [{"role": "user", "content": "hi"}]
    inp.write_text(
        "\n".join(
            [
                line("lb", prompt=[1], logit_bias={"5": 2.5, "17": -100}),
                line("lbchat", "/v1/chat/completions", messages=msgs, logit_bias={"0": 100}),
                line("b1", prompt=[1], best_of=1),
                line("off", prompt=[1], echo=False, suffix=None),
                line("offchat", "/v1/chat/completions", messages=msgs, tools=[], response_format={"type": "text"}),
            ]
        )
        + "\n"
    )
    tok = load_client_model(EngineConfig())[0]
    items = {i.id: i for i in InputReader(resolve_shards(str(inp)), SP, tok, render_chat=render)}
    assert all(i.error is None for i in items.values()), {k: i.error for k, i in items.items()}
    assert items["lb"].sampling.logit_bias == {5: 2.5, 17: -100.0}
    assert items["lbchat"].sampling.logit_bias == {0: 100.0}
    assert items["off"].sampling.logit_bias is None
    stats, recs, _, _ = run(tmp_path, inp)
    assert stats.completed == 5 and stats.errors == 0, recs


BAD_FIELDS = {
    "key_not_a_number": ({"abc": 1}, "body.logit_bias: key 'abc' must be a token id"),
    "key_negative": ({"-1": 1}, "body.logit_bias: key '-1' must be a token id"),
    "key_spaces": ({" 5": 1}, "body.logit_bias: key ' 5' must be a token id"),
    "key_past_int32": ({"2147483648": 1}, "must be a token id"),
    "value_range": ({"5": 101}, "body.logit_bias['5']=101: must be a number in [-100, 100]"),
    "value_type": ({"5": "1"}, "body.logit_bias['5']='1': must be a number in [-100, 100]"),
    "value_bool": ({"5": True}, "body.logit_bias['5']=True: must be a number in [-100, 100]"),
    "not_a_dict": ([5], "body.logit_bias=[5]: must be an object"),
    "too_many": ({str(i): 1 for i in range(1025)}, "at most 1024"),
}


@pytest.mark.parametrize("name", sorted(BAD_FIELDS))
def test_a_bad_logit_bias_fails_its_line_naming_the_field_and_keeps_the_custom_id(tmp_path, name):
    value, message = BAD_FIELDS[name]
    inp = tmp_path / "batch.jsonl"
    inp.write_text(line("bad", prompt=[1], logit_bias=value) + "\n" + line("ok", prompt=[1]) + "\n")
    stats, recs, _, _ = run(tmp_path, inp)
    assert stats.completed == 1 and stats.errors == 1
    rec = recs["bad"]
    assert rec["custom_id"] == "bad" and rec["response"]["status_code"] == 400
    assert message in rec["error"]["message"], rec["error"]["message"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"best_of": 2}, "best_of=2: is not supported (vLLM V1"),
        ({"echo": True}, "body.echo=True is not supported by kvray run"),
        ({"tools": [{"type": "function"}]}, "body.tools=[{'type': 'function'}] is not supported by kvray run"),
        ({"stream": True}, "body.stream=True is not supported by kvray run"),
    ],
)
def test_fields_kvray_cannot_honour_are_still_refused_by_name(tmp_path, body, message):
    inp = tmp_path / "batch.jsonl"
    inp.write_text(line("bad", prompt=[1], **body) + "\n")
    items = list(InputReader(resolve_shards(str(inp)), SP, render_chat=render))
    assert items[0].id == "bad" or items[0].batch["custom_id"] == "bad"
    assert message in items[0].error, items[0].error
