"""Pipeline parallelism against HF transformers: EngineCore + LocalExecutor with PP stages (one process per
rank, gloo) must reproduce HF's greedy continuation token for token, as TP=1 does (tests/test_hf_greedy.py).

Each case runs a roomy pool (every prompt prefills at once; prefix-cache hits) and a tight pool with a
small token budget, where chunked prefill, prefix-cache hits and preemption must all happen, with the
engine's batch queue keeping PP steps in flight. The cases cover an even split, an uneven one (three
stages, the override), TP=2 x PP=2, a hybrid family (sliding-window and full KV-cache groups split over
stages), Gemma (no residual between stages), a tied LM head on a stage without the embedding, and MoE.
The two sampling requests must give the same tokens as at PP=1: generators live with the request. Async
scheduling runs on Ray (each stage an actor) on a dense and a sliding-window family.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses

import hf_models as H
import pytest
from test_hf_greedy import (  # noqa: F401 - hf_reference is a fixture
    SAMPLED,
    check_greedy,
    engine_config,
    hf_reference,
    plain_cpu_children,
    run,
    tight_config,
)

from actors.driver.engine_core import EngineCore
from actors.executor.local import LocalExecutor

# (family, pp, tp, layer partition or None)
CASES = [
    ("llama", 2, 1, None),  # 2 layers: 1 + 1
    ("qwen2", 3, 1, None),  # 3 layers, tied LM head on the last stage, embedding on the first
    ("qwen3_hybrid", 3, 1, (2, 1, 1)),  # uneven, by the override; both KV-cache groups on stage 0
    ("gemma3", 2, 1, (3, 1)),  # sliding + global, no residual between stages
    ("qwen3_moe", 2, 1, None),
    ("llama", 2, 2, None),  # TP=2 x PP=2: four ranks
]


def pp_config(model_dir: str, pp: int, tp: int, partition: tuple[int, ...] | None):
    base = engine_config(model_dir, tp)
    return dataclasses.replace(
        base,
        parallel=dataclasses.replace(base.parallel, pipeline_parallel_size=pp, pp_layer_partition=partition),
    )


@pytest.mark.parametrize(("family", "pp", "tp", "partition"), CASES, ids=[f"{c[0]}-pp{c[1]}-tp{c[2]}" for c in CASES])
def test_pipeline_greedy_matches_hf(family, pp, tp, partition, hf_reference):  # noqa: F811 - the fixture
    model_dir, expected = hf_reference(family)
    prompts = H.make_prompts()
    config = pp_config(model_dir, pp, tp, partition)
    with plain_cpu_children(pp * tp):
        executor = LocalExecutor(config)
    with executor:
        assert executor.collective_rpc("ping") == list(range(pp * tp))
        roomy = EngineCore(config, executor)
        scenario = f"{family} pp={pp} tp={tp} roomy"
        tokens = run(roomy, prompts)
        check_greedy(scenario, tokens, expected, prompts)
        stats = roomy.stats()
        assert stats["prefix_cache_hits"] > 0, f"{scenario}: no prefix hit: {stats}"
        sampled = {r: tokens[r] for r in SAMPLED}
        tight = EngineCore(tight_config(config, family), executor)
        scenario = f"{family} pp={pp} tp={tp} tight"
        tokens = run(tight, prompts)
        check_greedy(scenario, tokens, expected, prompts)
        stats = tight.stats()
        assert stats["num_partial_prefills"] > 0, f"{scenario}: no chunked prefill: {stats}"
        assert stats["prefix_cache_hits"] > 0, f"{scenario}: no prefix hit: {stats}"
        assert stats["num_preemptions"] > 0, f"{scenario}: no preemption: {stats}"
        assert {r: tokens[r] for r in SAMPLED} == sampled, f"{scenario}: sampled tokens differ from roomy"


# ---------------------------------------------------------------- async scheduling, through Ray

ASYNC_CASES = [("llama", 2), ("qwen3_hybrid", 2)]  # a dense family and a sliding-window one, 2 stages each


@pytest.fixture(scope="module")
def local_ray():
    import ray

    from cluster.replicas.placement import start_local_ray

    start_local_ray(num_cpus=3, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize(("family", "pp"), ASYNC_CASES, ids=[f"{c[0]}-pp{c[1]}" for c in ASYNC_CASES])
def test_pipeline_async_scheduling_matches_hf_on_ray(family, pp, hf_reference, local_ray):  # noqa: F811
    """Async scheduling with the batch queue: each stage a Ray actor (gloo between them), the workers answering
    every step with the previous one's output, the driver keeping the queue full. HF's greedy tokens, roomy
    and tight (chunked prefill, prefix hits, preemption), and the sampled requests as without async."""
    from actors.executor.ray_workers import RayExecutor
    from cluster.replicas.placement import create_placement_group, remove

    model_dir, expected = hf_reference(family)
    prompts = H.make_prompts()
    base = pp_config(model_dir, pp, 1, None)
    config = base.replace(async_scheduling=True)
    assert config.use_async_scheduling and config.parallel.pipeline_parallel_size == pp
    pg = create_placement_group(config, name=f"pp-async-{family}")
    executor = None
    try:
        executor = RayExecutor(config, pg)
        roomy = EngineCore(config, executor)
        assert roomy.async_scheduling and roomy.pipeline_depth == pp + 1
        scenario = f"{family} pp={pp} async roomy"
        tokens = run(roomy, prompts)
        check_greedy(scenario, tokens, expected, prompts)
        assert roomy.stats()["prefix_cache_hits"] > 0, f"{scenario}: no prefix hit"
        sampled = {r: tokens[r] for r in SAMPLED}
        tight = EngineCore(tight_config(config, family).replace(async_scheduling=True), executor)
        scenario = f"{family} pp={pp} async tight"
        tokens = run(tight, prompts)
        check_greedy(scenario, tokens, expected, prompts)
        stats = tight.stats()
        assert stats["num_partial_prefills"] > 0, f"{scenario}: no chunked prefill: {stats}"
        assert stats["prefix_cache_hits"] > 0, f"{scenario}: no prefix hit: {stats}"
        assert stats["num_preemptions"] > 0, f"{scenario}: no preemption: {stats}"
        assert {r: tokens[r] for r in SAMPLED} == sampled, f"{scenario}: sampled tokens differ from roomy"
    finally:
        if executor is not None:
            executor.shutdown()
        remove(pg)
