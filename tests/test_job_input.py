"""`kvray run` input: every line parsed in isolation, bounded reads, shards, stdin, resume across shards.
The job runs against an in-process engine double (tests/job_helpers.py): no Ray, milliseconds."""

import io
import json
import os
import sys
from typing import Any

import pytest

from cluster.config import EngineConfig
from cluster.job.input import InputReader, JobError, Limits, Shard, count_lines, resolve_shards
from cluster.job.keys import KeySet
from cluster.job.runner import Job
from cluster.llm import load_client_model
from cluster.replicas.engine_group import EngineFailure
from kvcore.request import SamplingParams
from tests.job_helpers import MAX_MODEL_LEN, FakeEngines, expected_tokens

SP = SamplingParams(max_tokens=3, ignore_eos=True)
HOSTILE = {
    "int_5000_digits": (
        b'{"id": "big", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        "not valid JSON here (Exceeds the limit",
    ),
    "nested_100000_deep": (b"[" * 100_000 + b"]" * 100_000, "longer than any prompt the model can take"),
    "nested_20000_deep_within_the_line_limit": (
        b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
        "nested too deeply",
    ),
    "id_lone_surrogate": (b'{"id": "\\ud800", "prompt": "x"}', "id is not valid Unicode (a lone surrogate U+D800"),
    "prompt_lone_surrogate": (
        b'{"id": "ls", "prompt": "a\\udc80b"}',
        "prompt is not valid Unicode (a lone surrogate U+DC80 at character 1)",
    ),
    "invalid_utf8": (b'{"id": "u8", "prompt": "a\xff\xfeb"}', "not valid UTF-8 (byte 0xff at byte 25)"),
    "id_control_character": (b'{"id": "a\\u0007b", "prompt": "x"}', "must be printable"),
    "fifty_mb_line": (
        b'{"id": "huge", "prompt": "' + b"a" * (50 << 20) + b'"}',
        "longer than any prompt the model can take",
    ),
    "text_over_the_character_cap": (b'{"id": "long", "prompt": "' + b"b" * 5000 + b'"}', "refused before tokenizing"),
    "bad_sampling_field": (b'{"id": "tp", "prompt": "x", "top_p": 0}', "top_p=0: must be in (0, 1]"),
    "not_json": (b"not json", "not valid JSON (Expecting value"),
    "engine_refusal": (b'{"id": "ov", "prompt_token_ids": [1, 300]}', "outside the vocabulary"),
}


class CountingTokenizer:
    def __init__(self, tok):
        self.tok, self._tok, self.chars = tok, tok.backend, 0

    def encode(self, text, **kw):
        self.chars += len(text)
        return self.tok.encode(text, **kw)

    def __getattr__(self, name):  # decode, convert_ids_to_tokens, ...: the real tokenizer's
        return getattr(self.tok, name)


@pytest.fixture(scope="module")
def tokenizer():
    return CountingTokenizer(load_client_model(EngineConfig())[0])


def run_job(tmp_path, shards_or_path, tokenizer, engines=None, out_name="out.jsonl"):
    out = tmp_path / out_name
    shards = resolve_shards(str(shards_or_path)) if not isinstance(shards_or_path, list) else shards_or_path
    engines = engines or FakeEngines()
    job = Job(EngineConfig(), engines, tokenizer, str(out), progress=False)
    stats = job.run(InputReader(shards, SP))
    return stats, [json.loads(x) for x in out.read_text().splitlines()], engines


def test_every_hostile_line_fails_alone_and_the_good_ones_run(tmp_path, tokenizer):
    lines, good = [], {}
    for i, (_name, (raw, _)) in enumerate(HOSTILE.items()):
        good[f"good-{i}"] = [10 + i, 11]
        lines.append(json.dumps({"id": f"good-{i}", "prompt_token_ids": good[f"good-{i}"]}).encode())
        lines.append(raw)
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"\n".join(lines) + b"\n")
    tokenizer.chars = 0
    stats, recs, _ = run_job(tmp_path, inp, tokenizer)
    by_line = {r["line"]: r for r in recs}
    for i, (name, (_, message)) in enumerate(HOSTILE.items()):
        rec = by_line[2 * i + 2]
        assert rec["finish_reason"] == "error" and message in rec["error"], (name, rec["error"][:300])
        assert len(rec["error"]) < 1000, name  # never the whole line quoted back
        ok = by_line[2 * i + 1]
        assert ok["error"] is None and ok["output_token_ids"] == expected_tokens(good[ok["id"]], 3), name
    assert stats.errors == len(HOSTILE) and stats.completed == len(HOSTILE)
    assert tokenizer.chars < 10_000, "an over-long text prompt was tokenized"
    assert by_line[4]["id"] is None  # an invalid id is never written back as an id


