"""The logprobs kernel as it was before one reduction per top-k round (actors/sample/logprobs_kernel.py at
6668a47: an argmax and a max per round in the chunk kernel, a max and a min in the combine), kept for
bench_sampler.py's before/after run in one process. Not used by the engine."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit(do_not_specialize=["K"])
def _chunk_kernel(
    logits_ptr, stride_row, tok_ptr, V, K, max_ptr, sum_ptr, cnt_ptr, cand_val_ptr, cand_idx_ptr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    base = row * tl.num_programs(1) + chunk
    lane = tl.arange(0, BLOCK)
    offs = chunk * BLOCK + lane
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    t = tl.load(row_ptr + tl.load(tok_ptr + row)).to(tl.float32)
    m = tl.max(x, axis=0)
    tl.store(max_ptr + base, m)
    tl.store(sum_ptr + base, tl.sum(tl.exp(x - m), axis=0))
    tl.store(cnt_ptr + base, tl.sum((x >= t).to(tl.int32), axis=0))
    for i in range(K):
        j = tl.argmax(x, axis=0, tie_break_left=True)
        tl.store(cand_val_ptr + base * K + i, tl.max(x, axis=0))
        tl.store(cand_idx_ptr + base * K + i, chunk * BLOCK + j)
        x = tl.where(lane == j, float("-inf"), x)


@triton.jit(do_not_specialize=["K"])
def _combine_kernel(
    logits_ptr,
    stride_row,
    tok_ptr,
    C,
    K,
    max_ptr,
    sum_ptr,
    cnt_ptr,
    cand_val_ptr,
    cand_idx_ptr,
    ids_ptr,
    lps_ptr,
    ranks_ptr,
    C_PAD: tl.constexpr,
    CK_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.arange(0, C_PAD)
    m = tl.load(max_ptr + row * C + c, mask=c < C, other=float("-inf"))
    s = tl.load(sum_ptr + row * C + c, mask=c < C, other=0.0)
    big = tl.max(m, axis=0)
    lse = big + tl.log(tl.sum(s * tl.exp(m - big), axis=0))
    tl.store(ranks_ptr + row, tl.sum(tl.load(cnt_ptr + row * C + c, mask=c < C, other=0), axis=0))
    tok = tl.load(tok_ptr + row)
    t = tl.load(logits_ptr + row.to(tl.int64) * stride_row + tok).to(tl.float32)
    out = row * (K + 1)
    tl.store(ids_ptr + out, tok.to(tl.int32))
    tl.store(lps_ptr + out, t - lse)
    lane = tl.arange(0, CK_PAD)
    n = C * K
    v = tl.load(cand_val_ptr + row * n + lane, mask=lane < n, other=float("-inf"))
    idx = tl.load(cand_idx_ptr + row * n + lane, mask=lane < n, other=0)
    for i in range(K):
        # Lowest token id among equal values: candidates are not in id order across chunks' rounds.
        best = tl.max(v, axis=0)
        pick = tl.min(tl.where(v == best, idx, 2147483647), axis=0)
        tl.store(ids_ptr + out + 1 + i, pick)
        tl.store(lps_ptr + out + 1 + i, best - lse)
        v = tl.where((v == best) & (idx == pick), float("-inf"), v)


def topk_logprobs_before(logits: torch.Tensor, token_ids: torch.Tensor, num_topk: int, block: int = BLOCK) -> tuple:
    """As actors/logprobs_kernel.topk_logprobs: (ids, logprobs, ranks)."""
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    chunks = triton.cdiv(vocab, block)
    k = max(num_topk, 0)
    maxes = torch.empty(n, chunks, dtype=torch.float32, device=dev)
    sums = torch.empty_like(maxes)
    counts = torch.empty(n, chunks, dtype=torch.int32, device=dev)
    cand_val = torch.empty(n, chunks, max(k, 1), dtype=torch.float32, device=dev)
    cand_idx = torch.empty(n, chunks, max(k, 1), dtype=torch.int32, device=dev)
    ids = torch.empty(n, 1 + k, dtype=torch.int32, device=dev)
    lps = torch.empty(n, 1 + k, dtype=torch.float32, device=dev)
    ranks = torch.empty(n, dtype=torch.int32, device=dev)
    if n == 0:
        return ids, lps, ranks
    tokens = token_ids.to(torch.int64)
    _chunk_kernel[(n, chunks)](
        logits,
        logits.stride(0),
        tokens,
        vocab,
        k,
        maxes,
        sums,
        counts,
        cand_val,
        cand_idx,
        BLOCK=block,
        num_warps=8 if block >= 4096 else 4,
    )
    _combine_kernel[(n,)](
        logits,
        logits.stride(0),
        tokens,
        chunks,
        k,
        maxes,
        sums,
        counts,
        cand_val,
        cand_idx,
        ids,
        lps,
        ranks,
        C_PAD=triton.next_power_of_2(chunks),
        CK_PAD=triton.next_power_of_2(chunks * max(k, 1)),
        num_warps=4,
    )
    return ids, lps, ranks
