"""Triton paged attention for a mixed batch of prefill chunks (with cached prefixes) and decodes: the
launches (tile choice, split-KV partials, grids); the kernels are in paged_attention_kernels.py.

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
  output and its log-sum-exp; a reduce launch merges them. (Merging inside the attention kernel, by
  the last split to finish, measured slower: it puts the merge on the layer's critical path.) The
  share is computed on the device from seq_lens, so a split count baked into a CUDA graph stays
  correct for any context length.
- Gemma-2's attention-logit soft-cap (cap * tanh(score / cap)) is a constexpr branch, so the
  uncapped kernel compiles to exactly what it was.
- Longest first (LPT): given seq_order, the sequences by descending seq_len on the device, the
  one-tile launch enumerates sequences in that order with a sequence's KV heads side by side. The
  hardware dispatches programs about in grid order, so at mixed context lengths the last wave holds
  the shortest programs instead of a few long ones. The order changes no result; the runner passes
  one only to batches of few waves (attention_tiles.longest_first_max_seqs).
- An fp8 cache (kv_cache_dtype fp8): K/V tiles are loaded as fp8 (half the bytes) and widened exactly
  before the dots; k_scale is folded into the score scale and v_scale applied to the output, so the
  tiles need no multiply. With bf16 queries the tiles widen to fp16 and the dots run in fp16 (q and P
  rounded to fp16, which holds them at least as precisely as bf16 at these magnitudes): Hopper converts
  e4m3 to fp16 in one instruction per pair, while widening to bf16 made decode attention over fp8
  ~1.2x *slower* than over bf16 on the H200 (measured there: nano's 129-256-row steps 7.54 against 6.38 ms).
- KVRAY_DECODE_PREFETCH=1 (an A/B switch, off by default): the decode loop loads the next tile's K and V
  into registers before this tile's dots. Triton's own pipelining of the loop issues tile t+1's copies
  after tile t's dots and waits for them at once (the page-table load makes K and V indirect), so a block
  never has a load in flight while it computes; bf16 hides that with twice the bytes a wait, fp8 does not
  (benchmarks/RESULTS.md, *Decode attention over an fp8 cache*).
- Host ints max_query_len / max_seq_len only size the grid and pick heuristics: no device sync.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton

from kvcore.kernels import interpreting
from kvcore.kernels.attention_tiles import (
    Tiles,
    choose_num_splits,
    fit,
    head_pad,
    large_tiles,
    num_sms,
    small_tiles,
)
from kvcore.kernels.fp8 import is_fp8
from kvcore.kernels.paged_attention_kernels import paged_attention_kernel, split_reduce_kernel
from kvcore.kernels.pdl import pdl_enabled

_LOG2E = 1.4426950408889634
# KVRAY_FP8_DOT=bf16 widens fp8 tiles to bf16 for bf16 queries instead of fp16 (the A/B switch behind that choice).
FP8_DOT_ENV = "KVRAY_FP8_DOT"


FITTED_TILES: dict[tuple, Tiles] = {}  # tiles too big for the device -> the smaller ones that fitted


def _launch(a: dict, tiles: Tiles, num_splits: int, q_filter: int, small_q: int, max_query_len: int) -> None:
    """launch_tiles with tiles the device holds: head 256 in fp32 (Gemma) needed 281 KiB of shared
    memory on the H200 (227 there), so smaller tiles are tried once per shape and remembered.
    Warm-up launches before any capture, so a CUDA graph never records a failed try."""
    key = (tiles, a["head_pad"], a["query"].dtype, a["key_cache"].dtype, a["precision"])
    tiles = FITTED_TILES.get(key, tiles)
    while True:
        try:
            return launch_tiles(a, tiles, num_splits, q_filter, small_q, max_query_len)
        except triton.runtime.errors.OutOfResources as e:
            min_rows = tiles.block_m if q_filter != 2 else max(16, a["group"])
            smaller = fit(tiles, min_rows, a["head_pad"], int(e.required), int(e.limit))
            if smaller is None:
                raise
            tiles = FITTED_TILES[key] = smaller


def launch_tiles(a: dict, tiles: Tiles, num_splits: int, q_filter: int, small_q: int, max_query_len: int) -> None:
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
    order = a["seq_order"]
    ordered = order is not None and not flat
    if ordered:
        grid = (key_cache.shape[2] * num_splits, num_seqs, 1)
    paged_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        out,
        part_o,
        part_lse,
        a["query_start_loc"],
        a["seq_lens"],
        block_table,
        order if ordered else a["seq_lens"],  # unread unless ORDERED
        a["scale_log2"],
        a["softcap"],
        a["window"],
        a["v_scale"],
        num_q_tiles,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        query.shape[2],
        small_q,
        num_seqs,
        max(1, num_seqs.bit_length()),
        GROUP=group,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_SIZE=key_cache.shape[1],
        HEAD_PAD=a["head_pad"],
        USE_WINDOW=a["window"] > 0,
        NUM_SPLITS=num_splits,
        Q_FILTER=q_filter,
        DOT_PRECISION=a["precision"],
        UPCAST_DOT=a["upcast"],
        SOFTCAP=a["softcap"] > 0,
        FLAT=flat,
        ORDERED=ordered,
        KV_FP8=is_fp8(key_cache.dtype),
        FP8_DOT_F16=a["fp8_dot_f16"],
        PREFETCH=tiles.prefetch,
        USE_PDL=a["pdl"],
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        launch_pdl=a["pdl"],
    )


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    softcap: float | None = None,
    seq_order: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
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
        small = Tiles(block_m or small.block_m, block_n or small.block_n, 4, 2, small.prefetch)
    if small.block_m < group:
        raise ValueError(f"block_m={small.block_m} must be >= query heads per KV head ({group})")
    small_q = small.block_m // group
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, key_cache.shape[2], max_query_len, max_seq_len, num_sms(query.device))
    # Triton's CPU interpreter computes bf16 tl.dot wrongly (numpy has no bf16): there the
    # operands are widened to fp32 first, after the same bf16 rounding of P as on the GPU.
    upcast = interpreting() and query.dtype == torch.bfloat16
    a: dict[str, Any] = dict(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        out=out,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        num_seqs=num_seqs,
        group=group,
        # An fp8 cache's k_scale scales every score: folded in here, once for the launch.
        scale_log2=(scale if softcap else scale * _LOG2E) * k_scale,
        v_scale=float(v_scale),
        softcap=float(softcap or 0.0),
        window=sliding_window or 0,
        head_pad=head_pad(head_size),
        precision="ieee" if query.dtype == torch.float32 or upcast else "tf32",
        upcast=upcast,
        part_o=out,
        part_lse=out,
        seq_order=seq_order,
        pdl=pdl_enabled(query.device, num_tokens),
        fp8_dot_f16=is_fp8(key_cache.dtype)
        and query.dtype == torch.bfloat16
        and os.environ.get(FP8_DOT_ENV, "fp16") == "fp16",
    )  # partials unused when NUM_SPLITS == 1
    if num_splits > 1:
        a["part_o"] = torch.empty(
            num_tokens, num_heads, num_splits, head_size, dtype=torch.float32, device=query.device
        )
        a["part_lse"] = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)
    if max_query_len <= small_q or block_m is not None:
        _launch(a, small, num_splits, 0, small_q, max_query_len)
    else:
        _launch(a, small, num_splits, 1, small_q, max_query_len)
        _launch(a, large_tiles(group, head_size, query.element_size()), num_splits, 2, small_q, max_query_len)
    if num_splits > 1:
        part_o, part_lse = a["part_o"], a["part_lse"]
        split_reduce_kernel[(num_tokens, num_heads)](
            part_o,
            part_lse,
            out,
            query_start_loc,
            num_seqs,
            part_o.stride(0),
            part_o.stride(1),
            part_o.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            head_size,
            NUM_SPLITS=num_splits,
            SPLIT_PAD=max(2, triton.next_power_of_2(num_splits)),
            HEAD_PAD=a["head_pad"],
            USE_PDL=a["pdl"],
            num_warps=4,
            launch_pdl=a["pdl"],
        )