def test_a_fifty_mb_line_is_refused_without_being_held(tmp_path, tokenizer):
    import tracemalloc

    inp = tmp_path / "huge.jsonl"
    inp.write_bytes(HOSTILE["fifty_mb_line"][0] + b"\n" + b'{"prompt": "ok"}\n')
    tracemalloc.start()
    try:
        items = list(InputReader([Shard(str(inp), None)], SP, tokenizer, Limits(MAX_MODEL_LEN, 13)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "longer than any prompt" in items[0].error and items[1].error is None
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB while reading a 50 MiB line"


def test_stdin_is_an_input(tmp_path, tokenizer, monkeypatch):
    data = b'{"id": "s1", "prompt_token_ids": [1, 2]}\n{"prompt": "hi"}\n'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert resolve_shards("-")[0].is_stdin and resolve_shards("/dev/stdin")[0].is_stdin
    assert count_lines(resolve_shards("-")) is None
    stats, recs, _ = run_job(tmp_path, resolve_shards("-"), tokenizer)
    assert {r["id"] for r in recs} == {"s1", "2"} and stats.completed == 2


def make_shards(d, n_files=3, per_file=7):
    d.mkdir()
    (d / "sub").mkdir()
    for f in range(n_files):
        where = d / "sub" if f == 2 else d
        lines = [json.dumps({"prompt_token_ids": [f, i + 1]}) for i in range(per_file)]
        (where / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    (d / "notes.txt").write_text("not an input shard\n")


def test_a_directory_of_shards_resumes_across_shards(tmp_path, tokenizer):
    d = tmp_path / "shards"
    make_shards(d)
    shards = resolve_shards(str(d))
    assert [s.label for s in shards] == ["part-0.jsonl", "part-1.jsonl", os.path.join("sub", "part-2.jsonl")]
    assert count_lines(shards) == 21
    with pytest.raises(EngineFailure):
        run_job(tmp_path, shards, tokenizer, FakeEngines(fail_after=10))
    first = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert 0 < len(first) < 21
    stats, recs, engines = run_job(tmp_path, shards, tokenizer)
    assert stats.skipped == len(first) and stats.completed == 21 - len(first)
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)) == 21
    for r in recs:
        f, line = r["file"], r["line"]
        assert r["id"] == f"{f}:{line}"
        assert r["output_token_ids"] == expected_tokens([int(f[-7]), line], 3)
    assert set(engines.submitted).isdisjoint(r["id"] for r in first)


def test_a_glob_of_shards(tmp_path, tokenizer):
    d = tmp_path / "g"
    make_shards(d)
    shards = resolve_shards(str(d / "*.jsonl"))
    assert [s.label for s in shards] == [str(d / "part-0.jsonl"), str(d / "part-1.jsonl")]
    stats, recs, _ = run_job(tmp_path, shards, tokenizer)
    assert stats.completed == 14 and {r["file"] for r in recs} == {s.label for s in shards}


def test_missing_and_empty_inputs_are_named(tmp_path):
    with pytest.raises(JobError, match="no such file"):
        resolve_shards(str(tmp_path / "nope.jsonl"))
    with pytest.raises(JobError, match="matches no file"):
        resolve_shards(str(tmp_path / "*.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(JobError, match="without any \\*.jsonl"):
        resolve_shards(str(tmp_path / "empty"))


def test_the_window_bounds_what_is_in_flight(tmp_path, tokenizer):
    inp = tmp_path / "many.jsonl"
    inp.write_text("".join(json.dumps({"prompt_token_ids": [i % 200 + 1]}) + "\n" for i in range(3000)))
    stats, recs, engines = run_job(tmp_path, inp, tokenizer)
    config = EngineConfig()
    assert stats.completed == 3000 and len(recs) == 3000
    assert engines.max_open <= 2 * config.scheduler.max_num_seqs


def test_keyset_is_compact_and_exact_for_members():
    ks = KeySet()
    for i in range(200_000):
        ks.add(f"id-{i}")
    assert len(ks) == 200_000 and ks.nbytes == 8 * 200_000
    assert "id-0" in ks and "id-199999" in ks and "id-200000" not in ks
    assert sum(f"other-{i}" in ks for i in range(10_000)) == 0


def test_duplicate_ids_fail_the_second_line(tmp_path, tokenizer):
    inp = tmp_path / "dup.jsonl"
    inp.write_text('{"id": "x", "prompt_token_ids": [1]}\n{"id": "x", "prompt_token_ids": [2]}\n')
    stats, recs, _ = run_job(tmp_path, inp, tokenizer)
    by_line = {r["line"]: r for r in recs}
    assert "line 2: duplicate id 'x'" in by_line[2]["error"] and by_line[1]["id"] == "x" and stats.completed == 1


def test_stop_strings_and_n_go_through_the_clients_output_processor(tmp_path, tokenizer):
    inp = tmp_path / "in.jsonl"
    # The double answers (sum(prompt) + i) % 256: prompt [65] -> bytes 65, 66, 67, ... = "ABC..."
    inp.write_text(
        '{"id": "s", "prompt_token_ids": [65], "max_tokens": 6, "stop": ["C"]}\n'
        '{"id": "n", "prompt_token_ids": [65], "max_tokens": 2, "n": 2, "seed": 3}\n'
    )
    stats, recs, engines = run_job(tmp_path, inp, tokenizer)
    by_id = {r["id"]: r for r in recs}
    assert by_id["s"]["text"] == "AB" and by_id["s"]["finish_reason"] == "stop" and by_id["s"]["stop_reason"] == "C"
    assert [o["text"] for o in by_id["n"]["outputs"]] == ["AB", "AB"] and stats.output_tokens == 4 + len(
        by_id["s"]["output_token_ids"]
    )


@pytest.mark.parametrize(
    "line,rid,message",
    [
        ('{"id": "f-unknown", "prompt": "x", "best_of": 2}', "f-unknown", "best_of=2"),  # refused by name, as vLLM V1
        ('{"id": "neg", "prompt_token_ids": [-1]}', "neg", "prompt_token_ids"),
        ('{"id": "typo", "prompt": "x", "max_token": 3}', "typo", "unknown field(s) ['max_token']"),
        ('{"id": "both", "prompt": "x", "prompt_token_ids": [1]}', "both", "needs exactly one of"),
        ('{"id": "neither", "max_tokens": 3}', "neither", "needs exactly one of"),
        ('{"id": "int-prompt", "prompt": 7}', "int-prompt", "prompt must be a string"),
        ('{"id": "floats", "prompt_token_ids": [1.0, 2.5]}', "floats", "prompt_token_ids"),
        ('{"id": "sur", "prompt": "a\\ud800"}', "sur", "lone surrogate U+D800"),
        ('{"id": 42, "prompt": 7}', "42", "prompt must be a string"),
        ('{"prompt": 7}', "1", "prompt must be a string"),  # no id: the line's own, as a good line gets
    ],
)
def test_an_error_record_keeps_the_lines_readable_id(tmp_path, tokenizer, line, rid, message):
    inp = tmp_path / "in.jsonl"
    inp.write_text(line + "\n")
    stats, recs, _ = run_job(tmp_path, inp, tokenizer)
    assert stats.errors == 1 and len(recs) == 1
    assert recs[0]["finish_reason"] == "error" and message in recs[0]["error"], recs[0]["error"]
    assert recs[0]["id"] == rid


class RecordingEngines(FakeEngines):
    """The double as `kvray run` meets it through EngineGroup(config): it records what it is sent."""

    specs: dict[str, Any] = {}

    def __init__(self, config: Any = None, **_kw: Any) -> None:
        super().__init__()
        RecordingEngines.specs = {}

    def submit(self, specs: list[Any]) -> dict[str, str]:
        RecordingEngines.specs.update({s.request_id: s for s in specs})
        return super().submit(specs)

    def stats(self) -> list[dict[str, Any]]:
        return [{}]

    def shutdown(self) -> None:
        pass


def test_kvray_run_lines_take_the_defaults_llm_generate_and_serve_take(tmp_path, monkeypatch):
    # kvray run's lines without a temperature were greedy while LLM.generate and kvray serve sample at 1.0;
    # its OpenAI chat lines without max_tokens stopped at 16 while serve runs them to the context's end.
    import cluster.replicas.engine_group
    from cluster.cli import main as kvray_main
    from cluster.client.sampling_defaults import default_sampling_params
    from cluster.llm import client_model_dir

    monkeypatch.setattr(cluster.replicas.engine_group, "EngineGroup", RecordingEngines)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    shards = tmp_path / "in"
    shards.mkdir()
    (shards / "a.jsonl").write_text('{"id": "plain", "prompt_token_ids": [1, 2, 3]}\n')
    chat = {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}]}}
    completion = {"method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}
    (shards / "b.jsonl").write_text(
        json.dumps(dict(chat, custom_id="chat")) + "\n" + json.dumps(dict(completion, custom_id="completion")) + "\n"
    )
    assert kvray_main(["run", "-i", str(shards), "-o", str(tmp_path / "out.jsonl"), "--no-progress"]) == 0
    sent = {rid.split(":")[-1] if ":" in rid else rid: s for rid, s in RecordingEngines.specs.items()}
    llm_default = default_sampling_params(client_model_dir(EngineConfig()))
    plain = sent["plain"].sampling_params
    assert plain.temperature == llm_default.temperature == 1.0 and plain.max_tokens == llm_default.max_tokens == 16
    chat_spec = next(s for rid, s in RecordingEngines.specs.items() if "chat" in rid)
    assert chat_spec.sampling_params.max_tokens == MAX_MODEL_LEN - len(chat_spec.prompt_token_ids)
    completion_spec = next(s for rid, s in RecordingEngines.specs.items() if "completion" in rid)
    assert completion_spec.sampling_params.max_tokens == 16 and completion_spec.sampling_params.temperature == 1.0
    # --max-tokens sets the default for every line without one, chat lines included
    assert kvray_main(["run", "-i", str(shards), "-o", str(tmp_path / "out2.jsonl"), "--max-tokens", "5"]) == 0
    assert {s.sampling_params.max_tokens for s in RecordingEngines.specs.values()} == {5}
