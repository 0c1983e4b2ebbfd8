"""End to end through the user API: LLM -> driver actor (scheduler + KV-cache manager) -> Ray worker
actors (one per TP rank, in a placement group) -> paged attention, on the CPU. Greedy output must equal
HF transformers token for token on tiny random models: TP=1 and TP=2 (both transports), a hybrid
sliding-window model, a pool so small that requests are preempted, and two data-parallel engines.
One local Ray for the module (bounded CPUs), shut down at the end."""

import hf_models as H
import pytest
import ray

from cluster import LLM, SamplingParams
from cluster.replicas.placement import start_local_ray

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Small step buffers keep the Triton interpreter (CI runs kernels under it) fast.
COMMON = dict(
    device="cpu",
    dtype="float32",
    block_size=8,
    max_num_seqs=8,
    max_num_batched_tokens=128,
    cpu_kv_cache_gib=0.01,
    step_timeout_s=60,
    placement_timeout_s=30,
)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    start_local_ray(num_cpus=6, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return H.greedy_references(tmp_path_factory.mktemp, NEW_TOKENS)


def run(path, prompts, **kwargs):
    llm = LLM(model=path, **{**COMMON, **kwargs})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        return outs, llm.stats()
    finally:
        llm.shutdown()


def assert_equal_to_hf(outs, prompts, expected):
    assert [o.prompt_token_ids for o in outs] == prompts  # input order kept
    for i, (o, exp) in enumerate(zip(outs, expected, strict=True)):
        assert o.error is None, o.error
        assert o.outputs[0].finish_reason == "length"
        assert o.outputs[0].token_ids == exp, f"prompt {i}: {o.outputs[0].token_ids} != HF {exp}"


def test_tp1_compiled_graph_matches_hf_and_bad_prompts_fail_alone(reference):
    path, prompts, expected = reference("qwen3")
    llm = LLM(model=path, **COMMON, tensor_parallel_size=1, transport="compiled_graph")
    try:
        mixed = [{"prompt_token_ids": p} for p in prompts[:3]] + [
            "text prompt without a tokenizer",
            {"prompt_token_ids": [1, 10_000]},
            {"prompt_token_ids": []},
            {"prompt_token_ids": prompts[4]},
        ]
        outs = llm.generate(mixed, GREEDY)
        assert_equal_to_hf(outs[:3], prompts[:3], expected[:3])
        assert_equal_to_hf(outs[6:], [prompts[4]], [expected[4]])
        assert "no tokenizer.json" in outs[3].error and outs[3].outputs[0].finish_reason == "error"
        assert "outside the vocabulary [0, 256)" in outs[4].error
        assert "prompt_token_ids is empty" in outs[5].error
        # The engine keeps serving after the bad ones, with per-request sampling params in a list.
        again = llm.generate(
            [{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": prompts[1]}],
            [GREEDY, SamplingParams(max_tokens=3, ignore_eos=True)],
        )
        assert again[0].outputs[0].token_ids == expected[0]
        assert again[1].outputs[0].token_ids == expected[1][:3]
        assert again[0].metrics.ttft_s > 0 and again[0].metrics.num_output_tokens == NEW_TOKENS
        stats = llm.stats()[0]
        assert stats["num_steps"] > 0 and stats["worker_restarts"] == 0 and stats["fatal"] is None
        assert stats["prefix_cache_hits"] > 0  # the second round re-used the first round's blocks
    finally:
        llm.shutdown()
    assert llm.engines is None


def test_tp2_actor_calls_matches_hf(reference):
    path, prompts, expected = reference("qwen3")
    outs, _ = run(path, prompts, tensor_parallel_size=2, transport="actor_calls")
    assert_equal_to_hf(outs, prompts, expected)


def test_hybrid_sliding_window_tp2_matches_hf(reference):
    path, prompts, expected = reference("qwen3_hybrid")
    outs, stats = run(path, prompts, tensor_parallel_size=2, transport="compiled_graph")
    assert_equal_to_hf(outs, prompts, expected)
    assert stats[0]["num_kv_cache_groups"] == 2


def test_tight_block_budget_preempts_and_still_matches_hf(reference):
    path, prompts, expected = reference("qwen3")
    # The longest request needs 17 blocks of 8; 24 blocks make requests take turns.
    outs, stats = run(path, prompts, tensor_parallel_size=1, num_gpu_blocks=24, max_num_batched_tokens=32)
    assert_equal_to_hf(outs, prompts, expected)
    assert stats[0]["num_preemptions"] > 0
    assert stats[0]["peak_kv_cache_usage"] > 0.5


def test_two_data_parallel_engines_match_hf_and_share_the_load(reference):
    path, prompts, expected = reference("qwen3")
    outs, stats = run(path, prompts, tensor_parallel_size=1, data_parallel_size=2)
    assert_equal_to_hf(outs, prompts, expected)
    assert len(stats) == 2 and all(s["num_steps"] > 0 for s in stats)
    assert sum(s["num_output_tokens"] for s in stats) == NEW_TOKENS * len(prompts)
    assert ray.util.placement_group_table() and all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )
