"""Property-based fuzzing of what users send: request fields, prompts and input lines (tests/fuzz_strategies.py).

Validation-level properties run without Ray, a few hundred examples. The engine-level ones share one
engine across examples: every prompt of a generate call and every line of a job gets exactly one answer
(an output or an error), and the good ones next to them are served. The longer run is
benchmarks/checks/check_fuzz_long.py.
"""

import json
import math

import pytest
import ray
from fuzz_strategies import input_lines, json_values, prompts, sampling_fields, texts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster import LLM, SamplingParams
from cluster.replicas.placement import start_local_ray
from kvcore.request import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_TEMPERATURE,
    MAX_TOKENS_LIMIT,
    RequestValidationError,
    check_request_id,
    check_text,
    check_token_ids,
    validate,
)

# Derandomized: CI runs the same examples every time (a red run is reproducible); the random exploration
# is benchmarks/checks/check_fuzz_long.py and longer local runs.
FAST = settings(
    max_examples=200,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
ENGINE = settings(
    max_examples=30,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
GOOD = SamplingParams(max_tokens=3, ignore_eos=True)
GOOD_PROMPT = {"prompt_token_ids": [11, 12, 13]}


# ---- validation, no Ray ------------------------------------------------------------------------------
@FAST
@given(sampling_fields)
def test_sampling_fields_are_accepted_in_range_or_refused_by_name(fields):
    try:
        sp = SamplingParams.from_dict(fields)
    except RequestValidationError as e:
        assert str(e).startswith("SamplingParams") and len(str(e)) < 600
        return
    validate(sp)  # what was accepted passes the driver's check too
    assert 0 <= sp.temperature <= MAX_TEMPERATURE and math.isfinite(sp.temperature)
    assert 0 < sp.top_p <= 1 and -1 <= sp.top_k <= INT32_MAX and 1 <= sp.max_tokens <= MAX_TOKENS_LIMIT
    assert sp.seed is None or INT64_MIN <= sp.seed <= INT64_MAX
    assert all(0 <= t <= INT32_MAX for t in sp.stop_token_ids)


@FAST
@given(json_values, json_values, texts)
def test_the_checks_never_raise(ids, value, text):
    for msg in (
        check_token_ids("p", ids),
        check_token_ids("p", ids, vocab_size=260),
        check_text("t", value),
        check_text("t", text),
        check_request_id(value),
        check_request_id(text),
    ):
        assert msg is None or (isinstance(msg, str) and len(msg) < 600)
    if check_text("t", text) is None:
        text.encode("utf-8")


# ---- through one engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    start_local_ray(num_cpus=4, namespace="kvray-test-fuzz", include_dashboard=False)
    engine = LLM(
        model="tiny-random",
        max_model_len=64,
        num_gpu_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        step_timeout_s=60,
    )
    try:
        yield engine
    finally:
        engine.shutdown()
        ray.shutdown()


def _params(fields):
    try:
        return SamplingParams.from_dict({"max_tokens": 3, **fields})
    except RequestValidationError:
        return GOOD


@ENGINE
@given(st.lists(st.tuples(prompts, sampling_fields), min_size=1, max_size=5))
def test_generate_answers_every_prompt_once_and_serves_the_good_one(llm, cases):
    batch = [p for p, _ in cases] + [GOOD_PROMPT]
    params = [_params(f) for _, f in cases] + [GOOD]
    outs = llm.generate(batch, params)
    assert len(outs) == len(batch) and len({o.request_id for o in outs}) == len(batch)
    for o in outs:
        assert o.finished
        assert (o.error is None) == (o.outputs[0].finish_reason != "error"), o
    assert outs[-1].error is None and len(outs[-1].outputs[0].token_ids) == 3


@ENGINE
@given(st.lists(input_lines, min_size=1, max_size=12))
def test_a_job_answers_every_line_once(llm, tmp_path_factory, lines):
    from cluster.job.runner import Job, read_items

    tmp = tmp_path_factory.mktemp("fuzz")
    good = json.dumps({"id": "good-last-7f3a9c", "prompt_token_ids": [5, 6], "max_tokens": 3, "ignore_eos": True})
    data = b"\n".join([*lines, good.encode()]) + b"\n"
    (tmp / "in.jsonl").write_bytes(data)
    job = Job(llm.config, llm.engines, llm.tokenizer, str(tmp / "out.jsonl"), progress=False)
    job.run(read_items(str(tmp / "in.jsonl"), GOOD))
    recs = [json.loads(line) for line in (tmp / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    answered = sorted(r["line"] for r in recs)
    assert answered == list(range(1, len(lines) + 2)), answered
    last = next(r for r in recs if r["line"] == len(lines) + 1)
    assert last["error"] is None and len(last["output_token_ids"]) == 3
    assert llm.generate([GOOD_PROMPT], GOOD)[0].error is None  # and the engine keeps serving
