"""The fused layer kernels (RMSNorm + residual, q/k norm + rotary, SiLU-and-mul) against their torch
references, and a tiny model run with the "triton" layers against the "torch" ones.

bf16 exactness, as tested here: rotary without q/k norm is bit-exact (products of two bf16 values
are exact in fp32, so rounding each product and the sum to bf16 gives torch's bits). RMSNorm and
SiLU-and-mul round one fp32 intermediate (the normalised value; silu(gate)) to bf16 and then multiply
by a bf16 operand; the fp32 intermediate may differ from torch's in its last bits (summation order of
the sum of squares; the exp implementation), so the check is: every output equals torch's product
of the bf16 operand with torch's rounded intermediate or one of its two bf16 neighbours (a 1-ulp
flip of the intermediate, nothing else), and at least 99.9% of outputs are bit-identical. With
q/k norm in front of rotary, a flipped normalised value propagates through x*cos + rot(x)*sin, so
that case uses an absolute tolerance of 1/16 on O(1) values plus the same 99.9% bit-identical rate.
In practice all of these are bit-exact on the inputs below.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.layers.activation import SiluAndMul
from actors.layers.kernels import layer_ops
from actors.layers.kernels.layer_reference import qk_norm_rope_ref, rms_norm_ref, silu_and_mul_ref
from actors.layers.norm import RMSNorm
from actors.layers.rotary import RopeParams, RotaryEmbedding
from kvcore.kernels import ops
from kvcore.kernels.kv_layout import KV_LAYOUTS, paged_kv_view
from kvcore.kernels.ops import KVCacheWrite

GEN = torch.Generator().manual_seed(0)
EXACT_RATE = 0.999
FP32_TOL = dict(atol=2e-6, rtol=2e-6)


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=GEN)).to(dtype)


def norm_weight(n: int, dtype: torch.dtype) -> torch.Tensor:
    return (1 + 0.1 * torch.randn(n, generator=GEN)).to(dtype)


def bf16_neighbours(t: torch.Tensor) -> list[torch.Tensor]:
    """t and the bf16 values one ulp either side of it (adjacent bit patterns)."""
    bits = t.view(torch.int16)
    return [t, (bits + 1).view(torch.bfloat16), (bits - 1).view(torch.bfloat16)]


def assert_one_flip_at_most(out: torch.Tensor, ref: torch.Tensor, intermediate: torch.Tensor, finish) -> None:
    """out == finish(c) for c = torch's bf16 intermediate or a 1-ulp neighbour; mostly bit-exact."""
    ok = torch.zeros_like(out, dtype=torch.bool)
    for cand in bf16_neighbours(intermediate):
        ok |= out == finish(cand)
    assert ok.all(), f"{int((~ok).sum())} outputs are not explained by a 1-ulp intermediate flip"
    assert (out == ref).float().mean() >= EXACT_RATE


# ---------------------------------------------------------------------------------------------
# The references restate the torch layers exactly.


def test_references_match_torch_layers() -> None:
    dtype, d = torch.bfloat16, 16
    norm = RMSNorm(48, 1e-6, dtype)
    norm.weight.data.copy_(norm_weight(48, dtype))
    x, res = randn(5, 48, dtype=dtype), randn(5, 48, dtype=dtype)
    assert torch.equal(rms_norm_ref(x, norm.weight, 1e-6), norm(x))
    for got, want in zip(rms_norm_ref(x, norm.weight, 1e-6, res), norm(x, res), strict=True):
        assert torch.equal(got, want)

    rot = RotaryEmbedding(d, 64, RopeParams(theta=10000.0))
    q_norm, k_norm = RMSNorm(d, 1e-6, dtype), RMSNorm(d, 1e-6, dtype)
    q_norm.weight.data.copy_(norm_weight(d, dtype))
    k_norm.weight.data.copy_(norm_weight(d, dtype))
    q, k, pos = randn(5, 4 * d, dtype=dtype), randn(5, 2 * d, dtype=dtype), torch.tensor([0, 9, 3, 63, 1])
    # As DecoderAttention's torch path does it.
    want = rot(
        pos, q_norm(q.reshape(5, -1, d)).view(5, -1).contiguous(), k_norm(k.reshape(5, -1, d)).view(5, -1).contiguous()
    )
    got = qk_norm_rope_ref(q.view(5, 4, d), k.view(5, 2, d), pos, rot.cos_sin_cache, q_norm.weight, k_norm.weight, 1e-6)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    got = qk_norm_rope_ref(q.view(5, 4, d), k.view(5, 2, d), pos, rot.cos_sin_cache, None, None, 1e-6)
    assert all(torch.equal(g, w) for g, w in zip(got, rot(pos, q, k), strict=True))

    gate_up = randn(5, 24, dtype=dtype)
    assert torch.equal(silu_and_mul_ref(gate_up), SiluAndMul()(gate_up))


