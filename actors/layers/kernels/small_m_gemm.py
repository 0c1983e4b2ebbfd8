"""Triton GEMM for a few rows, bound by its weight read: y = x W^T (+ b), for the decode steps' linear layers.

At M <= 64 a linear layer's time is its weight read. Two weight forms share one kernel:
- **bf16 / fp16 weights** (the default models): cuBLAS's kernels for one row read Llama-3.1-8B's q/k/v and
  o weights at 0.68-0.80 of the copy bandwidth on the H100 (the o projection split over K with a second
  reduce launch), where the big gate/up matrix reaches 0.95. This kernel streams the weight tiles with
  more loads in flight; actors/layers/linear.py sends it the shapes where it measured faster
  (the per-device tables of small_m_tuned.py, from `python -m benchmarks.kernels.bench_small_m_gemm`).
- **the same at a few hundred rows**, where a small model's 4-12 MB matrices are bound by cuBLAS's launch
  and ramp-up rather than by bytes or FLOPs (Qwen3-0.6B at 256 rows: 6.4-7.7 us a projection against a
  1-3 us floor); the table decides there too, and a config may name its own row tile (`block_m`).
- **e4m3 weights** (model.quantization="fp8"), per-channel scales: each weight byte is read once and
  widened to fp16 in registers (Hopper converts a pair in one instruction), multiplied by the unquantized
  activations (saturated to fp16's range, which bf16 activations of these layers stay far inside) with
  fp32 accumulation; the scale multiplies the accumulator. No quantizer launch: torch's row-wise scaled
  GEMM ran at 0.55-0.81x the bf16 GEMM at these sizes on the H200 (benchmarks/RESULTS.md).

Swapped (y^T = W x^T): BLOCK_N weight rows fill the MMA's long side and the batch's rows the short one
(padded to 16). A step's few rows give too few tiles of N to fill the SMs (Llama's o and down: 64 at
BLOCK_N 64), so K is split: each split writes fp32 partials and one small kernel sums them and applies
the scale and the bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from actors.layers.kernels.rounding import round_to
from actors.layers.kernels.silu_mul import silu_mul_rounded
from kvcore.kernels import interpreting
from kvcore.kernels.attention_tiles import num_sms
from kvcore.kernels.pdl import pdl_enabled, wait_for_previous

FP16_MAX = 65504.0
_FP16_MAX = tl.constexpr(FP16_MAX)  # a kernel may read a global only as a constexpr


@dataclass(frozen=True)
class GemmConfig:
    block_n: int = 64  # weight rows a program (the MMA's long side)
    block_k: int = 256
    split_k: int = 1
    num_stages: int = 4
    num_warps: int = 4
    block_m: int = 0  # the batch's rows a program; 0: block_m_for(M), the rows padded to 16..64

    def rows_per_program(self, m: int) -> int:
        return self.block_m or block_m_for(m)


@triton.jit
def _small_m_kernel(
    x_ptr: tl.tensor, w_ptr: tl.tensor, ws_ptr: tl.tensor, b_ptr: tl.tensor, y_ptr: tl.tensor, part_ptr: tl.tensor,
    M: tl.tensor, N: tl.tensor, K: tl.tensor,
    stride_x: tl.tensor, stride_w: tl.tensor, stride_y: tl.tensor, k_per_split: tl.tensor,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, SCALED: tl.constexpr,
    UPCAST_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr = False, PRECISE_EXP: tl.constexpr = True, USE_PDL: tl.constexpr = False,
) -> None:  # fmt: skip
    """SCALED: e4m3 weights widened to fp16, the activations as fp16, per-channel scales (ws_ptr);
    else weights and activations in their own 16-bit dtype. UPCAST_DOT: the operands widened to fp32 first
    (Triton's CPU interpreter computes a bf16 tl.dot wrongly: numpy has no bf16).
    GATED: w is [gate | up] (2N rows); a program reads gate rows n and up rows N + n and stores
    silu(gate) * up (16-bit, unscaled, no bias, no split).
    USE_PDL: launched with programmatic dependent launch (kvcore/kernels/pdl.py)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k0 = pid_k * k_per_split
    k_end = tl.minimum(k0 + k_per_split, K)
    wait_for_previous(USE_PDL)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_x + (k0 + offs_k)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    up_ptrs = w_ptrs + N.to(tl.int64) * stride_w
    for k in range(k0, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            if GATED:
                w_up = tl.load(up_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k + offs_k) < k_end
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            if GATED:
                w_up = tl.load(up_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if GATED:
            if UPCAST_DOT:
                acc_up = tl.dot(w_up.to(tl.float32), x.to(tl.float32), acc_up)
            else:
                acc_up = tl.dot(w_up, x, acc_up)
            up_ptrs += BLOCK_K
        if SCALED:
            xh = tl.clamp(x.to(tl.float32), -_FP16_MAX, _FP16_MAX).to(tl.float16)
            acc = tl.dot(w.to(tl.float16), xh, acc)
        elif UPCAST_DOT:
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc)
        else:
            acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out_mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT:  # fp32 partials [split, M, N]; _split_reduce finishes them
        p = part_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
        tl.store(p, acc, mask=out_mask)
    else:
        if SCALED:
            acc = acc * tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        y = y_ptr + offs_m[None, :].to(tl.int64) * stride_y + offs_n[:, None]
        if GATED:  # gate and up rounded to the activation dtype first, as the GEMM's 16-bit output is
            dtype = y_ptr.dtype.element_ty
            acc = silu_mul_rounded(round_to(acc, dtype), round_to(acc_up, dtype), dtype, PRECISE_EXP)
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_reduce(
    part_ptr: tl.tensor, ws_ptr: tl.tensor, b_ptr: tl.tensor, y_ptr: tl.tensor,
    M: tl.tensor, N: tl.tensor, stride_y: tl.tensor,
    SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
) -> None:  # fmt: skip
    wait_for_previous(USE_PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + (s * M + row).to(tl.int64) * N + offs, mask=ok, other=0.0)
    if SCALED:
        acc = acc * tl.load(ws_ptr + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row.to(tl.int64) * stride_y + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@lru_cache(maxsize=1024)  # a launch's host path: the same few (M, N, K) every step
def default_config(m: int, n: int, k: int, sms: int) -> GemmConfig:
    """64 x 256 tiles, K split until the grid covers every SM at least once (at most 8 splits, each a
    whole number of K tiles)."""
    base = GemmConfig()
    tiles = triton.cdiv(n, base.block_n) * triton.cdiv(m, block_m_for(m))
    k_tiles = triton.cdiv(k, base.block_k)
    split = 1
    while split < 8 and tiles * split < sms and k_tiles % (2 * split) == 0:
        split *= 2
    return GemmConfig(split_k=split)


def block_m_for(m: int) -> int:
    return max(16, min(64, triton.next_power_of_2(m)))


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    bias: torch.Tensor | None,
    w_scale: torch.Tensor | None,
    cfg: GemmConfig,
    gated: bool = False,
) -> None:
    """One GEMM into y [M, N] (N = w's rows, or half of them gated), K split as cfg says, the split reduce
    launched where it is."""
    m, k = x.shape
    if m == 0:
        return
    n = y.shape[1]
    k_per_split = k if gated else triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else y
    ws = w_scale if w_scale is not None else y  # never read unless scaled
    b = bias if bias is not None else ws
    block_m = cfg.rows_per_program(m)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m), splits)
    pdl = pdl_enabled(x.device, m)
    scaled = w_scale is not None
    _small_m_kernel[grid](
        x, w, ws, b, y, part,
        m, n, k, x.stride(0), w.stride(0), y.stride(0), k_per_split,
        HAS_BIAS=bias is not None, SPLIT=splits > 1, EVEN_K=k % cfg.block_k == 0, SCALED=scaled,
        UPCAST_DOT=not scaled and x.dtype == torch.bfloat16 and interpreting(),
        BLOCK_N=cfg.block_n, BLOCK_M=block_m, BLOCK_K=cfg.block_k, GATED=gated, PRECISE_EXP=not interpreting(),
        USE_PDL=pdl,
        num_stages=cfg.num_stages, num_warps=cfg.num_warps, launch_pdl=pdl,
    )  # fmt: skip
    if splits > 1:
        block = 1024
        _split_reduce[(m, triton.cdiv(n, block))](
            part, ws, b, y, m, n, y.stride(0),
            SPLITS=splits, HAS_BIAS=bias is not None, SCALED=scaled, BLOCK=block, USE_PDL=pdl,
            num_warps=4, launch_pdl=pdl,
        )  # fmt: skip


