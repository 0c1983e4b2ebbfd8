"""The fp8 KV cache (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2): the Triton cache write against torch's own
fp8 conversion bit for bit, paged attention over an fp8 cache against the torch reference, and the
reference against a dense oracle on the unquantized K/V. Runs under TRITON_INTERPRET=1 on the CPU.
"""

import pytest
import torch

from kvcore.kernels.fp8 import FORMATS, quantize_ref
from kvcore.kernels.ops import reshape_and_cache
from tests.test_attention_kernels import (
    DEVICE,
    SHAPES,
    assert_written_and_untouched,
    dense_oracle,
    make_batch,
    run_attention,
)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def grid_and_ties(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, the midpoints between neighbours (ties: nearest even
    decides), one fp32 ulp either side of each midpoint, and values past the largest finite one."""
    every = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    vals = torch.unique(every[torch.isfinite(every)])  # sorted; +-0 collapse to one
    mids = (vals[1:] + vals[:-1]) / 2
    near = torch.cat([torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    big = FORMATS[dtype].max_value
    extra = torch.tensor([big * 1.01, -big * 1.5, 1e30, -1e30, float("inf"), -float("inf"), -0.0, 1e-30, -1e-30])
    return torch.cat([vals, mids, near, extra])


def write_both(values: torch.Tensor, dtype: torch.dtype, scale: float) -> dict[str, torch.Tensor]:
    """`values` written as keys (and negated as values) by both backends; the caches' raw bytes."""
    d = 8
    n = -(-values.numel() // d)
    x = torch.zeros(n * d)
    x[: values.numel()] = values
    key = x.view(n, 1, d).to(DEVICE)
    slots = torch.arange(n, dtype=torch.int64, device=DEVICE)
    bs = 16
    out = {}
    for backend in ("torch", "triton"):
        kv = torch.zeros(2, -(-n // bs), bs, 1, d, dtype=dtype, device=DEVICE)
        reshape_and_cache(key, -key, kv[0], kv[1], slots, backend=backend, k_scale=scale, v_scale=scale * 2)
        out[backend] = kv.cpu().view(torch.uint8)
    return out


@pytest.mark.parametrize("scale", [1.0, 0.37, 8.0])
@pytest.mark.parametrize("dtype", FP8)
def test_cache_write_rounds_as_torch_does_bit_for_bit(dtype, scale):
    """Saturation, nearest-even ties, subnormals and signed zeros: the kernel's stored bytes equal
    torch's conversion of x / scale (itself equal to the GPU's cvt.rn.satfinite)."""
    caches = write_both(grid_and_ties(dtype), dtype, scale)
    assert torch.equal(caches["torch"], caches["triton"])


def test_quantize_ref_saturates_and_scales():
    x = torch.tensor([1000.0, -1000.0, 3.0, 7.8])
    assert quantize_ref(x, 1.0, torch.float8_e4m3fn).float().tolist() == [448.0, -448.0, 3.0, 8.0]
    assert quantize_ref(x, 4.0, torch.float8_e4m3fn).float().tolist() == [256.0, -256.0, 0.75, 2.0]
    assert quantize_ref(x, 1.0, torch.float8_e5m2).float().tolist() == [1024.0, -1024.0, 3.0, 8.0]


def fp8_batch(kind: str, dtype: torch.dtype, qdtype: torch.dtype, scales: tuple[float, float], **kw):
    """make_batch's paged batch with its caches stored in fp8 (NaN poison stays NaN)."""
    batch = make_batch(*SHAPES[kind], 8, 2, 32, 8, qdtype, **kw)
    batch["key_cache"] = quantize_ref(batch["key_cache"], scales[0], dtype)
    batch["value_cache"] = quantize_ref(batch["value_cache"], scales[1], dtype)
    return batch


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 3.0)])
@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("dtype", FP8)
def test_triton_attention_over_fp8_matches_reference(dtype, kind, scales):
    batch = fp8_batch(kind, dtype, torch.float32, scales, seed=5)
    ref = run_attention(batch, 0.2, None, "torch", scales)
    out = run_attention(batch, 0.2, None, "triton", scales)
    assert_written_and_untouched(out, batch["num_tokens"])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5, equal_nan=True)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_triton_fp8_split_kv_and_window(kind, window):
    """Split-KV partials carry v_scale into the reduce; a window skips the null block's pages."""
    scales = (2.0, 0.25)
    batch = fp8_batch(kind, torch.float8_e4m3fn, torch.float32, scales, window=window, seed=9)
    ref = run_attention(batch, 0.2, window, "torch", scales)
    out = run_attention(batch, 0.2, window, "triton", scales, num_splits=3, block_m=16, block_n=16)
    assert_written_and_untouched(out, batch["num_tokens"])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5, equal_nan=True)


@pytest.mark.parametrize("dtype", FP8)
def test_bf16_queries_over_fp8_cache(dtype):
    """The model's dtype is bf16 and the cache fp8: K/V widen to bf16 exactly, P rounds to bf16 as
    with a bf16 cache."""
    batch = fp8_batch("mixed", dtype, torch.bfloat16, (1.0, 1.0), seed=2)
    ref = run_attention(batch, 0.2, None, "torch")
    out = run_attention(batch, 0.2, None, "triton")
    assert out.dtype == torch.bfloat16
    assert_written_and_untouched(out, batch["num_tokens"])
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2, equal_nan=True)


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.25, 4.0)])
def test_reference_over_fp8_is_the_attention_of_the_scaled_values(scales):
    """Against SDPA on the unquantized K/V: off by fp8's rounding only, so stored * scale is what is
    read (a scale applied the wrong way round would be off by orders of magnitude)."""
    batch = fp8_batch("mixed", torch.float8_e4m3fn, torch.float32, scales, seed=4)
    ref = run_attention(batch, 0.2, None, "torch", scales)[: batch["num_tokens"]]
    dense = dense_oracle(batch, 0.2, None)
    err = (ref - dense).abs().max().item()
    assert err < 0.15, err
    unscaled = run_attention(batch, 0.2, None, "torch")[: batch["num_tokens"]]
    if scales != (1.0, 1.0):
        assert (unscaled - dense).abs().max().item() > 5 * err


