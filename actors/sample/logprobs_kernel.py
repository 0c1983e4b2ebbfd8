"""A step's logprobs in two Triton launches: the top-k, the token's own logprob and its rank.

On the H200 the torch path (log_softmax, then a >= count and topk over the full [rows, vocab] float32
tensor) took 1.02 ms a step at 256 rows of a 151,936 vocabulary, topk alone 0.60: a sixth of a
decode step. Here the logits are read once:
- `_chunk_kernel`, one program per (row, chunk of BLOCK logits): the chunk's max and sum of exp (an
  online log-sum-exp, as flash attention combines its tiles), how many logits are >= the token's, and
  the chunk's own top-k by k rounds of one (value, index) max each, the first round's being the chunk's
  max itself (k + 2 reductions a chunk; 2k + 3 before, an argmax and a max a round);
- `_combine_kernel`, one program per row: the row's log-sum-exp from the chunks', the rank, and the
  top-k of the chunks' candidates (at most chunks * k of them, not the vocabulary), one (value, id)
  reduction a round.
With k = 0 the chunk kernel does only the three reductions every row needs (the token's logprob and
rank). Rows of one call share k: a row that asked fewer (or none) still gets the step's largest k.
The rank counts raw logits >= the token's logit, which orders exactly as the reference's logprobs
(both subtract one row constant), without the float rounding of that subtraction. Ties in the top-k
take the lowest token id; torch.topk leaves their order unspecified.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore.request import MAX_LOGPROBS

BLOCK = 4096


@triton.jit(do_not_specialize=["K"])
def _chunk_kernel(
    logits_ptr: tl.tensor,
    stride_row: tl.tensor,
    tok_ptr: tl.tensor,
    V: tl.tensor,
    K: tl.tensor,
    max_ptr: tl.tensor,
    sum_ptr: tl.tensor,
    cnt_ptr: tl.tensor,
    cand_val_ptr: tl.tensor,
    cand_idx_ptr: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    base = row * tl.num_programs(1) + chunk
    lane = tl.arange(0, BLOCK)
    offs = chunk * BLOCK + lane
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    t = tl.load(row_ptr + tl.load(tok_ptr + row)).to(tl.float32)
    # One reduction gives the chunk's max and its lowest index: the max is also the first round's pick.
    top, j = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(max_ptr + base, top)
    tl.store(sum_ptr + base, tl.sum(tl.exp(x - top), axis=0))
    tl.store(cnt_ptr + base, tl.sum((x >= t).to(tl.int32), axis=0))
    if K > 0:
        tl.store(cand_val_ptr + base * K, top)
        tl.store(cand_idx_ptr + base * K, chunk * BLOCK + j)
    for i in range(1, K):
        x = tl.where(lane == j, float("-inf"), x)
        top, j = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(cand_val_ptr + base * K + i, top)
        tl.store(cand_idx_ptr + base * K + i, chunk * BLOCK + j)


@triton.jit
def _max_lowest_id(v1: tl.tensor, i1: tl.tensor, v2: tl.tensor, i2: tl.tensor) -> tl.tensor:
    """(value, token id) pairs: the larger value, the lower id among equal values."""
    left = (v1 > v2) | ((v1 == v2) & (i1 < i2))
    return tl.where(left, v1, v2), tl.where(left, i1, i2)


@triton.jit(do_not_specialize=["K"])
def _combine_kernel(
    logits_ptr: tl.tensor,
    stride_row: tl.tensor,
    tok_ptr: tl.tensor,
    C: tl.tensor,
    K: tl.tensor,
    max_ptr: tl.tensor,
    sum_ptr: tl.tensor,
    cnt_ptr: tl.tensor,
    cand_val_ptr: tl.tensor,
    cand_idx_ptr: tl.tensor,
    ids_ptr: tl.tensor,
    lps_ptr: tl.tensor,
    ranks_ptr: tl.tensor,
    C_PAD: tl.constexpr,
    CK_PAD: tl.constexpr,
) -> None:
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
        # Lowest token id among equal values, in one reduction over (value, id) pairs: the candidates'
        # lanes are not in id order across chunks' rounds.
        best, pick = tl.reduce((v, idx), 0, _max_lowest_id)
        tl.store(ids_ptr + out + 1 + i, pick)
        tl.store(lps_ptr + out + 1 + i, best - lse)
        v = tl.where((v == best) & (idx == pick), float("-inf"), v)


def topk_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_topk: int, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, V] (raw, any float dtype), token_ids [N] -> (ids int32 [N, 1 + k], logprobs float32
    [N, 1 + k], ranks int32 [N]): the fields of actors/logprobs.LogprobsTensors, which wraps them."""
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
        # Wide enough for any k a request may ask: a width per k class would compile mid-run the first
        # time a request asks a larger k than the warm-up's; the extra lanes are masked loads of one row.
        CK_PAD=triton.next_power_of_2(chunks * max(k, MAX_LOGPROBS)),
        num_warps=4,
    )
    return ids, lps, ranks
