"""Triton paged attention for a mixed batch of prefill chunks (with cached prefixes) and decodes.

Design
- One kernel for every query length. A program owns (query tile, sequence, KV head[, KV split]).
  GQA head packing: the M dimension of a tile is BLOCK_Q tokens x GROUP query heads of one KV head
  (row m -> token m // GROUP, head m % GROUP), so each K/V tile loaded from the paged cache serves
  every query head that reads it. A decode packs its GROUP heads into a 16-row tile.
- Two tile shapes: small (16 rows x 128 KV, 4 warps) for decodes and short chunks, large
  (128 rows x 64 KV, 8 warps) for prefill chunks. A mixed batch runs one launch of each, every
  program serving only its class of sequence (decided on the device from query_start_loc).
- K/V tiles of BLOCK_N positions are gathered through the block table per column, so any
  block_size works (16 -> 4 to 8 pages per tile).
- Online softmax in base 2 with fp32 statistics and fp32 accumulation.
- The KV range of a tile is cut into masked head tiles (window start), unmasked middle tiles and
  masked tail tiles (causal diagonal), so most tiles skip the mask arithmetic; tiles wholly
  outside the causal window are never visited.
- Split-KV (flash decoding): with few sequences the grid of sequences x KV heads cannot fill the
  GPU, so each program takes a 1/NUM_SPLITS share of its tile range, writes a normalised partial
  output and its log-sum-exp; a reduce kernel combines them. The share is computed on the device
  from seq_lens, so a split count baked into a CUDA graph stays correct for any context length.
- Gemma-2's attention-logit soft-cap (cap * tanh(score / cap)) is a constexpr branch, so the
  uncapped kernel compiles to exactly what it was.
- Host ints max_query_len / max_seq_len only size the grid and pick heuristics: no device sync.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from kvcore.kernels.attention_tiles import (
    _Tiles,
    choose_num_splits,
    fit,
    head_pad,
    large_tiles,
    num_sms,
    small_tiles,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, t_lo, t_hi, kv_lo, kv_hi, pos, window,
                  k_base, v_base, bt_row, dims, dmask, scale_log2, softcap,
                  stride_kb, stride_ks, stride_vb, stride_vs,
                  BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
                  USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  UPCAST_DOT: tl.constexpr, SOFTCAP: tl.constexpr):
    for t in range(t_lo, t_hi):
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = (cols >= kv_lo) & (cols < kv_hi)
        page = tl.load(bt_row + cols // BLOCK_SIZE, mask=col_ok, other=0).to(tl.int64)
        in_page = (cols % BLOCK_SIZE).to(tl.int64)
        k = tl.load(k_base + (page * stride_kb + in_page * stride_ks)[None, :] + dims[:, None],
                    mask=col_ok[None, :] & dmask[:, None], other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:
            # Gemma-2: cap * tanh(score / cap), with the score scaled by `scale` alone (the host
            # passes it without log2(e)); tanh(x) = 1 - 2 / (e^2x + 1) saturates cleanly at +-1.
            qk = (1.0 - 2.0 / (tl.math.exp2(qk * (2.0 * 1.4426950408889634 / softcap)) + 1.0)) \
                * (softcap * 1.4426950408889634)
        if MASKED:
            visible = col_ok[None, :] & (cols[None, :] <= pos[:, None])
            if USE_WINDOW:
                visible = visible & (cols[None, :] > pos[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + (page * stride_vb + in_page * stride_vs)[:, None] + dims[None, :],
                    mask=col_ok[:, None] & dmask[None, :], other=0.0)
        p_in = p.to(v.dtype)
        if UPCAST_DOT:
            # Same rounding of P as on the GPU, then an fp32 product (see paged_attention_triton).
            p_in = p_in.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_in, v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Ints that vary step to step are not specialised on (Triton would compile a variant for 1 and for
# multiples of 16): a variant compiled at start-up then serves every later step.
@triton.jit(do_not_specialize=["num_q_tiles", "small_q", "num_seqs", "search_steps"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qsl_ptr, seq_lens_ptr, bt_ptr,
    scale_log2, softcap, window, num_q_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    head_size, small_q, num_seqs, search_steps,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, USE_WINDOW: tl.constexpr,
    NUM_SPLITS: tl.constexpr, Q_FILTER: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr, FLAT: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    # Heaviest (latest) query tiles first: under causal masking they have the most KV to read.
    if FLAT:
        # Axis 0 enumerates the query tiles of all sequences: sequence s owns the tiles from
        # qsl[s] // BLOCK_Q + s on (a monotone bound: s's tiles fit before s + 1's), so the grid is
        # cdiv(num_tokens, BLOCK_Q) + num_seqs whatever the lengths, and a program finds its
        # sequence by binary search over qsl on the device.
        g = num_q_tiles - 1 - tl.program_id(0)
        hi = num_seqs - 1
        lo = hi * 0  # a tensor from the start: a loop-carried value may not change type
        for _ in range(search_steps):
            mid = (lo + hi + 1) // 2
            start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
            lo = tl.where(start <= g, mid, lo)
            hi = tl.where(start <= g, hi, mid - 1)
        seq = lo
        q_tile = g - (tl.load(qsl_ptr + seq) // BLOCK_Q + seq)
    else:
        q_tile = num_q_tiles - 1 - tl.program_id(0)
        seq = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q0 = q_tile * BLOCK_Q
    if q0 >= q_len:
        return
    # Two-launch mode (see paged_attention_triton): serve only this launch's class of sequence.
    if Q_FILTER == 1:
        if q_len > small_q:
            return
    if Q_FILTER == 2:
        if q_len <= small_q:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    pos = ctx + tok
    dims = tl.arange(0, HEAD_PAD)
    dmask = dims < head_size
    tok64 = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dmask[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # KV positions any row of this tile may see: [kv_lo, kv_hi).
    pos_min = ctx + q0
    pos_max = ctx + tl.minimum(q0 + BLOCK_Q, q_len) - 1
    kv_hi = pos_max + 1
    if USE_WINDOW:
        kv_lo = tl.maximum(pos_min - window + 1, 0)
        full_lo = tl.maximum(pos_max - window + 1, 0)
    else:
        kv_lo = pos_min * 0
        full_lo = kv_lo
    t_first = kv_lo // BLOCK_N
    t_last = tl.cdiv(kv_hi, BLOCK_N)
    # Tiles [t_a, t_b) are visible to every row: no mask needed there.
    t_a = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N), t_first), t_last)
    t_b = tl.minimum(tl.maximum((pos_min + 1) // BLOCK_N, t_a), t_last)
    # This split's share of the tile range (all of it without splitting).
    per_split = tl.cdiv(t_last - t_first, NUM_SPLITS)
    s_lo = t_first + split * per_split
    s_hi = tl.minimum(s_lo + per_split, t_last)

    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, tl.maximum(s_lo, t_first), tl.minimum(s_hi, t_a), kv_lo, kv_hi, pos,
        window, k_base, v_base, bt_row, dims, dmask, scale_log2, softcap,
        stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_N, BLOCK_SIZE, True, USE_WINDOW,
        DOT_PRECISION, UPCAST_DOT, SOFTCAP)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, tl.maximum(s_lo, t_a), tl.minimum(s_hi, t_b), kv_lo, kv_hi, pos,
        window, k_base, v_base, bt_row, dims, dmask, scale_log2, softcap,
        stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_N, BLOCK_SIZE, False, USE_WINDOW,
        DOT_PRECISION, UPCAST_DOT, SOFTCAP)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, tl.maximum(s_lo, t_b), tl.minimum(s_hi, t_last), kv_lo, kv_hi, pos,
        window, k_base, v_base, bt_row, dims, dmask, scale_log2, softcap,
        stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_N, BLOCK_SIZE, True, USE_WINDOW,
        DOT_PRECISION, UPCAST_DOT, SOFTCAP)

    # Rows that saw nothing (padding rows, or an empty split) keep l == 0: divide by 1 instead.
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    omask = row_ok[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)),
                       float("-inf"))
        tl.store(part_o_ptr + tok64[:, None] * stride_pt + head[:, None] * stride_ph
                 + split * stride_ps + dims[None, :], o, mask=omask)
        tl.store(part_lse_ptr + tok64 * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_seqs"])
def _split_reduce_kernel(part_o_ptr, part_lse_ptr, out_ptr, qsl_ptr, num_seqs,
                         stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                         stride_ot, stride_oh, head_size,
                         NUM_SPLITS: tl.constexpr, SPLIT_PAD: tl.constexpr,
                         HEAD_PAD: tl.constexpr):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    if tok >= tl.load(qsl_ptr + num_seqs):
        return
    tok64 = tok.to(tl.int64)
    splits = tl.arange(0, SPLIT_PAD)
    smask = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_PAD)
    dmask = dims < head_size
    lse = tl.load(part_lse_ptr + tok64 * stride_lt + head * stride_lh + splits, mask=smask,
                  other=float("-inf"))
    weight = tl.math.exp2(lse - tl.max(lse, 0))
    o = tl.load(part_o_ptr + tok64 * stride_pt + head * stride_ph + splits[:, None] * stride_ps
                + dims[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
    res = tl.sum(o * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + tok64 * stride_ot + head * stride_oh + dims,
             res.to(out_ptr.dtype.element_ty), mask=dmask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_FITTED: dict[tuple, _Tiles] = {}  # tiles too big for the device -> the smaller ones that fitted


def _launch(a: dict, tiles: _Tiles, num_splits: int, q_filter: int, small_q: int,
            max_query_len: int) -> None:
    """_launch_tiles with tiles the device holds: head 256 in fp32 (Gemma) needed 281 KiB of shared
    memory on the H200 (227 there), so smaller tiles are tried once per shape and remembered.
    Warm-up launches before any capture, so a CUDA graph never records a failed try."""
    key = (tiles, a["head_pad"], a["query"].dtype, a["precision"])
    tiles = _FITTED.get(key, tiles)
    while True:
        try:
            return _launch_tiles(a, tiles, num_splits, q_filter, small_q, max_query_len)
        except triton.runtime.errors.OutOfResources as e:
            min_rows = tiles.block_m if q_filter != 2 else max(16, a["group"])
            smaller = fit(tiles, min_rows, a["head_pad"], int(e.required), int(e.limit))
            if smaller is None:
                raise
            tiles = _FITTED[key] = smaller


def _launch_tiles(a: dict, tiles: _Tiles, num_splits: int, q_filter: int, small_q: int,
                  max_query_len: int) -> None:
    """One kernel launch over the batch. q_filter 1 serves only sequences with q_len <= small_q,
    2 only the others, 0 all of them."""
    query, key_cache, value_cache, out = a["query"], a["key_cache"], a["value_cache"], a["out"]
    part_o, part_lse, block_table = a["part_o"], a["part_lse"], a["block_table"]
    group = a["group"]
    q_rows = min(max_query_len, small_q) if q_filter == 1 else max_query_len
    block_q = tiles.block_m // group
    num_seqs = a["num_seqs"]
    # Sequences of several tiles: a flat grid over all their tiles, sized by the token count (a
    # shape, so a CUDA graph captured for a token bucket serves any mix of lengths in it). Sequences
    # of one tile (decodes, the small launch): one program per sequence.
    flat = triton.cdiv(q_rows, block_q) > 1
    if flat:
        num_q_tiles = query.shape[0] // block_q + num_seqs
        grid = (num_q_tiles, 1, key_cache.shape[2] * num_splits)
    else:
        num_q_tiles = 1
        grid = (num_q_tiles, num_seqs, key_cache.shape[2] * num_splits)
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, out, part_o, part_lse,
        a["query_start_loc"], a["seq_lens"], block_table,
        a["scale_log2"], a["softcap"], a["window"], num_q_tiles,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        query.shape[2], small_q, num_seqs, max(1, num_seqs.bit_length()),
        GROUP=group, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_SIZE=key_cache.shape[1], HEAD_PAD=a["head_pad"],
        USE_WINDOW=a["window"] > 0, NUM_SPLITS=num_splits, Q_FILTER=q_filter,
        DOT_PRECISION=a["precision"], UPCAST_DOT=a["upcast"], SOFTCAP=a["softcap"] > 0, FLAT=flat,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def paged_attention_triton(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, out: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           block_table: torch.Tensor, scale: float,
                           sliding_window: int | None, max_query_len: int, max_seq_len: int,
                           num_splits: int | None = None, block_m: int | None = None,
                           block_n: int | None = None, softcap: float | None = None) -> None:
    """See kvcore.kernels.ops.paged_attention. num_splits / block_m / block_n override the
    heuristics (tests force the split path and small tiles with them).

    A batch whose longest chunk fits a small tile runs one launch with small tiles. Otherwise it
    runs two: small tiles for the short sequences (decodes), large tiles for the long chunks, each
    program returning at once when its sequence belongs to the other launch. (Decodes in 128-row
    tiles ran ~2x slower on the H200; prefills in 16-row tiles ~5x.)"""
    num_tokens, num_heads, head_size = query.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    group = num_heads // key_cache.shape[2]
    small = small_tiles(group, head_size, query.element_size())
    if block_m is not None or block_n is not None:
        small = _Tiles(block_m or small.block_m, block_n or small.block_n, 4, 2)
    if small.block_m < group:
        raise ValueError(f"block_m={small.block_m} must be >= query heads per KV head ({group})")
    small_q = small.block_m // group
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, key_cache.shape[2], max_query_len, max_seq_len,
                                       num_sms(query.device))
    # Triton's CPU interpreter computes bf16 tl.dot wrongly (numpy has no bf16): there the
    # operands are widened to fp32 first, after the same bf16 rounding of P as on the GPU.
    upcast = _interpreting() and query.dtype == torch.bfloat16
    a: dict[str, Any] = dict(query=query, key_cache=key_cache, value_cache=value_cache, out=out,
             query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
             num_seqs=num_seqs, group=group, scale_log2=scale if softcap else scale * _LOG2E,
             softcap=float(softcap or 0.0),
             window=sliding_window or 0, head_pad=head_pad(head_size),
             precision="ieee" if query.dtype == torch.float32 or upcast else "tf32",
             upcast=upcast, part_o=out, part_lse=out)  # partials unused when NUM_SPLITS == 1
    if num_splits > 1:
        a["part_o"] = torch.empty(num_tokens, num_heads, num_splits, head_size,
                                  dtype=torch.float32, device=query.device)
        a["part_lse"] = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32,
                                    device=query.device)
    if max_query_len <= small_q or block_m is not None:
        _launch(a, small, num_splits, 0, small_q, max_query_len)
    else:
        _launch(a, small, num_splits, 1, small_q, max_query_len)
        _launch(a, large_tiles(group, head_size, query.element_size()), num_splits, 2, small_q, max_query_len)
    if num_splits > 1:
        part_o, part_lse = a["part_o"], a["part_lse"]
        _split_reduce_kernel[(num_tokens, num_heads)](
            part_o, part_lse, out, query_start_loc, num_seqs,
            part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), head_size,
            NUM_SPLITS=num_splits, SPLIT_PAD=max(2, triton.next_power_of_2(num_splits)),
            HEAD_PAD=a["head_pad"], num_warps=4,
        )
