"""Fused mixture-of-experts: tokens sorted by expert, one grouped GEMM per projection (Triton).

Routing gives each token top_k (expert, weight) pairs. `align_by_expert` sorts the T*top_k pairs by
expert and pads every expert's run to a multiple of BLOCK_M, so each BLOCK_M-row tile of the sorted
list belongs to one expert; it runs on the device with fixed-size outputs (no host sync, so a decode
step stays capturable in a CUDA graph). Tiles past the real end carry expert -1 and exit at once.

One kernel serves both projections: a program owns (tile of sorted pairs, N tile), gathers its rows
of A (the token's hidden state for gate/up, the pair's own activation for down), multiplies by its
expert's weight [N, K] and writes rows indexed by pair id. The down projection also scales by the
routing weight. The top_k partial outputs of a token are summed afterwards.

Rounding follows HF's expert loop: each GEMM's output is rounded to the activation dtype, then the
routing weight multiplies it (in the weight's dtype: float32 for Mixtral, the model dtype for
Qwen3-MoE) and the product is rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actors.layers.kernels.rounding import round_to
from kvcore.kernels import interpreting


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, top_k] -> (sorted_ids [max_blocks * block_m] int32: pair ids (t * top_k + j)
    grouped by expert, padding = T * top_k; expert_ids [max_blocks] int32: each tile's expert or -1)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync to size its output
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    dest = (pad_end - padded)[sorted_experts] + rank
    max_blocks = triton.cdiv(num_pairs, block_m) + num_experts
    sorted_ids = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    starts = torch.arange(max_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(pad_end, starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids


@triton.jit
def _moe_gemm_kernel(
    a_ptr: tl.tensor,
    w_ptr: tl.tensor,
    out_ptr: tl.tensor,
    topk_w_ptr: tl.tensor,
    sorted_ids_ptr: tl.tensor,
    expert_ids_ptr: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    num_pairs: tl.tensor,
    a_row_div: tl.tensor,
    stride_am: tl.tensor,
    stride_we: tl.tensor,
    stride_wn: tl.tensor,
    stride_wk: tl.tensor,
    stride_om: tl.tensor,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
) -> None:
    pid_m = tl.program_id(0)
    expert = tl.load(expert_ids_ptr + pid_m)
    if expert < 0:
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_pairs
    rows = (ids // a_row_div).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(
            w_base + n[None, :] * stride_wn + k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0
        )
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    res = round_to(acc, dtype)
    if MUL_WEIGHT:
        w = tl.load(topk_w_ptr + ids, mask=valid, other=0.0)
        res = round_to(res * w[:, None].to(tl.float32), dtype)
    tl.store(out_ptr + ids.to(tl.int64)[:, None] * stride_om + n[None, :], res, mask=valid[:, None] & n_ok[None, :])


def moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_pairs: int,
    a_row_div: int,
    topk_weights: torch.Tensor | None,
    block_m: int,
    block_n: int = 64,
    block_k: int = 64,
) -> None:
    """out[pair] = A[pair // a_row_div] @ w[expert(pair)]^T (x routing weight when given).
    a [rows, K], w [E, N, K], out [num_pairs, N]; all with unit stride on the last dim."""
    n, k = w.shape[1], w.shape[2]
    upcast = interpreting() and a.dtype != torch.float32
    grid = (expert_ids.shape[0], triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a,
        w,
        out,
        topk_weights if topk_weights is not None else out,
        sorted_ids,
        expert_ids,
        n,
        k,
        num_pairs,
        a_row_div,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        MUL_WEIGHT=topk_weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 or upcast else "tf32",
        UPCAST_DOT=upcast,
        num_warps=4,
        num_stages=3,
    )


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Pairs per expert decide the tile height: decode batches spread a handful of rows over many
    experts (16-row tiles waste least), prefill fills 64-row tiles."""
    per_expert = num_pairs / max(1, num_experts)
    return 16 if per_expert <= 16 else (32 if per_expert <= 48 else 64)


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk [T, top_k] -> [T, H]."""
    from actors.layers.kernels import layer_ops

    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    num_experts = w13.shape[0]
    bm = block_m or choose_block_m(num_pairs, num_experts)
    sorted_ids, expert_ids = align_by_expert(topk_ids, num_experts, bm)
    gate_up = torch.empty((num_pairs, w13.shape[1]), dtype=x.dtype, device=x.device)
    moe_gemm(x, w13, gate_up, sorted_ids, expert_ids, num_pairs, top_k, None, bm, block_n, block_k)
    act = layer_ops.silu_and_mul(gate_up, backend="triton")
    out = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    moe_gemm(act, w2, out, sorted_ids, expert_ids, num_pairs, 1, topk_weights.reshape(-1), bm, block_n, block_k)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