def small_m_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    w_scale: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (unit column stride), w [N, K] contiguous -> [M, N] in out_dtype. w is e4m3 with w_scale
    [1, N] fp32 (one per output channel), or in x's 16-bit dtype with w_scale None."""
    m, k = x.shape
    if w_scale is None and w.dtype != x.dtype:
        raise TypeError(f"small_m_linear: weight {w.dtype} and activations {x.dtype} differ (unscaled weights)")
    y = torch.empty((m, w.shape[0]), dtype=out_dtype, device=x.device)
    _launch(x, w, y, bias, w_scale, config or default_config(m, w.shape[0], k, num_sms(x.device)))
    return y


# The gated form's tiles: a program reads two weight tiles a K step (gate and up), so half the ungated
# K tile keeps its shared-memory stages. The fastest of `bench_small_m_gemm --gated`'s sweep on the H100
# for both shapes' gate_up at M = 16 (Llama-3.1-8B 80.9 us against 85.6 for cuBLAS + the activation's
# launch) and for Qwen3-0.6B's at every M.
GATED_CONFIG = GemmConfig(block_n=64, block_k=128, split_k=1, num_stages=4, num_warps=4)


def small_m_silu_mul(x: torch.Tensor, w: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) in one launch: w [2N, K] is [gate | up] in x's 16-bit dtype
    (MergedColumnParallelLinear's gate_up), x [M, K] -> [M, N]. Rounded as the GEMM, then SiluAndMul,
    would round it; no bias, no split over K."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"small_m_silu_mul: activations {x.dtype} must be bfloat16 or float16")
    if w.dtype != x.dtype or w.shape[0] % 2:
        raise ValueError(f"small_m_silu_mul: weight {tuple(w.shape)} {w.dtype} must be [2N, K] in {x.dtype}")
    y = torch.empty((x.shape[0], w.shape[0] // 2), dtype=x.dtype, device=x.device)
    _launch(x, w, y, None, None, config or GATED_CONFIG, gated=True)
    return y


def w8a16_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (unit column stride), wq [N, K] e4m3 contiguous, w_scale [1, N] fp32 -> [M, N] in out_dtype."""
    return small_m_linear(x, wq, bias, out_dtype, w_scale, config)


def w8a16_linear_ref(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """The torch reference: the activations as fp16 (saturated), the weights widened, fp32 products."""
    xh = x.float().clamp(-FP16_MAX, FP16_MAX).to(torch.float16).float()
    y = (xh @ wq.float().t()) * w_scale.reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def small_m_linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The torch reference of the unscaled form: fp32 products of the 16-bit operands, rounded once."""
    y = x.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
