"""The client-side output processor without an engine: engine outputs are built by hand, as the scheduler
emits them (one EngineCoreOutput per step per request), and decoded with the tiny-random byte tokenizer,
whose multi-byte characters span several tokens."""

from __future__ import annotations

import json
import pickle
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.config.hf_json import ModelConfigError
from actors.models.tiny_random import EOS_ID, SPECIAL_TOKENS, ensure_tiny_random
from cluster.client.detokenizer import IncrementalDetokenizer, check_stop_strings
from cluster.client.output_processor import OutputProcessor
from cluster.client.sampling_defaults import VLLM_DEFAULTS, default_sampling_params
from cluster.client.tokenizer import Tokenizer
from kvcore.messages import EngineCoreOutput, Logprobs, LogprobsBatch
from kvcore.request import RequestValidationError, SamplingParams

IM_END = 256 + SPECIAL_TOKENS.index("<|im_end|>")


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(ensure_tiny_random(str(tmp_path_factory.mktemp("cache"))))


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(
    proc: OutputProcessor,
    rid: str,
    tokens: list[int],
    finish: tuple[str, int | None] = ("length", None),
    per_step: int = 1,
    **extra,
):
    """Feed tokens as engine steps; the last step finishes with `finish`. -> (parent output or None, aborts)."""
    aborts, parent = [], None
    steps = [tokens[i : i + per_step] for i in range(0, len(tokens), per_step)]
    for k, step in enumerate(steps):
        last = k == len(steps) - 1
        o = EngineCoreOutput(
            rid, step, finished=last, finish_reason=finish[0] if last else None, stop_reason=finish[1] if last else None
        )
        for name, rows in extra.items():  # the logprob fields the sampler fills
            setattr(o, name, rows[k])
        parent, abort = proc.process_output(o)
        if abort:
            aborts.append(rid)
            break
    return parent, aborts


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24), st.text(max_size=8))
def test_incremental_text_equals_full_decode(tok, text, prompt) -> None:
    ids = ids_of(tok, text)
    detok = IncrementalDetokenizer(tok, ids_of(tok, prompt))
    pieces = [detok.decode_next(t) for t in ids]
    # The full decode is the text itself, but for special tokens (skipped) that the text may spell out.
    assert "".join(pieces) + detok.flush() == tok.decode(ids) == detok.output_text
    # Nothing is emitted half-way through a multi-byte character.
    assert all("\ufffd" not in p for p in pieces)
    lazy = IncrementalDetokenizer(tok, ids_of(tok, prompt))
    for t in ids:
        lazy.append(t)
    assert lazy.flush() == detok.output_text


def test_unfinished_character_at_the_end_is_flushed_as_a_full_decode_shows_it(tok) -> None:
    ids = ids_of(tok, "ab") + ids_of(tok, "世")[:2]
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.decode_next(t) for t in ids) == "ab"
    assert detok.flush() == tok.decode(ids)[2:] and detok.output_text == tok.decode(ids)


def test_check_stop_strings_is_vllms_rule() -> None:
    assert check_stop_strings("hello wor", 3, ["wor"], False) == ("wor", 6)
    assert check_stop_strings("hello wor", 3, ["wor"], True) == ("wor", -1)
    assert check_stop_strings("hello world", 3, ["wor"], True) == ("wor", 9)  # text after it in the step is cut
    assert check_stop_strings("hello wor", 1, ["llo"], False) is None  # passed before the new characters
    assert check_stop_strings("abc", 0, ["abc"], False) is None


@pytest.mark.parametrize("per_step", [1, 3])
def test_stop_string_across_token_boundaries_cuts_the_text_and_aborts(tok, per_step) -> None:
    proc = OutputProcessor(tok)
    text = "héllo 世界 and more"
    ids = ids_of(tok, text)
    proc.add_request("r", None, [1, 2], SamplingParams(max_tokens=64, stop=["界 a", "zzz"]))
    parent, aborts = stream(proc, "r", ids, per_step=per_step)
    assert aborts == ["r"] and parent is not None and not proc.has_unfinished()
    c = parent.output().outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("héllo 世", "stop", "界 a")
    # Tokens up to the one that completed the stop string are kept; later ones (same step) are not.
    assert c.token_ids == ids[: len(ids_of(tok, "héllo 世界 a"))]
    # The abort echo of the engine is ignored.
    assert proc.process_output(EngineCoreOutput("r", [], True, "abort")) == (None, False)


