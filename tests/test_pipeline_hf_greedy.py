"""Pipeline parallelism against HF transformers: EngineCore + LocalExecutor with PP stages (one process per
rank, gloo) must reproduce HF's greedy continuation token for token, as TP=1 does (tests/test_hf_greedy.py).

Each case runs a roomy pool (every prompt prefills at once; prefix-cache hits) and a tight pool with a
small token budget, where chunked prefill, prefix-cache hits and preemption must all happen, with the
engine's batch queue keeping PP steps in flight. The cases cover an even split, an uneven one (three
stages, the override), TP=2 x PP=2, a hybrid family (sliding-window and full KV-cache groups split over
stages), Gemma (no residual between stages), a tied LM head on a stage without the embedding, and MoE.
The two sampling requests must give the same tokens as at PP=1: generators live with the request.
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