# ---------------------------------------------------------------------------------------------
# RMSNorm (+ residual)


def _normed_bf16(x: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 32), (7, 48), (33, 1000), (2, 8192)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, rows: int, hidden: int, with_residual: bool) -> None:
    eps = 1e-6
    x, w = randn(rows, hidden, dtype=dtype, scale=3.0), norm_weight(hidden, dtype)
    res = randn(rows, hidden, dtype=dtype) if with_residual else None
    got = layer_ops.rms_norm(x, w, eps, res, backend="triton")
    want = rms_norm_ref(x, w, eps, res)
    if with_residual:
        assert torch.equal(got[1], want[1]), "x + residual must be rounded exactly as torch does"
        got, want, x = got[0], want[0], want[1]
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32_TOL)
    else:
        assert_one_flip_at_most(got, want, _normed_bf16(x, eps), lambda n: w * n)


def test_rms_norm_strided_and_3d_inputs() -> None:
    eps = 1e-5
    wide = randn(9, 80)
    x, res, w = wide[:, 8:72], randn(9, 64), norm_weight(64, torch.float32)  # row stride 80
    for got, want in zip(
        layer_ops.rms_norm(x, w, eps, res, backend="triton"), rms_norm_ref(x, w, eps, res), strict=True
    ):
        torch.testing.assert_close(got, want, **FP32_TOL)
    x3 = randn(3, 5, 64)
    got = layer_ops.rms_norm(x3, w, eps, backend="triton")
    assert got.shape == x3.shape
    torch.testing.assert_close(got, rms_norm_ref(x3, w, eps), **FP32_TOL)


def test_rms_norm_layer_dispatch() -> None:
    norm = RMSNorm(48, 1e-6, torch.float32, backend="triton")
    norm.weight.data.copy_(norm_weight(48, torch.float32))
    x, res = randn(4, 48), randn(4, 48)
    torch.testing.assert_close(norm(x), rms_norm_ref(x, norm.weight, 1e-6), **FP32_TOL)
    got, new_res = norm(x, res)
    assert torch.equal(new_res, x + res)


# ---------------------------------------------------------------------------------------------
# q/k norm + rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "hq,hkv,d,qk_norm",
    [
        (4, 2, 128, True),  # Qwen3 head size
        (6, 2, 24, True),  # half head 12: masked lanes
        (5, 1, 16, False),  # odd head counts, Llama-style (no norm)
        (8, 8, 64, False),
    ],
)
def test_qk_norm_rope(dtype: torch.dtype, hq: int, hkv: int, d: int, qk_norm: bool) -> None:
    tokens, max_pos, eps = 13, 512, 1e-6
    rot = RotaryEmbedding(d, max_pos, RopeParams(theta=1e6))
    # q and k are read in place from the fused QKV output (row-strided views), as the decoder does.
    qkv = randn(tokens, (hq + 2 * hkv) * d, dtype=dtype, scale=2.0)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    pos = torch.randint(0, max_pos, (tokens,), generator=GEN)
    qw, kw = (norm_weight(d, dtype), norm_weight(d, dtype)) if qk_norm else (None, None)
    got = layer_ops.qk_norm_rope(q, k, pos, rot.cos_sin_cache, qw, kw, eps, backend="triton")
    want = layer_ops.qk_norm_rope(q, k, pos, rot.cos_sin_cache, qw, kw, eps, backend="torch")
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous()
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, **FP32_TOL)
        elif not qk_norm:
            assert torch.equal(g, w), "bf16 rotary without norm must be bit-exact"
        else:
            torch.testing.assert_close(g.float(), w.float(), atol=1 / 16, rtol=0)
            assert (g == w).float().mean() >= EXACT_RATE


