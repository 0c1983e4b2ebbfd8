"""One Triton launch that samples every row of a step: logit_bias / allowed_token_ids / bad words,
penalties, min-tokens ban, temperature, min-p, top-k, top-p and a Gumbel-max draw from a counter-based
generator.

Randomness: the uniform of vocabulary entry v for the token at output position `pos` of a request with
seed `s` is lane v & 3 of Philox4x32-10 with key s (64 bits) and counter (v >> 2, pos, 0, 0), Triton's
`tl.rand4x` with the 64-bit offset pos << 32 | v >> 2. It depends on nothing else: not the row, not the
batch, not the process, so a seeded request draws the same tokens in any batch and after any restart. The draw is the
exponential race in log space: argmax_v y_v - log(-log u_v) picks v with probability softmax(y)_v.

Min-p, top-k and top-p are thresholds found by bisection on the float's order-preserving integer key (exact;
a pass over the row per step, stopping once no key lies inside the bracket, at most 33 each): top-k
keeps every token whose value is >= the k-th largest; min-p (vLLM's: p >= min_p x the top probability)
keeps every token with y >= max + log(min_p), applied with top-k as vLLM does before top-p; top-p then keeps
every token whose strictly-larger tokens hold less than p of the top-k mass. Ties at a cut-off are all
kept (vLLM's top-k does the same; its top-p splits ties by sort order). Rows without either filter
make one pass. The plain-torch reference is actors/sample/reference.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The kernel's building blocks (actors/sample/kernel_ops.py), under the names its body calls them by.
from actors.sample.kernel_ops import argmax_update as _argmax_update
from actors.sample.kernel_ops import merge_shares as _merge_shares
from actors.sample.kernel_ops import order_key as _order_key
from actors.sample.kernel_ops import philox_uniform as _uniform
from actors.sample.kernel_ops import tile_values as _values
from kvcore.kernels.attention_tiles import num_sms

INT32_MIN = tl.constexpr(-(2**31))  # a plain global is refused by the compiler (the interpreter allows it)
BISECT_STEPS = 33  # an int32 key range (2**32 + 1 wide) halves to adjacent keys in 33 steps
SPLIT_PAD = 64  # the most vocabulary shares of one row
_COUNTS: dict[torch.device, torch.Tensor] = {}


def vocab_shares(blocks: int, tiles: int, device: torch.device) -> int:
    """Programs a row's vocabulary is split over (no filter): one program a row leaves most SMs idle
    below ~130 rows and runs a Philox draw per entry on one SM (158 us for 50 rows of 152k on the
    H200), so aim at ~4 programs an SM, at least 2 vocabulary tiles a share."""
    if device.type != "cuda":
        return min(2, tiles)  # the interpreter: the merge path, cheaply
    return max(1, min(SPLIT_PAD, triton.cdiv(4 * num_sms(device), blocks), tiles // 2))


def _share_counts(blocks: int, device: torch.device) -> torch.Tensor:
    """The per-row-block counts of finished shares: zeros, and each launch leaves them zero."""
    c = _COUNTS.get(device)
    if c is None or c.numel() < blocks:
        c = _COUNTS[device] = torch.zeros(max(blocks, 256), dtype=torch.int32, device=device)
    return c


# The row count and the ban list's width only bound loops and masks. Specialised (1, a multiple of 16,
# anything else), each would compile the kernel up to three times over: at start-up for the warm-up's row
# counts, and at a step's first ban list of a new width class, mid-run.
@triton.jit(do_not_specialize=["n_rows", "num_ban", "stride_b"])
def _sample_kernel(
    logits_ptr: tl.tensor,
    stride_l: tl.tensor,
    out_ptr: tl.tensor,
    temp_ptr: tl.tensor,
    topk_ptr: tl.tensor,
    topp_ptr: tl.tensor,
    seed_ptr: tl.tensor,
    pos_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    pen_ptr: tl.tensor,
    stride_p: tl.tensor,
    counts_ptr: tl.tensor,
    pmask_ptr: tl.tensor,
    stride_c: tl.tensor,
    ban_ptr: tl.tensor,
    prev_ptr: tl.tensor,
    stride_b: tl.tensor,
    num_ban: tl.tensor,
    last_ptr: tl.tensor,
    lrow_ptr: tl.tensor,
    lslot_ptr: tl.tensor,
    stride_lr: tl.tensor,
    minp_ptr: tl.tensor,
    n_rows: tl.tensor,
    V: tl.tensor,
    part_val_ptr: tl.tensor,
    part_idx_ptr: tl.tensor,
    count_ptr: tl.tensor,
    chunk: tl.tensor,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_PENALTY: tl.constexpr,
    HAS_BAN: tl.constexpr,
    HAS_BAN_PREV: tl.constexpr,
    HAS_ROW: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    HAS_FILTER: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
    STEPS: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
) -> None:
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    if ALL_GREEDY:  # no draw: the per-row sampling inputs are not read (greedy_argmax passes placeholders)
        greedy = rows >= 0
        t_eff = tl.full((BLOCK_R,), 1.0, tl.float32)
        seed = tl.zeros((BLOCK_R,), tl.int64)
        pos = tl.zeros((BLOCK_R,), tl.int64)
    else:
        temp = tl.load(temp_ptr + rows, mask=rmask, other=0.0)
        greedy = temp <= 0.0
        t_eff = tl.where(greedy, 1.0, temp)
        seed = tl.load(seed_ptr + rows, mask=rmask, other=0)
        pos = tl.load(pos_ptr + rows, mask=rmask, other=0)
    slot = tl.full((BLOCK_R,), -1, tl.int64)
    pres = tl.zeros((BLOCK_R,), tl.float32)
    freq = tl.zeros((BLOCK_R,), tl.float32)
    rep = tl.full((BLOCK_R,), 1.0, tl.float32)
    if HAS_PENALTY:
        slot = tl.load(slot_ptr + rows, mask=rmask, other=-1).to(tl.int64)
        pres = tl.load(pen_ptr + rows, mask=rmask, other=0.0)
        freq = tl.load(pen_ptr + stride_p + rows, mask=rmask, other=0.0)
        rep = tl.load(pen_ptr + 2 * stride_p + rows, mask=rmask, other=1.0)
    last_tok = tl.full((BLOCK_R,), -1, tl.int64)  # each row's last token (bad words' conditional bans)
    if HAS_BAN_PREV:
        last_tok = tl.load(last_ptr + rows, mask=rmask, other=-1)
    lslot = tl.full((BLOCK_R,), -1, tl.int64)
    if HAS_ROW:
        lslot = tl.load(lslot_ptr + rows, mask=rmask, other=-1)
    base = tl.arange(0, BLOCK_V)
    neg_inf = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    zero_i = tl.zeros((BLOCK_R,), tl.int64)

    # Pass 1: the row maximum, the greedy argmax and (no filter) the race's winner; without a filter,
    # over this program's share of the vocabulary (grid axis 1; the whole row with a filter).
    m, g_arg = neg_inf, zero_i
    best, best_i = neg_inf, zero_i
    v_lo = tl.program_id(1) * chunk
    for start in range(v_lo, tl.minimum(V, v_lo + chunk), BLOCK_V):
        offs = start + base
        y = _values(
            logits_ptr,
            stride_l,
            rows,
            rmask,
            offs,
            V,
            t_eff,
            slot,
            pres,
            freq,
            rep,
            counts_ptr,
            pmask_ptr,
            stride_c,
            ban_ptr,
            prev_ptr,
            stride_b,
            num_ban,
            last_tok,
            lrow_ptr,
            lslot,
            stride_lr,
            HAS_PENALTY,
            HAS_BAN,
            HAS_BAN_PREV,
            HAS_ROW,
        )
        m, g_arg = _argmax_update(y, start, m, g_arg)
        if not HAS_FILTER and not ALL_GREEDY:
            score = y - tl.log(-tl.log(_uniform(seed, pos, start, BLOCK_V)))
            best, best_i = _argmax_update(score, start, best, best_i)

    if HAS_FILTER:
        top_k = tl.load(topk_ptr + rows, mask=rmask, other=0)
        top_k = tl.where((top_k <= 0) | (top_k > V), V, top_k)
        top_p = tl.load(topp_ptr + rows, mask=rmask, other=1.0)
        key_max = _order_key(m)
        # Both searches keep lo (condition true) and hi (false) and stop once no token's key lies strictly
        # between them (count(key > lo) == count(key >= hi)): the kept set can no longer change. Typical
        # rows stop after 10-20 passes; 33 bound the worst case.
        # top-k: the largest key t with count(key >= t) >= k.
        t_k = tl.full((BLOCK_R,), INT32_MIN, tl.int64)
        if tl.max((top_k < V).to(tl.int32), axis=0) > 0:
            lo, hi = t_k, key_max + 1
            gt_lo = tl.where(top_k < V, V, 0).to(tl.int64)  # count(key > lo); rows without top-k: done
            ge_hi = zero_i  # count(key >= hi)
            for _ in range(STEPS):
                if tl.max(gt_lo - ge_hi, axis=0) > 0:
                    mid = lo + (hi - lo) // 2
                    ge, gt = zero_i, zero_i
                    for start in range(0, V, BLOCK_V):
                        offs = start + base
                        y = _values(
                            logits_ptr,
                            stride_l,
                            rows,
                            rmask,
                            offs,
                            V,
                            t_eff,
                            slot,
                            pres,
                            freq,
                            rep,
                            counts_ptr,
                            pmask_ptr,
                            stride_c,
                            ban_ptr,
                            prev_ptr,
                            stride_b,
                            num_ban,
                            last_tok,
                            lrow_ptr,
                            lslot,
                            stride_lr,
                            HAS_PENALTY,
                            HAS_BAN,
                            HAS_BAN_PREV,
                            HAS_ROW,
                        )
                        key = _order_key(y)
                        valid = offs[None, :] < V
                        ge += tl.sum(((key >= mid[:, None]) & valid).to(tl.int64), axis=1)
                        gt += tl.sum(((key > mid[:, None]) & valid).to(tl.int64), axis=1)
                    ok = ge >= top_k
                    lo = tl.where(ok, mid, lo)
                    gt_lo = tl.where(ok, gt, gt_lo)
                    hi = tl.where(ok, hi, mid)
                    ge_hi = tl.where(ok, ge_hi, ge)
            t_k = lo
        if HAS_MIN_P:
            # min_p keeps p_v >= min_p * p_max, i.e. y_v >= m + log(min_p): one more lower bound on the key.
            min_p = tl.load(minp_ptr + rows, mask=rmask, other=0.0)
            t_min = tl.where(min_p > 0.0, _order_key(m + tl.log(tl.maximum(min_p, 1e-30))), INT32_MIN)
            t_k = tl.maximum(t_k, t_min)
        # top-p: the smallest key t whose strictly-larger kept tokens hold less than p of the kept mass.
        thr = t_k
        if tl.min(top_p, axis=0) < 1.0:
            total = tl.zeros((BLOCK_R,), tl.float32)
            gt_lo = zero_i  # count(kept key > t_k - 1)
            ge_hi = zero_i  # count(kept key >= key_max)
            for start in range(0, V, BLOCK_V):
                offs = start + base
                y = _values(
                    logits_ptr,
                    stride_l,
                    rows,
                    rmask,
                    offs,
                    V,
                    t_eff,
                    slot,
                    pres,
                    freq,
                    rep,
                    counts_ptr,
                    pmask_ptr,
                    stride_c,
                    ban_ptr,
                    prev_ptr,
                    stride_b,
                    num_ban,
                    last_tok,
                    lrow_ptr,
                    lslot,
                    stride_lr,
                    HAS_PENALTY,
                    HAS_BAN,
                    HAS_BAN_PREV,
                    HAS_ROW,
                )
                key = _order_key(y)
                kept = (key >= t_k[:, None]) & (offs[None, :] < V)
                total += tl.sum(tl.where(kept, tl.exp(y - m[:, None]), 0.0), axis=1)
                gt_lo += tl.sum(kept.to(tl.int64), axis=1)
                ge_hi += tl.sum((kept & (key >= key_max[:, None])).to(tl.int64), axis=1)
            gt_lo = tl.where(top_p < 1.0, gt_lo, ge_hi)  # rows without top-p: done
            lo, hi = t_k - 1, key_max
            for _ in range(STEPS):
                if tl.max(gt_lo - ge_hi, axis=0) > 0:
                    mid = lo + (hi - lo) // 2
                    mass = tl.zeros((BLOCK_R,), tl.float32)
                    ge, gt = zero_i, zero_i
                    for start in range(0, V, BLOCK_V):
                        offs = start + base
                        y = _values(
                            logits_ptr,
                            stride_l,
                            rows,
                            rmask,
                            offs,
                            V,
                            t_eff,
                            slot,
                            pres,
                            freq,
                            rep,
                            counts_ptr,
                            pmask_ptr,
                            stride_c,
                            ban_ptr,
                            prev_ptr,
                            stride_b,
                            num_ban,
                            last_tok,
                            lrow_ptr,
                            lslot,
                            stride_lr,
                            HAS_PENALTY,
                            HAS_BAN,
                            HAS_BAN_PREV,
                            HAS_ROW,
                        )
                        key = _order_key(y)
                        kept = (key >= t_k[:, None]) & (offs[None, :] < V)
                        above = kept & (key > mid[:, None])
                        mass += tl.sum(tl.where(above, tl.exp(y - m[:, None]), 0.0), axis=1)
                        gt += tl.sum(above.to(tl.int64), axis=1)
                        ge += tl.sum((kept & (key >= mid[:, None])).to(tl.int64), axis=1)
                    ok = mass < top_p * total
                    hi = tl.where(ok, mid, hi)
                    ge_hi = tl.where(ok, ge, ge_hi)
                    lo = tl.where(ok, lo, mid)
                    gt_lo = tl.where(ok, gt_lo, gt)
            thr = tl.where(top_p < 1.0, hi, t_k)
        for start in range(0, V, BLOCK_V):
            offs = start + base
            y = _values(
                logits_ptr,
                stride_l,
                rows,
                rmask,
                offs,
                V,
                t_eff,
                slot,
                pres,
                freq,
                rep,
                counts_ptr,
                pmask_ptr,
                stride_c,
                ban_ptr,
                prev_ptr,
                stride_b,
                num_ban,
                last_tok,
                lrow_ptr,
                lslot,
                stride_lr,
                HAS_PENALTY,
                HAS_BAN,
                HAS_BAN_PREV,
                HAS_ROW,
            )
            score = y - tl.log(-tl.log(_uniform(seed, pos, start, BLOCK_V)))
            score = tl.where(_order_key(y) >= thr[:, None], score, float("-inf"))
            best, best_i = _argmax_update(score, start, best, best_i)
    if tl.num_programs(1) > 1:
        g_arg, best_i, last = _merge_shares(
            part_val_ptr, part_idx_ptr, count_ptr, rows, rmask, m, g_arg, best, best_i, SPLIT_PAD
        )
        rmask = rmask & last  # the row's last share to finish stores the token
    tl.store(out_ptr + rows, tl.where(greedy, g_arg, best_i), mask=rmask)


def launch_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    need_filter: bool,
    penalty_slots: torch.Tensor | None = None,
    penalties: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
    ban_ids: torch.Tensor | None = None,
    ban_prev: torch.Tensor | None = None,
    last_tokens: torch.Tensor | None = None,
    logit_rows: torch.Tensor | None = None,
    logit_slots: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    rows_per_program: int = 1,
    block_v: int | None = None,
    all_greedy: bool = False,
) -> torch.Tensor:
    """Sampled token ids int64 [N] for logits [N, V] (any float dtype, unit stride along V).

    penalties is float32 [3, >=N] (presence, frequency, repetition); counts int32 and prompt_mask
    uint8/bool [slots, V] are indexed by penalty_slots (-1: none). logit_rows float32 [slots, V] are
    added to the logits of the rows logit_slots int64 [N] name (-1: none). ban_ids int32 [N, B] (-1 pads)
    are set to -inf; with ban_prev int32 [N, B] an entry whose prev is not -1 only when last_tokens
    int64 [N] (each row's last token) equals it. min_p float32 [N] (0: off) needs need_filter.
    rows_per_program > 1 only for the interpreter (it vectorises a program's rows). all_greedy: every
    row is greedy and nothing is applied (greedy_argmax); temperature .. positions are then not read.
    """
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    # The kernel reads per-row values at unit stride (a no-op for the runner's buffers).
    temperature, top_k, top_p, seeds, positions = (
        t.contiguous() for t in (temperature, top_k, top_p, seeds, positions)
    )
    dummy = temperature
    pen_args: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor, int]
    if penalty_slots is not None:
        assert penalties is not None and counts is not None and prompt_mask is not None, (
            "launch_sample: penalty_slots needs penalties, counts and prompt_mask"
        )
        penalty_slots = penalty_slots.contiguous()
        if penalties.stride(1) != 1:
            penalties = penalties.contiguous()
        pen_args = (penalty_slots, penalties, penalties.stride(0), counts, prompt_mask, counts.stride(0))
    else:
        pen_args = (dummy, dummy, 0, dummy, dummy, 0)
    has_pen = penalty_slots is not None
    if ban_ids is not None and ban_ids.stride(1) != 1:
        ban_ids = ban_ids.contiguous()
    num_ban = 0 if ban_ids is None else ban_ids.shape[1]
    has_prev = ban_ids is not None and ban_prev is not None and num_ban > 0
    if ban_ids is not None and ban_prev is not None and has_prev:
        assert last_tokens is not None and ban_prev.shape == ban_ids.shape, (
            "launch_sample: ban_prev needs last_tokens and the shape of ban_ids"
        )
        last_tokens = last_tokens.contiguous()
        if ban_prev.stride() != ban_ids.stride() or ban_prev.stride(1) != 1:
            ban_ids, ban_prev = ban_ids.contiguous(), ban_prev.contiguous()  # the two share one stride
    ban_args = (
        (ban_ids, ban_prev if has_prev else ban_ids, ban_ids.stride(0), num_ban, last_tokens if has_prev else dummy)
        if ban_ids is not None and num_ban
        else (dummy, dummy, 0, 0, dummy)
    )
    has_row = logit_slots is not None
    row_args: tuple[torch.Tensor, torch.Tensor, int] = (dummy, dummy, 0)
    if logit_slots is not None:
        assert logit_rows is not None and logit_rows.stride(1) == 1, "launch_sample: logit_slots needs logit_rows"
        row_args = (logit_rows, logit_slots.contiguous(), logit_rows.stride(0))
    has_min_p = min_p is not None
    assert not has_min_p or need_filter, "launch_sample: min_p needs need_filter (it needs the row maximum first)"
    if block_v is None:
        block_v = min(2048 if logits.is_cuda else 1024, triton.next_power_of_2(vocab))
    block_v = max(16, triton.next_power_of_2(block_v))  # the draw takes whole Philox groups of 4 entries
    rows_per_program = triton.next_power_of_2(rows_per_program)
    blocks = triton.cdiv(n, rows_per_program)
    shares = 1 if need_filter else vocab_shares(blocks, triton.cdiv(vocab, block_v), logits.device)
    chunk = triton.cdiv(triton.cdiv(vocab, block_v), shares) * block_v
    shares = triton.cdiv(vocab, chunk)  # every share non-empty
    part_val = torch.empty(blocks * rows_per_program * SPLIT_PAD * 2, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(part_val.shape, dtype=torch.int64, device=logits.device)
    grid = (blocks, shares)
    _sample_kernel[grid](
        logits,
        logits.stride(0),
        out,
        temperature,
        top_k,
        top_p,
        seeds,
        positions,
        *pen_args,
        *ban_args,
        *row_args,
        min_p.contiguous() if min_p is not None else dummy,
        n,
        vocab,
        part_val,
        part_idx,
        _share_counts(blocks, logits.device),
        chunk,
        BLOCK_R=rows_per_program,
        BLOCK_V=block_v,
        HAS_PENALTY=has_pen,
        HAS_BAN=num_ban > 0,
        HAS_BAN_PREV=has_prev,
        HAS_ROW=has_row,
        HAS_MIN_P=has_min_p,
        HAS_FILTER=need_filter,
        ALL_GREEDY=all_greedy,
        STEPS=BISECT_STEPS,
        SPLIT_PAD=SPLIT_PAD,
        num_warps=8 if logits.is_cuda else 4,
    )
    return out


def greedy_argmax(logits: torch.Tensor, rows_per_program: int = 1, block_v: int | None = None) -> torch.Tensor:
    """logits [N, V] -> int64 [N], the first index of each row's maximum (torch.argmax's answer for
    rows without NaN). torch.argmax reduces a row in one thread block: 37 us for one 128k-entry row on
    the H100, while this splits the vocabulary over programs as the sampler's draw does (vocab_shares)."""
    return launch_sample(
        logits,
        *(logits,) * 5,  # placeholders: ALL_GREEDY reads no per-row sampling input
        need_filter=False,
        rows_per_program=rows_per_program,
        block_v=block_v,
        all_greedy=True,
    )