def test_include_stop_str_in_output_and_min_tokens(tok) -> None:
    ids = ids_of(tok, "ab|cd|ef")
    proc = OutputProcessor(tok)
    proc.add_request("a", None, [], SamplingParams(max_tokens=64, stop="|", include_stop_str_in_output=True))
    proc.add_request("b", None, [], SamplingParams(max_tokens=64, stop="|", min_tokens=4))
    a = stream(proc, "a", ids)[0].output().outputs[0]
    b = stream(proc, "b", ids)[0].output().outputs[0]
    assert (a.text, a.stop_reason) == ("ab|", "|")
    assert (b.text, b.token_ids) == ("ab|cd", ids[:6])  # the first "|" is within min_tokens


def test_engine_stops_and_special_tokens(tok) -> None:
    ids = ids_of(tok, "hi")
    proc = OutputProcessor(tok)
    proc.add_request("eos", None, [], SamplingParams())
    proc.add_request("keep", None, [], SamplingParams(include_stop_str_in_output=True, skip_special_tokens=False))
    proc.add_request("stop_id", None, [], SamplingParams(stop_token_ids=[ord("i")]))
    proc.add_request("raw", None, [], SamplingParams(detokenize=False))
    eos = stream(proc, "eos", ids + [EOS_ID], ("stop", None))[0].output().outputs[0]
    keep = stream(proc, "keep", ids + [EOS_ID], ("stop", None))[0].output().outputs[0]
    stop_id = stream(proc, "stop_id", ids, ("stop", ord("i")))[0].output().outputs[0]
    raw = stream(proc, "raw", ids + [IM_END], ("length", None))[0].output().outputs[0]
    assert (eos.text, eos.token_ids, eos.finish_reason, eos.stop_reason) == ("hi", ids + [EOS_ID], "stop", None)
    assert keep.text == "hi<|endoftext|>"
    assert (stop_id.text, stop_id.stop_reason) == ("h", ord("i"))  # the stop token's text is not output
    assert (raw.text, raw.token_ids) == ("", ids + [IM_END])


def test_n_fans_out_into_children_with_derived_seeds(tok) -> None:
    proc = OutputProcessor(tok)
    parent, subs = proc.add_request("7", "p", [1, 2, 3], SamplingParams(n=3, temperature=0.8, seed=10, stop="x"))
    assert [rid for rid, _ in subs] == ["0_7", "1_7", "2_7"]
    assert [sp.seed for _, sp in subs] == [10, 11, 12] and all(sp.n == 1 and sp.stop == ["x"] for _, sp in subs)
    unseeded = proc.add_request("8", "p", [1], SamplingParams(n=2, temperature=0.8))[1]
    assert [sp.seed for _, sp in unseeded] == [None, None]  # the engine derives them from distinct ids
    outs = {}
    for k, (rid, _) in reversed(list(enumerate(subs))):  # children finish in any order
        outs[k] = stream(proc, rid, ids_of(tok, f"c{k}"))[0]
    assert outs[2] is None and outs[1] is None and outs[0] is parent
    res = parent.output()
    assert res.finished and res.request_id == "7" and [c.index for c in res.outputs] == [0, 1, 2]
    assert [c.text for c in res.outputs] == ["c0", "c1", "c2"]


def test_refused_child_fails_the_parent_alone(tok) -> None:
    proc = OutputProcessor(tok)
    _, subs = proc.add_request("r", None, [1], SamplingParams(n=2))
    assert proc.fail(subs[0][0], "refused") is None
    parent = stream(proc, subs[1][0], [104])[0]
    res = parent.output()
    assert res.error == "refused" and [c.finish_reason for c in res.outputs] == ["error", "length"]


