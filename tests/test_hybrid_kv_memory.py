"""Hybrid KV-cache groups: equal-sized groups so a sliding window really saves memory, the max
concurrency they buy for a Gemma-3 shape at 8k context, and identical outputs with the hybrid
manager on and off (every layer managed as full attention), as vLLM checks its own."""

import hf_models as H
import torch

from actors.driver.engine_core import EngineCore
from actors.executor.local import LocalExecutor
from actors.models.kv_memory import kv_cache_report
from cluster.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kvcore.request import Request, SamplingParams
from kvcore.spec import FullAttentionSpec, SlidingWindowSpec, group_layers_by_spec

GEMMA3_12B = dict(
    architectures=["Gemma3ForCausalLM"],
    vocab_size=262208,
    hidden_size=3840,
    intermediate_size=15360,
    num_hidden_layers=48,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    sliding_window=1024,
    sliding_window_pattern=6,
    max_position_embeddings=131072,
    query_pre_attn_scalar=256,
    rope_theta=1e6,
    rope_local_base_freq=1e4,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
)


def _specs(kinds):
    full = FullAttentionSpec(16, 2, 64, torch.bfloat16)
    slide = SlidingWindowSpec(16, 2, 64, torch.bfloat16, sliding_window=128)
    return {f"l{i}": (slide if k == "s" else full) for i, k in enumerate(kinds)}


def test_groups_are_cut_to_the_smallest_kind():
    gemma27b = "".join("f" if (i + 1) % 6 == 0 else "s" for i in range(62))  # 10 global, 52 local
    groups = group_layers_by_spec(_specs(gemma27b))
    assert [len(g.layer_names) for g in groups] == [10] * 5 + [2] + [10]
    assert sum(isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in groups) == 6
    assert [len(g.layer_names) for g in group_layers_by_spec(_specs("sfsf"))] == [2, 2]
    # Within 25% of each other: the larger size, no needless split.
    assert [len(g.layer_names) for g in group_layers_by_spec(_specs("fffffssss"))] == [5, 4]


def test_gemma3_12b_concurrency_at_8k_hybrid_vs_full():
    report = kv_cache_report(GEMMA3_12B, torch.bfloat16, 16, 1, 8192, 2048, budget_bytes=40 << 30)
    hybrid, full = report["hybrid"], report["all_full_attention"]
    assert hybrid["groups"] == ["8 x sliding 1024"] * 5 + ["8 x full"]
    assert full["groups"] == ["48 x full"]
    assert hybrid["bytes_per_block"] * hybrid["num_blocks"] <= 40 << 30
    # 8 global layers keep 8k tokens, 40 local ones 1024 + a chunk: ~2.1x at the peak (a 2048-token chunk
    # in flight) and ~3.7x decoding.
    assert hybrid["max_concurrency"] > 2 * full["max_concurrency"]
    assert hybrid["max_concurrency_decoding"] > 3.5 * full["max_concurrency_decoding"]


def test_fp8_cache_halves_a_block_and_doubles_concurrency():
    bf16 = kv_cache_report(GEMMA3_12B, torch.bfloat16, 16, 1, 8192, 2048, budget_bytes=40 << 30)["hybrid"]
    fp8 = kv_cache_report(
        GEMMA3_12B, torch.bfloat16, 16, 1, 8192, 2048, budget_bytes=40 << 30, cache_dtype=torch.float8_e4m3fn
    )["hybrid"]
    assert fp8["bytes_per_block"] * 2 == bf16["bytes_per_block"]
    assert fp8["num_blocks"] == 2 * bf16["num_blocks"]
    assert fp8["max_concurrency"] > 1.99 * bf16["max_concurrency"]


def _engine_config(model_dir, disable_hybrid):
    return EngineConfig(
        model=ModelConfig(model=model_dir, dtype="float32", seed=0),
        parallel=ParallelConfig(tensor_parallel_size=1, device="cpu"),
        cache=CacheConfig(
            block_size=8, num_gpu_blocks=None, cpu_kv_cache_gib=0.0004, disable_hybrid_kv_cache_manager=disable_hybrid
        ),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, debug_invariants=True),
    )


def _generate(config, prompts):
    with LocalExecutor(config) as executor:
        engine = EngineCore(config, executor)
        for i, p in enumerate(prompts):
            engine.add_request(Request(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))
        engine.add_request(
            Request("s", prompts[1], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7))
        )
        tokens = {}
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens, engine.stats()


def test_hybrid_manager_on_and_off_give_identical_outputs(tmp_path):
    H.save_hf_model("gemma3", str(tmp_path))
    prompts = H.make_prompts()[3:7]  # 90, 120 tokens: past the 24-token window
    hybrid_tokens, hybrid = _generate(_engine_config(str(tmp_path), False), prompts)
    full_tokens, full = _generate(_engine_config(str(tmp_path), True), prompts)
    assert hybrid["num_kv_cache_groups"] == 4 and full["num_kv_cache_groups"] == 1
    assert hybrid_tokens == full_tokens
    assert hybrid["max_concurrency"] > full["max_concurrency"]


def test_kvray_info_reports_kv_layout_and_concurrency():
    from cluster.config import load_config
    from cluster.info import kv_cache_info

    info = kv_cache_info(load_config("configs/local.yaml"))
    assert "error" not in info, info
    assert info["hybrid"]["max_concurrency"] > 0 and info["all_full_attention"]["max_concurrency"] > 0
    assert info["max_model_len"] > 0
