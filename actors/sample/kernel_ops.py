"""The building blocks of the sample kernel (actors/sample/kernel.py): the counter-based Philox
uniforms its draws use, the order-preserving integer key of a float its top-k / top-p bisections run
on, a logits tile with the logit row (logit_bias, allowed_token_ids, bad words), penalties, bans
and temperature applied, the running argmax; and the
uniforms as a tensor, for the tests against the torch Philox.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def philox_uniform(seed: tl.tensor, pos: tl.tensor, start: tl.tensor, BLOCK_V: tl.constexpr) -> tl.tensor:
    """Philox uniforms in [0, 1) for (seed [R], pos [R]) x vocabulary entries start .. start + BLOCK_V
    -> [R, BLOCK_V]; start a multiple of 4. Entry v is lane v & 3 of counter (v >> 2, pos): one Philox
    evaluation serves four entries (at 256 rows x 151,936 the draw was bound by Philox's integer work)."""
    groups = (start >> 2) + tl.arange(0, BLOCK_V // 4)
    counter = (pos[:, None].to(tl.int64) << 32) | groups[None, :].to(tl.int64)
    u0, u1, u2, u3 = tl.rand4x(seed[:, None], counter)
    return tl.interleave(tl.interleave(u0, u2), tl.interleave(u1, u3))  # entry 4g + k = lane k of group g


@triton.jit
def order_key(y: tl.tensor) -> tl.tensor:
    """An int64 key with the float32 order: bits for positives, sign-magnitude flipped for negatives."""
    bits = y.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def tile_values(
    logits_ptr: tl.tensor,
    stride_l: tl.tensor,
    rows: tl.tensor,
    rmask: tl.tensor,
    offs: tl.tensor,
    V: tl.tensor,
    t_eff: tl.tensor,
    slot: tl.tensor,
    pres: tl.tensor,
    freq: tl.tensor,
    rep: tl.tensor,
    counts_ptr: tl.tensor,
    pmask_ptr: tl.tensor,
    stride_c: tl.tensor,
    ban_ptr: tl.tensor,
    prev_ptr: tl.tensor,
    stride_b: tl.tensor,
    num_ban: tl.tensor,
    last: tl.tensor,
    lrow_ptr: tl.tensor,
    lslot: tl.tensor,
    stride_lr: tl.tensor,
    HAS_PENALTY: tl.constexpr,
    HAS_BAN: tl.constexpr,
    HAS_BAN_PREV: tl.constexpr,
    HAS_ROW: tl.constexpr,
) -> tl.tensor:
    """The processed, temperature-scaled logits of a [R, BLOCK_V] tile; -inf outside the vocabulary.

    In vLLM's order: the logit row (logit_bias added, -inf outside allowed_token_ids and at one-token bad
    words), the penalties, then the bans (-inf: min_tokens' stop ids, and the last token of a longer bad
    word whose other tokens end the output), then the temperature."""
    m2 = rmask[:, None] & (offs[None, :] < V)
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + offs[None, :], mask=m2, other=float("-inf")).to(
        tl.float32
    )
    if HAS_ROW:
        rm = m2 & (lslot[:, None] >= 0)
        x += tl.load(lrow_ptr + lslot[:, None].to(tl.int64) * stride_lr + offs[None, :], mask=rm, other=0.0)
    if HAS_PENALTY:
        # vLLM's apply_penalties: repetition over prompt + output tokens, then frequency and presence
        # over the output tokens' counts.
        pm = m2 & (slot[:, None] >= 0)
        base = slot[:, None].to(tl.int64) * stride_c + offs[None, :]
        cnt = tl.load(counts_ptr + base, mask=pm, other=0)
        seen = (tl.load(pmask_ptr + base, mask=pm, other=0) != 0) | (cnt > 0)
        r = rep[:, None]
        x = tl.where(seen, x * tl.where(x > 0, 1.0 / r, r), x)
        x = x - freq[:, None] * cnt.to(tl.float32)
        x = x - pres[:, None] * (cnt > 0).to(tl.float32)
    if HAS_BAN:
        # A runtime loop: stop_token_ids may be long, and unrolling would compile a variant per width.
        for j in range(num_ban):
            banned = tl.load(ban_ptr + rows.to(tl.int64) * stride_b + j, mask=rmask, other=-1)
            if HAS_BAN_PREV:
                # A conditional ban: only when the sequence's last token is `prev` (-1: always).
                prev = tl.load(prev_ptr + rows.to(tl.int64) * stride_b + j, mask=rmask, other=-1)
                banned = tl.where((prev < 0) | (prev == last), banned, -1)
            x = tl.where(offs[None, :] == banned[:, None], float("-inf"), x)
    return x / t_eff[:, None]


@triton.jit
def argmax_update(s: tl.tensor, start: tl.tensor, best: tl.tensor, best_i: tl.tensor) -> tl.tensor:
    """Fold a tile's row maxima into the running ones; the first index wins ties, as torch.argmax."""
    tile_best = tl.max(s, axis=1)
    tile_arg = tl.argmax(s, axis=1).to(tl.int64) + start
    upd = tile_best > best
    return tl.where(upd, tile_best, best), tl.where(upd, tile_arg, best_i)


@triton.jit
def merge_shares(
    part_val_ptr: tl.tensor,
    part_idx_ptr: tl.tensor,
    count_ptr: tl.tensor,
    rows: tl.tensor,
    rmask: tl.tensor,
    m: tl.tensor,
    g_arg: tl.tensor,
    best: tl.tensor,
    best_i: tl.tensor,
    SPLIT_PAD: tl.constexpr,
) -> tl.tensor:
    """A row split over programs (the vocabulary in shares): each program leaves its maxima and their
    indices in scratch and counts itself done; the last to finish (`last`) merges every share, the
    earliest winning ties (so the first index wins, as in one pass), and resets the count for the next
    launch. One launch and no memset: the count starts and ends at zero. The others' merge is discarded."""
    share = tl.program_id(1)
    cell = (rows * SPLIT_PAD + share).to(tl.int64) * 2
    tl.store(part_val_ptr + cell, m, mask=rmask)
    tl.store(part_val_ptr + cell + 1, best, mask=rmask)
    tl.store(part_idx_ptr + cell, g_arg, mask=rmask)
    tl.store(part_idx_ptr + cell + 1, best_i, mask=rmask)
    tl.debug_barrier()  # every thread's stores before the release below
    done = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel")
    # As a row vector: the interpreter refuses a scalar bool combined into a mask.
    last = (tl.zeros_like(rows) + done) == tl.num_programs(1) - 1
    shares = tl.arange(0, SPLIT_PAD)
    ok = rmask[:, None] & (shares[None, :] < tl.num_programs(1)) & last[:, None]
    at = (rows[:, None] * SPLIT_PAD + shares[None, :]).to(tl.int64) * 2
    g_arg = share_winner(part_val_ptr, part_idx_ptr, at, ok, shares)  # the greedy argmax
    best_i = share_winner(part_val_ptr + 1, part_idx_ptr + 1, at, ok, shares)  # the race's winner
    tl.atomic_xchg(count_ptr + tl.program_id(0), 0, mask=done == tl.num_programs(1) - 1)
    return g_arg, best_i, last


@triton.jit
def share_winner(val_ptr: tl.tensor, idx_ptr: tl.tensor, at: tl.tensor, ok: tl.tensor, shares: tl.tensor) -> tl.tensor:
    # .cg: read the other programs' shares from L2, past this SM's L1
    vals = tl.load(val_ptr + at, mask=ok, other=float("-inf"), cache_modifier=".cg")
    idx = tl.load(idx_ptr + at, mask=ok, other=0, cache_modifier=".cg")
    j = tl.argmax(vals, axis=1, tie_break_left=True)
    return tl.sum(tl.where(shares[None, :] == j[:, None], idx, 0), axis=1)


@triton.jit
def _uniform_kernel(
    out_ptr: tl.tensor, seed_ptr: tl.tensor, pos_ptr: tl.tensor, V: tl.tensor, BLOCK_V: tl.constexpr
) -> None:
    """The uniforms the sampler draws for one row, for tests against the torch Philox."""
    row = tl.program_id(0)
    seed = tl.load(seed_ptr + row + tl.zeros((1,), tl.int32))
    pos = tl.load(pos_ptr + row + tl.zeros((1,), tl.int32))
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        u = philox_uniform(seed, pos, start, BLOCK_V)
        tl.store(out_ptr + row * V + offs[None, :], u, mask=offs[None, :] < V)


def philox_uniform_triton(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    _uniform_kernel[(seeds.shape[0],)](out, seeds, positions, vocab, BLOCK_V=128)
    return out