def _rows(rng: random.Random, chosen: list[int], k: int) -> Logprobs:
    ids, lps, ranks = [], [], []
    for tok_id in chosen:
        top = rng.sample(range(256), k)
        rank = top.index(tok_id) + 1 if tok_id in top else rng.randint(k + 1, 200)
        ids.append([tok_id, *top])
        lps.append([-rng.random() * 5 for _ in range(k + 1)])
        ranks.append(rank)
    return Logprobs(
        np.array(ids, dtype=np.int32).reshape(len(chosen), k + 1),
        np.array(lps, dtype=np.float32).reshape(len(chosen), k + 1),
        np.array(ranks, dtype=np.int32),
    )


def _step_batch(rng: random.Random, rows: Logprobs, rid: str) -> LogprobsBatch:
    """A step's batch as the worker sends it: another request's row first, then rid's rows."""
    other = _rows(rng, [1], rows.token_ids.shape[1] - 1)
    cat = [
        np.concatenate([a, b])
        for a, b in ((other.token_ids, rows.token_ids), (other.logprobs, rows.logprobs), (other.ranks, rows.ranks))
    ]
    n = len(rows)
    return LogprobsBatch(*cat, ["other"] + [rid] * n, np.array([2] + [rows.token_ids.shape[1] - 1] * n, np.int32))


