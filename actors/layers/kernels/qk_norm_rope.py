"""Triton per-head q/k RMSNorm (Qwen3) + neox rotary embedding: q and k in one launch.

q and k are read where the QKV projection left them (row-strided views of its output, so no
`.contiguous()` copies) and written to fresh contiguous [T, H*D] tensors, the layout attention
expects. The grid is (token, head tile); the first tiles of a token cover q heads, the rest k heads,
so a tile never mixes the two and picks its tensors with one scalar branch.

With a KVCacheWrite (qk_norm_rope_cache_triton) the k tiles store the rotated K straight into the paged
cache at the token's slot, and further tiles copy V there: the layer then needs no K tensor and no
cache-write launch (kvcore/kernels/cache_write.py's store_kv_tile does both stores, fp8 rounding included).

Rounding matches the torch layers (HF's order): the normalised value and its weight product are
rounded to the activation dtype as in RMSNorm; cos/sin are rounded to the activation dtype; each
product x*cos and rotate_half(x)*sin, and their sum, is rounded to the activation dtype. Since the
products of two bf16 values are exact in fp32, rotary alone is bit-exact; only the fp32 norm
statistic (summation order) can differ from torch, by a few fp32 ulps.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from actors.layers.kernels.rounding import round_to
from kvcore.kernels.cache_write import store_kv_tile
from kvcore.kernels.fp8 import format_constexprs
from kvcore.kernels.ops import KVCacheWrite
from kvcore.kernels.pdl import pdl_enabled, wait_for_previous

TILE_ELEMS = 2048  # elements of one program's tile: enough bytes in flight, few registers


@triton.jit
def _norm_rope_tile(
    src_ptr: tl.tensor,
    w_ptr: tl.tensor,
    stride_st: tl.tensor,
    stride_sh: tl.tensor,
    token: tl.tensor,
    heads: tl.tensor,
    num_heads: tl.tensor,
    cos: tl.tensor,
    sin: tl.tensor,
    eps: tl.tensor,
    HEAD_SIZE: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    HAS_NORM: tl.constexpr,
    GEMMA: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """The two rotated halves of a tile of heads of one token, in the activation dtype, and their mask."""
    half: tl.constexpr = HEAD_SIZE // 2
    dims = tl.arange(0, HALF_BLOCK)
    dim_ok = dims < half
    mask = (heads < num_heads)[:, None] & dim_ok[None, :]
    src = src_ptr + token * stride_st + heads[:, None] * stride_sh + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    dtype = src_ptr.dtype.element_ty
    if HAS_NORM:
        sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        rstd = tl.rsqrt(sum_sq * (1.0 / HEAD_SIZE) + eps)[:, None]
        w1 = tl.load(w_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + half + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
        if GEMMA:  # Gemma-3: scale (1 + w) in fp32, one rounding
            x1 = round_to(x1 * rstd * (1.0 + w1), dtype)
            x2 = round_to(x2 * rstd * (1.0 + w2), dtype)
        else:
            x1 = round_to(round_to(x1 * rstd, dtype) * w1, dtype)
            x2 = round_to(round_to(x2 * rstd, dtype) * w2, dtype)
    # out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); negation is exact.
    o1 = round_to(round_to(x1 * cos, dtype) - round_to(x2 * sin, dtype), dtype)
    o2 = round_to(round_to(x2 * cos, dtype) + round_to(x1 * sin, dtype), dtype)
    return o1, o2, mask


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    q_out_ptr: tl.tensor,
    k_out_ptr: tl.tensor,
    pos_ptr: tl.tensor,
    cache_ptr: tl.tensor,
    qw_ptr: tl.tensor,
    kw_ptr: tl.tensor,
    key_cache_ptr: tl.tensor,
    value_cache_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_kt: tl.tensor,
    stride_kh: tl.tensor,
    stride_vt: tl.tensor,
    stride_vh: tl.tensor,
    stride_qot: tl.tensor,
    stride_kot: tl.tensor,
    stride_cache: tl.tensor,
    stride_kcb: tl.tensor,
    stride_kcs: tl.tensor,
    stride_kch: tl.tensor,
    stride_vcb: tl.tensor,
    stride_vcs: tl.tensor,
    stride_vch: tl.tensor,
    num_q_heads: tl.tensor,
    num_kv_heads: tl.tensor,
    eps: tl.tensor,
    k_inv_scale: tl.tensor,
    v_inv_scale: tl.tensor,
    HEAD_SIZE: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_NORM: tl.constexpr,
    GEMMA: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_EMIN: tl.constexpr,
    FP8_MAX: tl.constexpr,
    USE_PDL: tl.constexpr = False,
) -> None:
    wait_for_previous(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    num_q_tiles = tl.cdiv(num_q_heads, BLOCK_H)
    num_qk_tiles = num_q_tiles + tl.cdiv(num_kv_heads, BLOCK_H)
    half: tl.constexpr = HEAD_SIZE // 2
    dims = tl.arange(0, HALF_BLOCK)
    if tile >= num_qk_tiles:
        # A V tile (WRITE_CACHE only): V needs no rotary, it is copied from the QKV output to its slot.
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            heads = (tile - num_qk_tiles) * BLOCK_H + tl.arange(0, BLOCK_H)
            vdims = tl.arange(0, 2 * HALF_BLOCK)
            vmask = (heads < num_kv_heads)[:, None] & (vdims < HEAD_SIZE)[None, :]
            v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + vdims[None, :], mask=vmask)
            store_kv_tile(
                value_cache_ptr,
                slot,
                heads,
                vdims,
                v,
                vmask,
                v_inv_scale,
                stride_vcb,
                stride_vcs,
                stride_vch,
                CACHE_BLOCK,
                FP8_MANT,
                FP8_EMIN,
                FP8_MAX,
            )
    else:
        dim_ok = dims < half
        pos = tl.load(pos_ptr + token).to(tl.int64)
        row = cache_ptr + pos * stride_cache
        dtype = q_ptr.dtype.element_ty
        cos = round_to(tl.load(row + dims, mask=dim_ok, other=0.0), dtype)[None, :]
        sin = round_to(tl.load(row + half + dims, mask=dim_ok, other=0.0), dtype)[None, :]
        if tile < num_q_tiles:
            heads = tile * BLOCK_H + tl.arange(0, BLOCK_H)
            o1, o2, mask = _norm_rope_tile(
                q_ptr,
                qw_ptr,
                stride_qt,
                stride_qh,
                token,
                heads,
                num_q_heads,
                cos,
                sin,
                eps,
                HEAD_SIZE,
                HALF_BLOCK,
                HAS_NORM,
                GEMMA,
            )
            dst = q_out_ptr + token * stride_qot + heads[:, None] * HEAD_SIZE + dims[None, :]
            tl.store(dst, o1, mask=mask)
            tl.store(dst + half, o2, mask=mask)
        else:
            heads = (tile - num_q_tiles) * BLOCK_H + tl.arange(0, BLOCK_H)
            o1, o2, mask = _norm_rope_tile(
                k_ptr,
                kw_ptr,
                stride_kt,
                stride_kh,
                token,
                heads,
                num_kv_heads,
                cos,
                sin,
                eps,
                HEAD_SIZE,
                HALF_BLOCK,
                HAS_NORM,
                GEMMA,
            )
            if WRITE_CACHE:
                # Rotated K goes from registers to its cache slot: no K tensor, no separate cache-write launch.
                slot = tl.load(slot_ptr + token).to(tl.int64)
                if slot >= 0:
                    store_kv_tile(
                        key_cache_ptr,
                        slot,
                        heads,
                        dims,
                        o1,
                        mask,
                        k_inv_scale,
                        stride_kcb,
                        stride_kcs,
                        stride_kch,
                        CACHE_BLOCK,
                        FP8_MANT,
                        FP8_EMIN,
                        FP8_MAX,
                    )
                    store_kv_tile(
                        key_cache_ptr,
                        slot,
                        heads,
                        dims + half,
                        o2,
                        mask,
                        k_inv_scale,
                        stride_kcb,
                        stride_kcs,
                        stride_kch,
                        CACHE_BLOCK,
                        FP8_MANT,
                        FP8_EMIN,
                        FP8_MAX,
                    )
            else:
                dst = k_out_ptr + token * stride_kot + heads[:, None] * HEAD_SIZE + dims[None, :]
                tl.store(dst, o1, mask=mask)
                tl.store(dst + half, o2, mask=mask)


def _block_heads(num_q_heads: int, num_kv_heads: int, head_size: int) -> int:
    """A power of two dividing both head counts (no half-empty k tile), capped by TILE_ELEMS."""
    common = math.gcd(num_q_heads, num_kv_heads)
    divisor = common & -common
    return max(1, min(divisor, TILE_ELEMS // triton.next_power_of_2(head_size)))


def qk_norm_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] / k [T, Hkv, D] (unit stride on D, any token/head strides); positions [T];
    cos_sin_cache [max_pos, D] fp32 (cos | sin). Norm weights [D] or both None.
    Returns contiguous q [T, Hq*D], k [T, Hkv*D]."""
    num_tokens, num_kv_heads, head_size = k.shape
    k_out = torch.empty((num_tokens, num_kv_heads * head_size), dtype=k.dtype, device=k.device)
    q_out = _launch(q, k, None, positions, cos_sin_cache, q_weight, k_weight, eps, gemma, k_out, None)
    return q_out, k_out


