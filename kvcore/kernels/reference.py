"""Plain-torch paged-attention references.

They are the CPU backend of the engine and the oracle the Triton kernels are tested against, so they
favour clarity but stay vectorised: one batched computation for all decode sequences (q_len == 1)
and one per prefill chunk, never a Python loop over tokens. Math runs in float32 and the result is
written in `out.dtype`.

Layout (see DESIGN.md): key/value caches are [num_blocks, block_size, num_kv_heads, head_size];
sequence b's query tokens are its LAST q_len positions: pos = seq_len - q_len + i. An fp8 cache holds
x / scale (kvcore/kernels/fp8.py); what is read from it is multiplied back by the layer's scale.
"""

from __future__ import annotations

import torch

from kvcore.kernels.fp8 import is_fp8, quantize_ref

# Bound on the fp32 score tensor of one prefill chunk (elements), so a long chunk on the CPU does not
# materialise Hq x q_len x kv_len scores at once.
_MAX_SCORE_ELEMS = 1 << 25


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value [T, Hkv, D] at slot_mapping[:T] of the paged caches; slot -1 writes nothing."""
    num_tokens = key.shape[0]
    slots = slot_mapping[:num_tokens].to(torch.int64)
    keep = slots >= 0
    slots = slots[keep]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = _store(key[keep], k_scale, key_cache.dtype)
    value_cache[blocks, offsets] = _store(value[keep], v_scale, value_cache.dtype)


def _store(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return quantize_ref(x, scale, dtype) if is_fp8(dtype) else x.to(dtype)


def _load(pages: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache entries as float32 values (an fp8 cache's stored value times its scale)."""
    return pages.float() * scale if is_fp8(pages.dtype) else pages.float()


def _kv_start(first_pos: int, sliding_window: int | None, block_size: int) -> int:
    """First key position worth gathering, aligned down to a block: with a window, blocks wholly
    before it may be the null block (garbage) and must not be read at all."""
    if sliding_window is None:
        return 0
    return max(0, first_pos - sliding_window + 1) // block_size * block_size


def _gather(cache: torch.Tensor, block_row: torch.Tensor, start: int, end: int, scale: float) -> torch.Tensor:
    """Positions [start, end) of one sequence as a contiguous [end - start, Hkv, D] float32 tensor;
    `start` is block-aligned."""
    block_size = cache.shape[1]
    first, last = start // block_size, (end + block_size - 1) // block_size
    pages = cache[block_row[first:last].to(torch.int64)]  # [n_pages, bs, Hkv, D]
    return _load(pages.flatten(0, 1)[: end - start], scale)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Boolean [..., Lq, Lk]: causal, and HF's window semantics i - W < j <= i."""
    allowed = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
    if sliding_window is not None:
        allowed &= k_pos.unsqueeze(-2) > q_pos.unsqueeze(-1) - sliding_window
    return allowed


def _masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """q [N, Hkv, G*Lq, D], k/v [N, Hkv, Lk, D], allowed [N, 1, G*Lq, Lk] -> [N, Hkv, G*Lq, D].
    `softcap`: Gemma-2's cap * tanh(score / cap), in HF's order (scale first, mask after)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _prefill_one(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_row: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Attention for one sequence's chunk: query [Lq, Hq, D] -> [Lq, Hq, D] float32."""
    q_len, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = key_cache.shape[1]
    first_pos = seq_len - q_len
    out = torch.empty(q_len, num_heads, head_size, dtype=torch.float32, device=query.device)
    # Chunk the queries so the fp32 score tensor stays bounded; each chunk only needs keys up to its
    # own last position (causal) and from its own window start.
    rows = max(1, _MAX_SCORE_ELEMS // max(1, num_heads * seq_len))
    for s in range(0, q_len, rows):
        e = min(q_len, s + rows)
        start = _kv_start(first_pos + s, sliding_window, block_size)
        end = first_pos + e
        k = _gather(key_cache, block_row, start, end, kv_scales[0]).permute(1, 0, 2)  # [Hkv, Lk, D]
        v = _gather(value_cache, block_row, start, end, kv_scales[1]).permute(1, 0, 2)
        q = query[s:e].float().view(e - s, num_kv_heads, group, head_size)
        q = q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * (e - s), head_size)
        q_pos = torch.arange(first_pos + s, first_pos + e, device=query.device).repeat(group)
        k_pos = torch.arange(start, end, device=query.device)
        allowed = _visible(q_pos, k_pos, sliding_window)
        o = _masked_attention(q[None], k[None], v[None], allowed[None, None], scale, softcap)[0]
        out[s:e] = (
            o.view(num_kv_heads, group, e - s, head_size).permute(2, 0, 1, 3).reshape(e - s, num_heads, head_size)
        )
    return out