def test_scale_rules_name_the_field():
    batch = fp8_batch("decode", torch.float8_e4m3fn, torch.float32, (1.0, 1.0))
    for field, bad in (("k_scale", dict(k_scale=0.0)), ("v_scale", dict(v_scale=float("inf")))):
        with pytest.raises(ValueError, match=field):
            run_attention(batch, 0.2, None, "torch", (bad.get("k_scale", 1.0), bad.get("v_scale", 1.0)))
    key = torch.zeros(1, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale"):
        reshape_and_cache(
            key, key, batch["key_cache"], batch["value_cache"], torch.zeros(1, dtype=torch.int64), k_scale=-1.0
        )


def test_unscaled_fp8_attention_against_a_bf16_cache_holding_the_same_values(monkeypatch):
    """An fp8 cache read with scale 1 holds values a bf16 cache can hold too. Widened to bf16
    (KVRAY_FP8_DOT=bf16) the output bits equal the bf16 cache's; widened to fp16 (the default for bf16
    queries: Hopper converts e4m3 to fp16 in one instruction) q and P round to fp16 instead, within bf16's
    tolerance of it."""
    batch = fp8_batch("mixed", torch.float8_e4m3fn, torch.bfloat16, (1.0, 1.0), seed=6)
    fp16_dots = run_attention(batch, 0.2, None, "triton")
    monkeypatch.setenv("KVRAY_FP8_DOT", "bf16")
    bf16_dots = run_attention(batch, 0.2, None, "triton")
    batch["key_cache"] = batch["key_cache"].to(torch.bfloat16)
    batch["value_cache"] = batch["value_cache"].to(torch.bfloat16)
    bf16_cache = run_attention(batch, 0.2, None, "triton")
    torch.testing.assert_close(bf16_dots, bf16_cache, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(fp16_dots.float(), bf16_cache.float(), atol=3e-2, rtol=3e-2, equal_nan=True)
    assert not torch.equal(fp16_dots, bf16_cache)  # the fp16 path really ran


# ---- the engine with cache.kv_cache_dtype ------------------------------------------------------
def _engine_run(model_dir: str, kv_cache_dtype: str, prompts):
    from actors.driver.engine_core import EngineCore
    from actors.executor.local import LocalExecutor
    from cluster.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from kvcore.request import Request, SamplingParams

    config = EngineConfig(
        model=ModelConfig(model=model_dir, dtype="float32"),
        parallel=ParallelConfig(device="cpu"),
        cache=CacheConfig(block_size=8, cpu_kv_cache_gib=0.001, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, debug_invariants=True),
    )
    with LocalExecutor(config) as executor:
        engine = EngineCore(config, executor)
        layers = executor.worker.model_runner.model.attention_layers()
        cache_dtypes = {layer.kv_cache.dtype for layer in layers}
        for i, p in enumerate(prompts):
            engine.add_request(Request(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None, out.error
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return [tokens[f"g{i}"] for i in range(len(prompts))], engine.stats(), cache_dtypes


def test_engine_with_an_fp8_cache_holds_twice_the_blocks_and_still_generates(tmp_path):
    """The same CPU budget buys four times the blocks in fp8 as in float32; the hybrid model's groups all
    store fp8. Greedy continuations of this random model (init std 0.5) drift apart after a few tokens
    under fp8's rounding, so only the first tokens are compared here; how close fp8 stays is vLLM's
    logprobs rule's job (test_check_logprobs_close)."""
    import hf_models as H

    H.save_hf_model("qwen3_hybrid", str(tmp_path))
    prompts = H.make_prompts()[:4]
    base, base_stats, base_dtypes = _engine_run(str(tmp_path), "auto", prompts)
    fp8, fp8_stats, fp8_dtypes = _engine_run(str(tmp_path), "fp8", prompts)
    assert base_dtypes == {torch.float32} and fp8_dtypes == {torch.float8_e4m3fn}
    assert fp8_stats["num_kv_cache_groups"] == base_stats["num_kv_cache_groups"] == 2
    assert fp8_stats["num_blocks"] >= 4 * base_stats["num_blocks"] - 4  # 1 byte a value against fp32's 4
    assert all(len(t) == 10 for t in fp8)
    assert [t[:3] for t in fp8] == [t[:3] for t in base], (base, fp8)


def test_kv_cache_dtype_names_follow_vllm():
    from actors.config.engine import KV_CACHE_DTYPES
    from cluster.config import ConfigError, config_from_dict
    from kvcore.kernels.fp8 import FP8_KV_DTYPES, kv_cache_torch_dtype

    assert set(KV_CACHE_DTYPES) == {"auto", *FP8_KV_DTYPES}
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ConfigError, match=r"cache.kv_cache_dtype='int8': must be one of \['auto', 'fp8'"):
        config_from_dict({"cache": {"kv_cache_dtype": "int8"}})