def test_logprobs_shaped_as_vllm(tok) -> None:
    """Formatting, with hand-made arrays; the engine's own values are checked against HF in test_api_outputs."""
    rng = random.Random(0)
    ids = ids_of(tok, "abcd")
    proc = OutputProcessor(tok)
    proc.add_request("r", None, [5, 6, 7], SamplingParams(logprobs=3, prompt_logprobs=2, stop="c"))
    sample = [_rows(rng, ids[:2], 5), _rows(rng, ids[2:], 5)]  # wider than asked: cut to 3
    prompt = [_rows(rng, [6, 7], 4), None]  # with the first token only
    steps = [_step_batch(rng, rows, "r") for rows in sample]
    parent, aborts = stream(proc, "r", ids, per_step=2, step_logprobs=steps, prompt_logprobs=prompt)
    res = parent.output()
    c = res.outputs[0]
    assert aborts == ["r"] and c.text == "ab" and len(c.token_ids) == 3 == len(c.logprobs)
    flat = [(sample[i // 2], i % 2) for i in range(3)]
    for pos, (lists, row) in zip(c.logprobs, flat, strict=True):
        want = {int(lists.token_ids[row, 0]): (float(lists.logprobs[row, 0]), int(lists.ranks[row]))}
        for r, (t, lp) in enumerate(zip(lists.token_ids[row, 1:4], lists.logprobs[row, 1:4], strict=True), start=1):
            want.setdefault(int(t), (float(lp), r))
        assert {t: (v.logprob, v.rank) for t, v in pos.items()} == want
        assert all(v.decoded_token == tok.decode([t], skip_special_tokens=False) for t, v in pos.items())
    assert c.cumulative_logprob == pytest.approx(sum(float(lists.logprobs[row, 0]) for lists, row in flat))
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == 3
    assert list(res.prompt_logprobs[1])[0] == 6 and len(res.prompt_logprobs[1]) <= 3
    # The positions read as the list vLLM returns: equal to it, sliced to lists, pickled as one.
    as_list = list(c.logprobs)
    assert c.logprobs == as_list and c.logprobs[1:] == as_list[1:] and pickle.loads(pickle.dumps(c.logprobs)) == as_list


def test_position_logprobs_read_between_steps_and_truncated(tok) -> None:
    """Rows read part-way (a stream), appended to, then cut by a stop string before and after the build."""
    rng = random.Random(1)
    proc = OutputProcessor(tok)
    proc.add_request("r", None, [5], SamplingParams(logprobs=1))
    state = proc.states["r"][0].logprobs
    steps = [_rows(rng, [t], 1) for t in (10, 11, 12, 13)]
    for k, rows in enumerate(steps[:2]):
        state.update(EngineCoreOutput("r", [10 + k], step_logprobs=_step_batch(rng, rows, "r")), 1)
    assert len(state.logprobs) == 2 and list(state.logprobs[0])[0] == 10  # built: 2 positions
    for k, rows in enumerate(steps[2:], start=2):
        state.update(EngineCoreOutput("r", [10 + k], step_logprobs=_step_batch(rng, rows, "r")), 1)
    own = [float(r.logprobs[0, 0]) for r in steps]
    assert len(state.logprobs) == 4 and state.cumulative_logprob == pytest.approx(sum(own))
    state.truncate(3)  # an unbuilt row dropped
    assert [next(iter(d)) for d in state.logprobs] == [10, 11, 12]
    state.truncate(1)  # built rows dropped
    assert len(state.logprobs) == 1 and state.cumulative_logprob == pytest.approx(own[0])
    with pytest.raises(ValueError, match="0 logprob rows for 1 new tokens"):
        state.update(EngineCoreOutput("r", [14], step_logprobs=_step_batch(rng, steps[0], "elsewhere")), 1)


def test_no_logprobs_unless_asked(tok) -> None:
    proc = OutputProcessor(tok)
    proc.add_request("r", None, [1], SamplingParams())
    res = stream(proc, "r", [104])[0].output()
    assert res.outputs[0].logprobs is None and res.outputs[0].cumulative_logprob is None
    assert res.prompt_logprobs is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "SamplingParams.n=0: must be >= 1 and <= 1024"),
        (dict(logprobs=21), "SamplingParams.logprobs=21: must be None or an integer in [0, 20]"),
        (dict(prompt_logprobs=-1), "SamplingParams.prompt_logprobs=-1: must be None or an integer in [0, 20]"),
        (dict(stop=[""]), "SamplingParams.stop=['']: must be a non-empty string or a list of at most 64 non-empty"),
        (dict(stop=["x" * 1025]), "non-empty strings of at most 1024 characters"),
        (dict(stop=3), "SamplingParams.stop=3: must be a non-empty string"),
        (dict(include_stop_str_in_output=1), "SamplingParams.include_stop_str_in_output=1: must be a bool"),
        (dict(min_tokens=17), "SamplingParams.min_tokens=17: must be >= 0 and <= max_tokens (16)"),
        (dict(presence_penalty=2.5), "SamplingParams.presence_penalty=2.5: must be in [-2, 2]"),
        (dict(frequency_penalty=float("nan")), "SamplingParams.frequency_penalty=nan: must be in [-2, 2]"),
        (dict(repetition_penalty=0.0), "SamplingParams.repetition_penalty=0.0: must be > 0 and <= 100 (1 disables it)"),
        (dict(skip_special_tokens="no"), "SamplingParams.skip_special_tokens='no': must be a bool"),
        (dict(detokenize=False, stop="x"), "SamplingParams.stop='x': stop strings need detokenize=True"),
    ],
)
def test_new_fields_are_validated(kwargs, message) -> None:
    with pytest.raises(RequestValidationError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


def test_stop_normalized_to_a_list() -> None:
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams().stop == []
    assert SamplingParams.from_dict({"stop": ["a", "b"], "n": 2, "logprobs": 0}).stop == ["a", "b"]


def test_defaults_follow_generation_config(tmp_path) -> None:
    assert default_sampling_params(None) == SamplingParams(**VLLM_DEFAULTS)
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.6,
                "top_p": 0.95,
                "top_k": 20,
                "repetition_penalty": 1.1,
                "max_new_tokens": 64,
                "do_sample": True,
                "min_p": None,
            }
        )
    )
    d = default_sampling_params(str(tmp_path))
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.max_tokens) == (0.6, 0.95, 20, 1.1, 64)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": -5}))
    with pytest.raises(ModelConfigError, match=r"generation_config.json: SamplingParams.top_k=-5"):
        default_sampling_params(str(tmp_path))