def _decode_batch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_rows: torch.Tensor,
    seq_lens: list[int],
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """One token per sequence, all sequences at once, padded to the longest gathered range:
    query [N, Hq, D] -> [N, Hq, D] float32."""
    n, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    device = query.device
    starts = [_kv_start(L - 1, sliding_window, block_size) for L in seq_lens]
    first_page = torch.tensor([s // block_size for s in starts], device=device)
    n_pages = max((L - s + block_size - 1) // block_size for L, s in zip(seq_lens, starts, strict=True))
    page_idx = first_page[:, None] + torch.arange(n_pages, device=device)[None, :]
    page_idx = page_idx.clamp(max=block_rows.shape[1] - 1)
    # Pages past a sequence's end are masked below, but must still name a real block: use block 0
    # and zero its contribution by the mask (its values are replaced before the matmul).
    seq_t = torch.tensor(seq_lens, device=device)
    start_t = torch.tensor(starts, device=device)
    k_pos = start_t[:, None] + torch.arange(n_pages * block_size, device=device)[None, :]
    in_range = k_pos < seq_t[:, None]
    pages = torch.gather(block_rows.to(torch.int64), 1, page_idx)
    pages = torch.where(in_range[:, ::block_size], pages, torch.zeros_like(pages))
    k = _load(key_cache[pages].flatten(1, 2), kv_scales[0])  # [N, Lk, Hkv, D]
    v = _load(value_cache[pages].flatten(1, 2), kv_scales[1])
    # Padding positions may hold anything (even NaN): zero them so 0-weight * garbage stays 0.
    k = k.masked_fill(~in_range[:, :, None, None], 0.0).permute(0, 2, 1, 3)  # [N, Hkv, Lk, D]
    v = v.masked_fill(~in_range[:, :, None, None], 0.0).permute(0, 2, 1, 3)
    q = query.float().view(n, num_kv_heads, group, head_size)
    allowed = _visible((seq_t - 1)[:, None], k_pos, sliding_window) & in_range[:, None, :]
    o = _masked_attention(q, k, v, allowed[:, None], scale, softcap)  # [N, Hkv, G, D]
    return o.reshape(n, num_heads, head_size)


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Causal (optionally sliding-window) GQA attention of a mixed batch over the paged cache.
    Writes out[:query_start_loc[B]]; rows beyond are left untouched. `kv_scales`: an fp8 cache's
    (k_scale, v_scale)."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode_ids = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    if decode_ids:
        tok = torch.tensor([starts[b] for b in decode_ids], device=query.device)
        rows = torch.tensor(decode_ids, device=query.device)
        o = _decode_batch(
            query[tok],
            key_cache,
            value_cache,
            block_table[rows],
            [lens[b] for b in decode_ids],
            scale,
            sliding_window,
            softcap,
            kv_scales,
        )
        out[tok] = o.to(out.dtype)
    for b in range(len(lens)):
        s, e = starts[b], starts[b + 1]
        if e - s <= 1:
            continue
        o = _prefill_one(
            query[s:e], key_cache, value_cache, block_table[b], lens[b], scale, sliding_window, softcap, kv_scales
        )
        out[s:e] = o.to(out.dtype)