@pytest.mark.parametrize(
    "dtype,cache_dtype,hq,hkv,d,qk_norm,gemma",
    [
        (torch.bfloat16, torch.bfloat16, 4, 2, 128, True, False),  # Qwen3
        (torch.bfloat16, torch.bfloat16, 8, 2, 64, False, False),  # Llama-style, GQA 4
        (torch.float32, torch.float32, 6, 2, 24, True, True),  # Gemma-3 norm, masked half lanes
        (torch.bfloat16, torch.float8_e4m3fn, 4, 4, 32, False, False),  # fp8 cache, scaled
    ],
)
@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_qk_norm_rope_into_cache(
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    hq: int,
    hkv: int,
    d: int,
    qk_norm: bool,
    gemma: bool,
    layout: str,
) -> None:
    """One launch (rotary writes K, and V, straight into the paged cache) leaves q and the cache exactly
    as the two-launch path (rotary, then the cache write) and the torch reference do; padding rows
    (slot -1) write nothing, and the rest of the cache is untouched. In both page layouts."""
    tokens, max_pos, eps, num_blocks, block = 9, 256, 1e-6, 6, 4
    rot = RotaryEmbedding(d, max_pos, RopeParams(theta=1e6))
    qkv = randn(tokens, (hq + 2 * hkv) * d, dtype=dtype, scale=2.0)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # row-strided views, as the decoder passes
    pos = torch.randint(0, max_pos, (tokens,), generator=GEN)
    slots = torch.randperm(num_blocks * block, generator=GEN)[:tokens]
    slots[[2, 7]] = -1  # padding rows
    qw, kw = (norm_weight(d, dtype), norm_weight(d, dtype)) if qk_norm else (None, None)
    scales = (0.5, 2.0) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)

    def run(backend: str, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        kv = paged_kv_view(
            torch.zeros(2 * num_blocks * block * hkv * d, dtype=cache_dtype), num_blocks, block, hkv, d, layout
        )
        cache = KVCacheWrite(kv[0], kv[1], slots, *scales)
        if fused:
            out = layer_ops.qk_norm_rope_into_cache(
                q, k, v, pos, rot.cos_sin_cache, cache, qw, kw, eps, backend=backend, gemma=gemma
            )
        else:
            out, k_rot = layer_ops.qk_norm_rope(q, k, pos, rot.cos_sin_cache, qw, kw, eps, backend=backend, gemma=gemma)
            ops.reshape_and_cache(
                k_rot.view(tokens, hkv, d), v.view(tokens, hkv, d), kv[0], kv[1], slots, backend, *scales
            )
        return out, kv

    q_fused, kv_fused = run("triton", fused=True)
    q_split, kv_split = run("triton", fused=False)
    assert torch.equal(q_fused, q_split)
    assert torch.equal(kv_fused.view(torch.uint8), kv_split.view(torch.uint8)), "the cache differs from two launches"
    q_ref, kv_ref = run("torch", fused=True)
    flat = kv_fused.reshape(2, -1, hkv, d)
    written = slots[slots >= 0]
    unwritten = torch.ones(num_blocks * block, dtype=torch.bool)
    unwritten[written] = False
    assert (flat[:, unwritten].float() == 0).all(), "a slot that no token maps to was written"
    assert (flat[:, written].float() != 0).any(dim=(0, 2, 3)).all(), "a token's slot was not written"
    if dtype == torch.float32:
        torch.testing.assert_close(q_fused, q_ref, **FP32_TOL)
        torch.testing.assert_close(kv_fused.float(), kv_ref.float(), **FP32_TOL)
    else:
        torch.testing.assert_close(q_fused.float(), q_ref.float(), atol=1 / 16, rtol=0)
        assert (kv_fused.float() == kv_ref.float()).float().mean() >= EXACT_RATE


def test_fused_cache_write_refuses_a_mismatched_cache() -> None:
    q, k, pos = randn(3, 4 * 16), randn(3, 2 * 16), torch.zeros(3, dtype=torch.int64)
    rot = RotaryEmbedding(16, 8, RopeParams(theta=10000.0))
    kv = torch.zeros(2, 2, 4, 3, 16)  # 3 KV heads, k has 2
    with pytest.raises(ValueError, match=r"does not match key_cache"):
        layer_ops.qk_norm_rope_into_cache(
            q, k, k, pos, rot.cos_sin_cache, KVCacheWrite(kv[0], kv[1], torch.arange(3)), backend="triton"
        )
    kv = torch.zeros(2, 2, 4, 2, 16)
    with pytest.raises(ValueError, match=r"slot_mapping has 2 entries, fewer than the 3 tokens"):
        layer_ops.qk_norm_rope_into_cache(
            q, k, k, pos, rot.cos_sin_cache, KVCacheWrite(kv[0], kv[1], torch.arange(2)), backend="triton"
        )


def test_rotary_layer_dispatch_keeps_shapes() -> None:
    rot = RotaryEmbedding(16, 64, RopeParams(theta=10000.0), backend="triton")
    q, k, pos = randn(3, 4, 16), randn(3, 2 * 16), torch.tensor([5, 0, 63])
    got = rot(pos, q, k)
    assert got[0].shape == q.shape and got[1].shape == k.shape
    want = qk_norm_rope_ref(q, k.view(3, 2, 16), pos, rot.cos_sin_cache, None, None, 0.0)
    torch.testing.assert_close(got[0].reshape(3, -1), want[0], **FP32_TOL)
    torch.testing.assert_close(got[1], want[1], **FP32_TOL)


# ---------------------------------------------------------------------------------------------
# SiLU-and-mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,d", [(1, 8), (13, 1000), (3, 3000)])
def test_silu_and_mul(dtype: torch.dtype, rows: int, d: int) -> None:
    wide = randn(rows, 2 * d + 6, dtype=dtype, scale=3.0)
    x = wide[:, 3 : 3 + 2 * d]  # row-strided, as a sliced projection output would be
    got, want = layer_ops.silu_and_mul(x, backend="triton"), silu_and_mul_ref(x)
    assert got.shape == want.shape and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32_TOL)
    else:
        up = x[:, d:]
        assert_one_flip_at_most(got, want, F.silu(x[:, :d]), lambda a: a * up)
    assert torch.equal(SiluAndMul("triton")(x), got)


