"""A request continued on a fresh engine from the tokens another engine already produced (what a serve
migration sends: RequestSpec.output_token_ids) goes on with exactly the tokens of an uninterrupted run:
seeded sampling (its Philox counter is the output position), presence/frequency/repetition penalties
(their counts include the earlier outputs), min_tokens and max_tokens (counted from the first output),
greedy. The real engine (EngineCore + LocalExecutor + model runner) on a tiny HF Qwen3, on the CPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import hf_models as H
import pytest

from actors.driver.engine_core import EngineCore
from actors.driver.live_requests import make_request
from actors.executor.local import LocalExecutor
from actors.messages import RequestSpec
from cluster.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kvcore.request import Request, SamplingParams

EOS = 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3"))
    H.save_hf_model("qwen3", path)
    return path


def run(path: str, requests: list[Request], async_scheduling: bool) -> dict[str, tuple[list[int], str | None]]:
    """Every request to its end on one fresh engine: {id: (output tokens, finish reason)}."""
    config = EngineConfig(
        model=ModelConfig(model=path, dtype="float32", seed=0),
        parallel=ParallelConfig(tensor_parallel_size=1, device="cpu"),
        cache=CacheConfig(block_size=8, num_gpu_blocks=None, cpu_kv_cache_gib=0.01),
        scheduler=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=64, debug_invariants=True, async_scheduling=async_scheduling
        ),
    )
    executor = LocalExecutor(config)
    try:
        engine = EngineCore(config, executor)
        for r in requests:
            engine.add_request(r)
        outs: dict[str, tuple[list[int], str | None]] = {r.request_id: ([], None) for r in requests}
        for _ in range(2000):
            if not engine.has_unfinished():
                break
            for o in engine.step():
                assert o.error is None, f"{o.request_id}: {o.error}"
                toks, _ = outs[o.request_id]
                outs[o.request_id] = (toks + list(o.new_token_ids), o.finish_reason)
        assert not engine.has_unfinished()
        return outs
    finally:
        executor.shutdown()


PARAMS = {
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=14, ignore_eos=True),
    "penalties": SamplingParams(
        temperature=0.8,
        seed=5,
        max_tokens=14,
        ignore_eos=True,
        presence_penalty=0.4,
        frequency_penalty=0.6,
        repetition_penalty=1.3,
    ),
    "greedy-penalised": SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, frequency_penalty=1.0),
    "min-tokens": SamplingParams(temperature=1.0, seed=3, max_tokens=14, min_tokens=12, stop_token_ids=[5, 7]),
    "unseeded": SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True),
}
PROMPT = [3, 17, 42, 9, 11, 17, 42, 5, 8]


@pytest.mark.parametrize("cut,async_scheduling", [(1, False), (6, False), (13, False), (6, True)])
def test_a_continuation_goes_on_token_exact(model, cut, async_scheduling):
    specs = [RequestSpec(rid, PROMPT, sp) for rid, sp in PARAMS.items()]
    whole = run(model, [make_request(s, [], EOS) for s in specs], async_scheduling)
    cont = [RequestSpec(s.request_id, PROMPT, s.sampling_params, whole[s.request_id][0][:cut]) for s in specs]
    rest = run(model, [make_request(s, [], EOS) for s in cont], async_scheduling)
    for s in specs:
        toks, reason = whole[s.request_id]
        assert len(toks) > cut, (s.request_id, toks)
        assert rest[s.request_id] == (toks[cut:], reason), s.request_id
