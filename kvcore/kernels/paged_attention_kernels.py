"""The Triton kernels of paged attention: the tiled online-softmax attention over the paged KV cache,
and the reduce of split-KV partials. Their design and how they are launched: paged_attention.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcore.kernels.pdl import wait_for_previous


@triton.jit
def _load_kv_tile(
    t: tl.tensor,
    t_end: tl.tensor,
    kv_lo: tl.tensor,
    kv_hi: tl.tensor,
    k_base: tl.tensor,
    v_base: tl.tensor,
    bt_row: tl.tensor,
    dims: tl.tensor,
    dmask: tl.tensor,
    stride_kb: tl.tensor,
    stride_ks: tl.tensor,
    stride_vb: tl.tensor,
    stride_vs: tl.tensor,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """Tile t's K (as [HEAD_PAD, BLOCK_N]) and V (as [BLOCK_N, HEAD_PAD]) in the cache's dtype; a tile
    at or past t_end loads nothing (the prefetch past a loop's last tile)."""
    cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = (cols >= kv_lo) & (cols < tl.minimum(kv_hi, t_end * BLOCK_N))
    page = tl.load(bt_row + cols // BLOCK_SIZE, mask=col_ok, other=0).to(tl.int64)
    in_page = (cols % BLOCK_SIZE).to(tl.int64)
    k = tl.load(
        k_base + (page * stride_kb + in_page * stride_ks)[None, :] + dims[:, None],
        mask=col_ok[None, :] & dmask[:, None],
        other=0.0,
    )
    v = tl.load(
        v_base + (page * stride_vb + in_page * stride_vs)[:, None] + dims[None, :],
        mask=col_ok[:, None] & dmask[None, :],
        other=0.0,
    )
    return k, v


@triton.jit
def _attend_tiles(
    acc: tl.tensor,
    l_i: tl.tensor,
    m_i: tl.tensor,
    q: tl.tensor,
    t_lo: tl.tensor,
    t_hi: tl.tensor,
    kv_lo: tl.tensor,
    kv_hi: tl.tensor,
    pos: tl.tensor,
    window: tl.tensor,
    k_base: tl.tensor,
    v_base: tl.tensor,
    bt_row: tl.tensor,
    dims: tl.tensor,
    dmask: tl.tensor,
    scale_log2: tl.tensor,
    softcap: tl.tensor,
    stride_kb: tl.tensor,
    stride_ks: tl.tensor,
    stride_vb: tl.tensor,
    stride_vs: tl.tensor,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
    COMPUTE_DT: tl.constexpr,
    PREFETCH: tl.constexpr,
) -> tl.tensor:
    if PREFETCH:
        # Registers carry the next tile's K and V, loaded before this tile's dots: the loads fly
        # while the dots run (launched with num_stages=1, no async copies; see paged_attention.py).
        k_next, v_next = _load_kv_tile(
            t_lo, t_hi, kv_lo, kv_hi, k_base, v_base, bt_row, dims, dmask, stride_kb, stride_ks, stride_vb,
            stride_vs, BLOCK_N, BLOCK_SIZE,
        )  # fmt: skip
    for t in range(t_lo, t_hi):
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = (cols >= kv_lo) & (cols < kv_hi)
        if PREFETCH:
            k = k_next
            v = v_next
            k_next, v_next = _load_kv_tile(
                t + 1, t_hi, kv_lo, kv_hi, k_base, v_base, bt_row, dims, dmask, stride_kb, stride_ks, stride_vb,
                stride_vs, BLOCK_N, BLOCK_SIZE,
            )  # fmt: skip
        else:
            page = tl.load(bt_row + cols // BLOCK_SIZE, mask=col_ok, other=0).to(tl.int64)
            in_page = (cols % BLOCK_SIZE).to(tl.int64)
            k = tl.load(
                k_base + (page * stride_kb + in_page * stride_ks)[None, :] + dims[:, None],
                mask=col_ok[None, :] & dmask[:, None],
                other=0.0,
            )
        if KV_FP8:
            k = k.to(COMPUTE_DT)  # exact: every fp8 value is a bf16 / fp16 / fp32 value
        if UPCAST_DOT:
            k = k.to(tl.float32)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:
            # Gemma-2: cap * tanh(score / cap), with the score scaled by `scale` alone (the host
            # passes it without log2(e)); tanh(x) = 1 - 2 / (e^2x + 1) saturates cleanly at +-1.
            qk = (1.0 - 2.0 / (tl.math.exp2(qk * (2.0 * 1.4426950408889634 / softcap)) + 1.0)) * (
                softcap * 1.4426950408889634
            )
        if MASKED:
            visible = col_ok[None, :] & (cols[None, :] <= pos[:, None])
            if USE_WINDOW:
                visible = visible & (cols[None, :] > pos[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if not PREFETCH:
            v = tl.load(
                v_base + (page * stride_vb + in_page * stride_vs)[:, None] + dims[None, :],
                mask=col_ok[:, None] & dmask[None, :],
                other=0.0,
            )
        if KV_FP8:
            v = v.to(COMPUTE_DT)
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
def paged_attention_kernel(
    q_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    out_ptr: tl.tensor,
    part_o_ptr: tl.tensor,
    part_lse_ptr: tl.tensor,
    qsl_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor,
    bt_ptr: tl.tensor,
    order_ptr: tl.tensor,
    scale_log2: tl.tensor,
    softcap: tl.tensor,
    window: tl.tensor,
    v_scale: tl.tensor,
    num_q_tiles: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    stride_kb: tl.tensor,
    stride_ks: tl.tensor,
    stride_kh: tl.tensor,
    stride_vb: tl.tensor,
    stride_vs: tl.tensor,
    stride_vh: tl.tensor,
    stride_bt: tl.tensor,
    stride_pt: tl.tensor,
    stride_ph: tl.tensor,
    stride_ps: tl.tensor,
    stride_lt: tl.tensor,
    stride_lh: tl.tensor,
    head_size: tl.tensor,
    small_q: tl.tensor,
    num_seqs: tl.tensor,
    search_steps: tl.tensor,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    Q_FILTER: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FLAT: tl.constexpr,
    ORDERED: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_DOT_F16: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
) -> None:
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    wait_for_previous(USE_PDL)  # kvcore/kernels/pdl.py: before the first load
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
        head_split = tl.program_id(2)
    elif ORDERED:
        # One tile a sequence, sequences longest first and a sequence's heads side by side: the
        # hardware dispatches programs in this order, so the last wave holds the shortest work.
        q_tile = 0
        seq = tl.load(order_ptr + tl.program_id(1))
        head_split = tl.program_id(0)
    else:
        q_tile = num_q_tiles - 1 - tl.program_id(0)
        seq = tl.program_id(1)
        head_split = tl.program_id(2)
    kv_head = head_split // NUM_SPLITS
    split = head_split % NUM_SPLITS

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
    q = tl.load(
        q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dmask[None, :],
        other=0.0,
    )
    # The dots' operand dtype: fp16 for bf16 queries over an fp8 cache (see paged_attention.py).
    dot_ty = tl.float16 if FP8_DOT_F16 else q_ptr.dtype.element_ty
    q = q.to(dot_ty)
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
        acc,
        l_i,
        m_i,
        q,
        tl.maximum(s_lo, t_first),
        tl.minimum(s_hi, t_a),
        kv_lo,
        kv_hi,
        pos,
        window,
        k_base,
        v_base,
        bt_row,
        dims,
        dmask,
        scale_log2,
        softcap,
        stride_kb,
        stride_ks,
        stride_vb,
        stride_vs,
        BLOCK_N,
        BLOCK_SIZE,
        True,
        USE_WINDOW,
        DOT_PRECISION,
        UPCAST_DOT,
        SOFTCAP,
        KV_FP8,
        dot_ty,
        PREFETCH,
    )
    acc, l_i, m_i = _attend_tiles(
        acc,
        l_i,
        m_i,
        q,
        tl.maximum(s_lo, t_a),
        tl.minimum(s_hi, t_b),
        kv_lo,
        kv_hi,
        pos,
        window,
        k_base,
        v_base,
        bt_row,
        dims,
        dmask,
        scale_log2,
        softcap,
        stride_kb,
        stride_ks,
        stride_vb,
        stride_vs,
        BLOCK_N,
        BLOCK_SIZE,
        False,
        USE_WINDOW,
        DOT_PRECISION,
        UPCAST_DOT,
        SOFTCAP,
        KV_FP8,
        dot_ty,
        PREFETCH,
    )
    acc, l_i, m_i = _attend_tiles(
        acc,
        l_i,
        m_i,
        q,
        tl.maximum(s_lo, t_b),
        tl.minimum(s_hi, t_last),
        kv_lo,
        kv_hi,
        pos,
        window,
        k_base,
        v_base,
        bt_row,
        dims,
        dmask,
        scale_log2,
        softcap,
        stride_kb,
        stride_ks,
        stride_vb,
        stride_vs,
        BLOCK_N,
        BLOCK_SIZE,
        True,
        USE_WINDOW,
        DOT_PRECISION,
        UPCAST_DOT,
        SOFTCAP,
        KV_FP8,
        dot_ty,
        PREFETCH,
    )

    # Rows that saw nothing (padding rows, or an empty split) keep l == 0: divide by 1 instead.
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if KV_FP8:
        o = o * v_scale  # linear, so split partials may carry it into the reduce
    omask = row_ok[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=omask,
        )
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(
            part_o_ptr + tok64[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps + dims[None, :],
            o,
            mask=omask,
        )
        tl.store(part_lse_ptr + tok64 * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_seqs"])
def split_reduce_kernel(
    part_o_ptr: tl.tensor,
    part_lse_ptr: tl.tensor,
    out_ptr: tl.tensor,
    qsl_ptr: tl.tensor,
    num_seqs: tl.tensor,
    stride_pt: tl.tensor,
    stride_ph: tl.tensor,
    stride_ps: tl.tensor,
    stride_lt: tl.tensor,
    stride_lh: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    head_size: tl.tensor,
    NUM_SPLITS: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    USE_PDL: tl.constexpr = False,
) -> None:
    """Merges one (token, head)'s split partials: one load of all of them and one reduction.
    (Merging inside the attention kernel, by the last split to finish, measured slower on the H100:
    18.3 us a layer against 8.7 + 2.7 at batch 1, the merge alone on the layer's critical path.)"""
    wait_for_previous(USE_PDL)
    tok = tl.program_id(0)
    if tok >= tl.load(qsl_ptr + num_seqs):
        return
    head = tl.program_id(1)
    tok64 = tok.to(tl.int64)
    splits = tl.arange(0, SPLIT_PAD)
    smask = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_PAD)
    dmask = dims < head_size
    lse = tl.load(part_lse_ptr + tok64 * stride_lt + head * stride_lh + splits, mask=smask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.math.exp2(lse - top)
    o = tl.load(
        part_o_ptr + tok64 * stride_pt + head * stride_ph + splits[:, None] * stride_ps + dims[None, :],
        mask=smask[:, None] & dmask[None, :],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    res = tl.sum(o * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + tok64 * stride_ot + head * stride_oh + dims, res.to(out_ptr.dtype.element_ty), mask=dmask)