def qk_norm_rope_cache_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cache: KVCacheWrite,
    gemma: bool = False,
) -> torch.Tensor:
    """As qk_norm_rope_triton, but rotated K and V (v [T, Hkv, D]) go straight into the paged cache
    at cache.slot_mapping (slot -1: not written), in the one launch; returns contiguous q [T, Hq*D]."""
    return _launch(q, k, v, positions, cos_sin_cache, q_weight, k_weight, eps, gemma, None, cache)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    gemma: bool,
    k_out: torch.Tensor | None,
    cache: KVCacheWrite | None,
) -> torch.Tensor:
    num_tokens, num_q_heads, head_size = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((num_tokens, num_q_heads * head_size), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    has_norm = q_weight is not None
    block_h = _block_heads(num_q_heads, num_kv_heads, head_size)
    kv_tiles = triton.cdiv(num_kv_heads, block_h)
    grid = (num_tokens, triton.cdiv(num_q_heads, block_h) + kv_tiles * (2 if cache is not None else 1))
    # Unused pointers get a placeholder tensor: their code is compiled out by WRITE_CACHE.
    kc = cache.key_cache if cache is not None else q
    vc = cache.value_cache if cache is not None else q
    vv = v if v is not None else k
    ko = k_out if k_out is not None else q_out
    pdl = pdl_enabled(q.device, num_tokens)
    _qk_norm_rope_kernel[grid](
        q,
        k,
        vv,
        q_out,
        ko,
        positions,
        cos_sin_cache,
        q_weight if has_norm else q,
        k_weight if has_norm else k,
        kc,
        vc,
        cache.slot_mapping if cache is not None else positions,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        vv.stride(0),
        vv.stride(1),
        q_out.stride(0),
        ko.stride(0),
        cos_sin_cache.stride(0),
        *(kc.stride()[:3] if cache is not None else (0, 0, 0)),
        *(vc.stride()[:3] if cache is not None else (0, 0, 0)),
        num_q_heads,
        num_kv_heads,
        eps,
        1.0 / cache.k_scale if cache is not None else 1.0,
        1.0 / cache.v_scale if cache is not None else 1.0,
        HEAD_SIZE=head_size,
        HALF_BLOCK=triton.next_power_of_2(head_size // 2),
        BLOCK_H=block_h,
        HAS_NORM=has_norm,
        GEMMA=gemma,
        WRITE_CACHE=cache is not None,
        CACHE_BLOCK=kc.shape[1] if cache is not None else 1,
        **format_constexprs(kc.dtype),
        USE_PDL=pdl,
        num_warps=4,
        enable_fp_fusion=False,
        launch_pdl=pdl,
    )
    return q_out
