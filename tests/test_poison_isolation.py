"""A poison request (its step raises on the worker while every worker stays alive) fails alone: the
driver finds it by running the step's requests in halves, the others complete with the output they
would have had, no worker restart is spent, and the engine goes on serving.

A test double of the worker (tests/fault_workers.py: PoisonableWorker) makes every step that runs one request id
raise, after the runner has moved its state on, as a real fault would leave it: the validation in
kvcore/request.py now refuses the inputs that did this (top_k=2**40, seed=2**64) before a worker sees them.
"""

import json

import pytest
import ray
from fault_workers import POISONABLE

from cluster import LLM, SamplingParams
from cluster.job.runner import Job, read_items
from cluster.replicas.placement import start_local_ray

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=7)
PROMPTS = [{"prompt_token_ids": [11 + i, 40 + 3 * i, 7, 90 - i]} for i in range(6)]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request):
    start_local_ray(num_cpus=4, namespace=f"kvray-test-poison-{request.param}", include_dashboard=False)
    engine = LLM(
        model="tiny-random",
        max_model_len=64,
        num_gpu_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        step_timeout_s=60,
        max_worker_restarts=1,
        async_scheduling=request.param,
        worker_cls=POISONABLE,
    )
    try:
        yield engine
    finally:
        engine.shutdown()
        ray.shutdown()


def poison(llm: LLM, request_ids: list[str]) -> None:
    ray.get(llm.engines.drivers[0].worker_call.remote(0, "fail_steps_with", request_ids))


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_poison_request_through_generate_fails_alone(llm):
    params = [GREEDY, SAMPLED] * 3
    want = tokens(llm.generate(PROMPTS, params))  # the same requests, no fault
    first = int(llm.generate(PROMPTS[:1], GREEDY)[0].request_id) + 1  # the ids the next call will use
    bad = str(first + 2)
    poison(llm, [bad])
    outs = llm.generate(PROMPTS, params)
    assert outs[2].request_id == bad
    assert outs[2].error is not None and "injected fault" in outs[2].error, outs[2].error
    assert outs[2].outputs[0].finish_reason == "error"
    for i, o in enumerate(outs):
        if i != 2:
            assert o.error is None, (i, o.error)
            assert list(o.outputs[0].token_ids) == want[i], i
    stats = llm.engines.stats()[0]
    assert stats["worker_restarts"] == 0 and stats["fatal"] is None, stats
    poison(llm, [])
    assert tokens(llm.generate(PROMPTS[:3], params[:3])) == want[:3]  # it goes on serving


def test_poison_line_through_the_job_fails_alone(llm, tmp_path):
    lines = [
        json.dumps({"id": f"ok-{i}", "prompt_token_ids": p["prompt_token_ids"], "max_tokens": 5, "ignore_eos": True})
        for i, p in enumerate(PROMPTS)
    ]
    lines.insert(3, json.dumps({"id": "poison", "prompt_token_ids": [1, 2], "max_tokens": 5}))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    want = tokens(llm.generate(PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True)))
    poison(llm, ["poison"])
    try:
        job = Job(llm.config, llm.engines, llm.tokenizer, str(out), progress=False)
        stats = job.run(read_items(str(inp), SamplingParams(max_tokens=5, ignore_eos=True)))
    finally:
        poison(llm, [])
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == {"poison", *(f"ok-{i}" for i in range(len(PROMPTS)))}
    assert recs["poison"]["finish_reason"] == "error" and "injected fault" in recs["poison"]["error"]
    for i in range(len(PROMPTS)):
        assert recs[f"ok-{i}"]["error"] is None and recs[f"ok-{i}"]["output_token_ids"] == want[i], i
    assert stats.errors == 1
    assert llm.engines.stats()[0]["worker_restarts"] == 0
