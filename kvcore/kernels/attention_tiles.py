"""Launch heuristics of the paged attention kernel: tile shapes by query length, the split-KV count,
and the smaller tiles to fall back to when a device's shared memory cannot hold the first choice."""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton

# Below this many tokens per split, the reduce overhead outweighs the extra parallelism.
_MIN_TOKENS_PER_SPLIT = 128


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int) -> int:
    """Split the KV range only for decode batches whose (sequence x KV head) grid leaves SMs idle
    (fewer programs than SMs), aiming at ~2 programs per SM, never below _MIN_TOKENS_PER_SPLIT
    context tokens a split. Measured on the H200 (132 SMs): B=32 x 8 KV heads runs best unsplit,
    B=8 with 4 splits, B=1 with 16-32. Rounded down to a power of two: at mixed context lengths
    (bench_attention_splits, 2026-12-02) 3 and 5 splits ran 10-30% slower than 2 and 4 (B=16: 46 vs
    40 us; B=8: 27 vs 21 us)."""
    if max_query_len != 1:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    splits = min(triton.cdiv(2 * num_sms, programs), max_seq_len // _MIN_TOKENS_PER_SPLIT)
    return 1 << (max(1, splits).bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # The next KV tile loaded into registers while this one's dots run (KVRAY_DECODE_PREFETCH).
    prefetch: bool = False


# Head rows of more bytes than this (head 256 in float32) take the wide-row tiles below: on the H200
# the usual ones either did not fit shared memory or compiled for over 40 s and then did not fit; 16x32
# and 32x16 tiles in 2 stages compiled in ~5 s and matched the reference.
_WIDE_ROW_BYTES = 512


def head_pad(head_size: int) -> int:
    """The head dimension as the kernels tile it: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(head_size))


def _wide(head_size: int, elem_bytes: int) -> bool:
    return head_pad(head_size) * elem_bytes > _WIDE_ROW_BYTES


# KVRAY_DECODE_TILES=BLOCK_N:WARPS:STAGES replaces the small tiles' KV width, warps and stages: an
# A/B of a tile change end to end without a new tree (the engine's workers inherit the environment).
DECODE_TILES_ENV = "KVRAY_DECODE_TILES"


@functools.lru_cache(maxsize=None)
def decode_tiles_override(value: str | None) -> tuple[int, int, int] | None:
    if not value:
        return None
    try:
        n, w, st = (int(x) for x in value.split(":"))
    except ValueError:
        raise ValueError(f"{DECODE_TILES_ENV}={value!r}: must be BLOCK_N:WARPS:STAGES, e.g. 64:4:2") from None
    ok = n >= 16 and n & (n - 1) == 0 and w in (1, 2, 4, 8) and 1 <= st <= 6
    if not ok:
        raise ValueError(
            f"{DECODE_TILES_ENV}={value!r}: BLOCK_N must be a power of two >= 16, WARPS 1/2/4/8, STAGES 1-6"
        )
    return n, w, st


# KVRAY_DECODE_PREFETCH=1 gives the small tiles the register prefetch of the next KV tile (an A/B of the
# decode loop's structure: Triton's own pipelining of this loop waits for each tile right after issuing it).
DECODE_PREFETCH_ENV = "KVRAY_DECODE_PREFETCH"


def decode_prefetch() -> bool:
    value = os.environ.get(DECODE_PREFETCH_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{DECODE_PREFETCH_ENV}={value!r}: must be 0 or 1")
    return value == "1"


# KVRAY_DECODE_ORDER=grid launches decodes in batch order instead of longest first (an A/B switch,
# inherited by the workers like KVRAY_DECODE_TILES).
DECODE_ORDER_ENV = "KVRAY_DECODE_ORDER"


# Longest first paid where a launch holds at most ~4 programs an SM (H200, Qwen3-0.6B nano recipe: its
# 17-64-row steps 3.7% faster end to end, B=64 attention 72 -> 58 us) and cost 1.5-5% at ~15 (B=256 x 8
# KV heads): there the waves are many, the last one small, and the order's extra load per program shows.
_LPT_MAX_PROGRAMS_PER_SM = 4


def longest_first_max_seqs(num_kv_heads: int, num_sms: int) -> int:
    """Batches of 2 to this many sequences launch their decodes longest first (0: never)."""
    value = os.environ.get(DECODE_ORDER_ENV, "lpt")
    if value not in ("lpt", "grid"):
        raise ValueError(f"{DECODE_ORDER_ENV}={value!r}: must be 'lpt' (longest first) or 'grid'")
    return _LPT_MAX_PROGRAMS_PER_SM * num_sms // max(1, num_kv_heads) if value == "lpt" else 0


def small_tiles(group: int, head_size: int = 128, elem_bytes: int = 2) -> Tiles:
    """Decodes and short chunks: the smallest MMA (16 rows) holding the GROUP heads of a token;
    128-wide KV tiles keep enough bytes in flight for the bandwidth-bound case."""
    rows = max(16, triton.next_power_of_2(group))
    if _wide(head_size, elem_bytes):
        return Tiles(rows, 32, 4, 2)
    override = decode_tiles_override(os.environ.get(DECODE_TILES_ENV))
    tiles = Tiles(rows, *override) if override is not None else Tiles(rows, 128, 4, 3)
    return dataclasses.replace(tiles, prefetch=True) if decode_prefetch() else tiles


def large_tiles(group: int, head_size: int, elem_bytes: int = 2) -> Tiles:
    """Prefill chunks: 128-row tiles keep Hopper's tensor cores busy; head sizes above 128 halve
    the rows to keep the fp32 accumulator in registers."""
    if _wide(head_size, elem_bytes):
        return Tiles(max(32, triton.next_power_of_2(group)), 16, 4, 2)
    block_m = max(128 if head_pad(head_size) <= 128 else 64, triton.next_power_of_2(group))
    return Tiles(block_m, 64, 8 if block_m >= 128 else 4, 3)


def shrink(tiles: Tiles, min_rows: int) -> Tiles | None:
    """KV columns halved to 16, then fewer stages, then rows halved down to min_rows (the small
    launch keeps its rows: they decide which launch serves a sequence); None when nothing is left."""
    if tiles.block_n > 16:
        return dataclasses.replace(tiles, block_n=tiles.block_n // 2)
    if tiles.num_stages > 1:
        return dataclasses.replace(tiles, num_stages=tiles.num_stages - 1)
    if tiles.block_m // 2 >= min_rows:
        return dataclasses.replace(tiles, block_m=tiles.block_m // 2, num_warps=4)
    return None


def smem_model(tiles: Tiles, head_pad: int) -> int:
    """Shared memory of a launch, up to a constant factor: the pipelined K and V tiles plus the
    score tile. Only ratios are used, calibrated by what the compiler reported for one variant."""
    return max(1, tiles.num_stages - 1) * 2 * tiles.block_n * head_pad + tiles.block_m * tiles.block_n


def fit(tiles: Tiles, min_rows: int, head_pad: int, required: int, limit: int) -> Tiles | None:
    """The first tiles along shrink()'s chain that should fit: the compiler said `tiles` need
    `required` bytes against `limit`, and each candidate is scaled by smem_model. One failed compile
    then jumps straight to a fitting variant, where walking the chain one step a time compiled up to
    six variants of the largest kernel (minutes for head 256 in float32)."""
    base = smem_model(tiles, head_pad)
    cand = shrink(tiles, min_rows)
    while cand is not None and required * smem_model(cand, head_pad) > limit * base:
        nxt = shrink(cand, min_rows)
        if nxt is None:
            return cand  # the smallest left: let the compiler decide
        cand = nxt
    return cand
