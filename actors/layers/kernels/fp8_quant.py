"""Triton per-token fp8 quantization of a linear layer's input (the activation side of fp8 weights).

One program per row: the row's largest magnitude sets its scale (amax / 448, floored at MIN_SCALE),
then the row is stored as round(x / scale) in e4m3, rounded onto the grid by kvcore/kernels/fp8_round.py.
The reciprocal is a correctly rounded fp32 division (div_rn), so the GPU, the interpreter and the torch
reference (actors/layers/fp8_linear.py) store the same bytes. A row of up to 4,096 values is read once and
held in registers; a longer one (Llama's down_proj input, 14,336) is read twice, the second time from L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actors.layers.kernels.fp8_scale import MIN_SCALE
from kvcore.kernels.fp8 import FORMATS
from kvcore.kernels.fp8_round import round_to_fp8_grid

E4M3 = FORMATS[torch.float8_e4m3fn]


@triton.jit
def _per_token_quant_kernel(
    x_ptr: tl.tensor,
    q_ptr: tl.tensor,
    scale_ptr: tl.tensor,
    stride_x: tl.tensor,
    stride_q: tl.tensor,
    n_cols: tl.tensor,
    min_scale: tl.tensor,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
    FMAX: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    if ONE_PASS:  # the row fits one block: read it once, keep it in registers
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), FMAX), min_scale)
        tl.store(scale_ptr + row, scale)
        q = round_to_fp8_grid(x * tl.math.div_rn(1.0, scale), MANT, EMIN, FMAX)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, 0), FMAX), min_scale)
        inv = tl.math.div_rn(1.0, scale)
        tl.store(scale_ptr + row, scale)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            q = round_to_fp8_grid(x * inv, MANT, EMIN, FMAX)
            tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def per_token_quant_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (e4m3 [M, K] contiguous, fp32 scales [M, 1])."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block = min(triton.next_power_of_2(k), 4096)
    _per_token_quant_kernel[(m,)](
        x,
        q,
        scale,
        x.stride(0),
        q.stride(0),
        k,
        MIN_SCALE,
        BLOCK=block,
        ONE_PASS=k <= block,
        MANT=E4M3.mantissa_bits,
        EMIN=E4M3.min_exponent,
        FMAX=E4M3.max_value,
        num_warps=4 if block <= 1024 else 8,
    )
    return q, scale
