"""Triton reshape_and_cache: scatter this step's K/V rows into the paged cache at their slots.

One program per (token, tile of KV heads): the slot is read once, the head tile is copied for K and
V. Slot -1 (padding, or tokens whose KV must not be written) makes the program return at once.
An fp8 cache (FP8_MANT > 0) stores x / scale, saturated, nearest even (kvcore/kernels/fp8.py), rounded
onto the fp8 grid by kvcore/kernels/fp8_round.py before the (then exact) cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore.kernels.fp8 import format_constexprs
from kvcore.kernels.fp8_round import round_to_fp8_grid


@triton.jit
def store_kv_tile(
    cache_ptr: tl.tensor,
    slot: tl.tensor,
    heads: tl.tensor,
    dims: tl.tensor,
    x: tl.tensor,
    mask: tl.tensor,
    inv_scale: tl.tensor,
    stride_b: tl.tensor,
    stride_s: tl.tensor,
    stride_h: tl.tensor,
    BLOCK_SIZE: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_EMIN: tl.constexpr,
    FP8_MAX: tl.constexpr,
) -> None:
    """x [heads, dims] of one token into the cache row of `slot` (>= 0, int64). Shared with the fused
    rotary kernel (actors/layers/kernels/qk_norm_rope.py), which writes K straight from its registers."""
    if FP8_MANT > 0:
        x = round_to_fp8_grid(x.to(tl.float32) * inv_scale, FP8_MANT, FP8_EMIN, FP8_MAX)
    row = cache_ptr + (slot // BLOCK_SIZE) * stride_b + (slot % BLOCK_SIZE) * stride_s
    tl.store(row + heads[:, None] * stride_h + dims[None, :], x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr: tl.tensor,
    value_ptr: tl.tensor,
    key_cache_ptr: tl.tensor,
    value_cache_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    stride_kt: tl.tensor,
    stride_kh: tl.tensor,
    stride_vt: tl.tensor,
    stride_vh: tl.tensor,
    stride_kcb: tl.tensor,
    stride_kcs: tl.tensor,
    stride_kch: tl.tensor,
    stride_vcb: tl.tensor,
    stride_vcs: tl.tensor,
    stride_vch: tl.tensor,
    num_kv_heads: tl.tensor,
    head_size: tl.tensor,
    k_inv_scale: tl.tensor,
    v_inv_scale: tl.tensor,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_EMIN: tl.constexpr,
    FP8_MAX: tl.constexpr,
) -> None:
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_size)
    t64 = token.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    store_kv_tile(
        key_cache_ptr,
        slot,
        heads,
        dims,
        k,
        mask,
        k_inv_scale,
        stride_kcb,
        stride_kcs,
        stride_kch,
        BLOCK_SIZE,
        FP8_MANT,
        FP8_EMIN,
        FP8_MAX,
    )
    store_kv_tile(
        value_cache_ptr,
        slot,
        heads,
        dims,
        v,
        mask,
        v_inv_scale,
        stride_vcb,
        stride_vcs,
        stride_vch,
        BLOCK_SIZE,
        FP8_MANT,
        FP8_EMIN,
        FP8_MAX,
    )


def reshape_and_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value [T, Hkv, D] (last dim contiguous); caches [num_blocks, block_size, Hkv, D]; the
    scales only matter to an fp8 cache."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_size)
    # Keep a program's tile around 4K elements: enough bytes in flight, few registers.
    block_h = max(1, min(triton.next_power_of_2(num_kv_heads), 4096 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _reshape_and_cache_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        num_kv_heads,
        head_size,
        1.0 / k_scale,
        1.0 / v_scale,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        **format_constexprs(key_cache.dtype),
    )