# ---------------------------------------------------------------------------------------------
# Edges and errors


def test_empty_batch() -> None:
    w, cache = norm_weight(32, torch.float32), torch.zeros(8, 16)
    assert layer_ops.rms_norm(torch.empty(0, 32), w, 1e-6, backend="triton").shape == (0, 32)
    q, k = layer_ops.qk_norm_rope(
        torch.empty(0, 32), torch.empty(0, 16), torch.empty(0, dtype=torch.int64), cache, backend="triton"
    )
    assert q.shape == (0, 32) and k.shape == (0, 16)
    assert layer_ops.silu_and_mul(torch.empty(0, 32), backend="triton").shape == (0, 16)


def test_bad_inputs_name_the_argument() -> None:
    x, cache, pos = randn(3, 32), torch.zeros(8, 16), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"weight must be \[32\]"):
        layer_ops.rms_norm(x, randn(16), 1e-6, backend="triton")
    with pytest.raises(ValueError, match="residual must match x"):
        layer_ops.rms_norm(x, randn(32), 1e-6, randn(3, 16), backend="triton")
    with pytest.raises(ValueError, match="x dtype must be one of"):
        layer_ops.rms_norm(x.to(torch.int32), randn(32), 1e-6, backend="triton")
    with pytest.raises(ValueError, match="hidden size"):
        layer_ops.rms_norm(randn(1, 32768), randn(32768), 1e-6, backend="triton")
    with pytest.raises(ValueError, match="backend='cuda': must be one of"):
        layer_ops.silu_and_mul(x, backend="cuda")
    with pytest.raises(ValueError, match="last dim must be even"):
        layer_ops.silu_and_mul(randn(3, 7), backend="triton")
    with pytest.raises(ValueError, match="cos_sin_cache must be 2-D float32"):
        layer_ops.qk_norm_rope(x, x, pos, cache.to(torch.bfloat16), backend="triton")
    with pytest.raises(ValueError, match="multiple of head_size 16"):
        layer_ops.qk_norm_rope(randn(3, 24), x, pos, cache, backend="triton")
    with pytest.raises(ValueError, match="positions must be 1-D int32/int64 with 3 entries"):
        layer_ops.qk_norm_rope(x, x, pos[:2], cache, backend="triton")
    with pytest.raises(ValueError, match="k dtype"):
        layer_ops.qk_norm_rope(x, x.to(torch.bfloat16), pos, cache, backend="triton")
    with pytest.raises(ValueError, match=r"q_weight must be \[16\]"):
        layer_ops.qk_norm_rope(x, x, pos, cache, randn(8), randn(16), backend="triton")
    with pytest.raises(ValueError, match="both be given or both None"):
        layer_ops.qk_norm_rope(x, x, pos, cache, randn(16), None, backend="triton")
    with pytest.raises(ValueError, match="backend='cuda'"):
        RMSNorm(8, 1e-6, torch.float32, backend="cuda")


# ---------------------------------------------------------------------------------------------
# A whole model: the tiny-random Qwen3 (q/k norm, hybrid sliding window) through a paged KV cache.


def test_tiny_model_triton_layers_match_torch(tmp_path) -> None:
    from test_model_forward import PagedDriver

    from actors.models.loader import load_model
    from actors.models.tiny_random import ensure_tiny_random

    path = ensure_tiny_random(str(tmp_path))
    prompts = [[72, 101, 108, 108, 111, 32, 119, 111, 114], [84, 104, 101, 32, 99]]
    logits = {}
    for backend in ("torch", "triton"):
        model, _ = load_model(path, dtype="float32", attention_backend=backend)
        assert model.model.layers[0].mlp.act_fn.backend == backend
        driver = PagedDriver(model)
        steps = [driver.step([(0, prompts[0]), (1, prompts[1])])]
        for i in range(2):  # decode: feed a fixed token, compare the logits each step
            steps.append(driver.step([(0, [65 + i]), (1, [97 + i])]))
        logits[backend] = torch.cat([torch.cat(s) for s in steps])
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
    assert torch.equal(logits["triton"].argmax(-1), logits["torch"].argmax(-1))
