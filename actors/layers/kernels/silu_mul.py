"""Triton SiLU-and-mul: out = silu(gate) * up for x = [gate | up], one launch.

Rounding follows the torch layer (HF's act_fn(gate_proj(x)) * up_proj(x)): silu(gate) is rounded
to the activation dtype before the multiply, the product rounded again. silu is computed as torch's
CUDA kernel does, x / (1 + expf(-x)) with an IEEE division; on the GPU expf is libdevice's
accurate one (not Triton's approximate tl.exp), so bf16 results should match torch's bit for bit
(benchmarks/kernels/bench_layer_kernels.py reports the match rate).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from actors.layers.kernels.rounding import round_to
from kvcore.kernels import interpreting
from kvcore.kernels.pdl import pdl_enabled, wait_for_previous

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr: tl.tensor,
    out_ptr: tl.tensor,
    stride_x: tl.tensor,
    stride_out: tl.tensor,
    d: tl.tensor,
    BLOCK: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    USE_PDL: tl.constexpr = False,
) -> None:
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_out + cols, silu_mul_rounded(gate, up, dtype, PRECISE_EXP), mask=mask)


@triton.jit
def silu_mul_rounded(gate: tl.tensor, up: tl.tensor, dtype: tl.constexpr, PRECISE_EXP: tl.constexpr) -> tl.tensor:
    """silu(gate) * up from fp32 values already rounded to `dtype`, rounded as the torch layer rounds
    (also the small-M GEMM's gated epilogue, actors/layers/kernels/small_m_gemm.py)."""
    if PRECISE_EXP:
        e = libdevice.exp(-gate)
    else:  # the interpreter has no libdevice; numpy's exp is accurate anyway
        e = tl.exp(-gate)
    act = round_to(tl.div_rn(gate, 1.0 + e), dtype)
    return round_to(act * up, dtype)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2*d] with unit column stride, any row stride -> contiguous [M, d]."""
    num_rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_rows, d), dtype=x.dtype, device=x.device)
    if num_rows == 0 or d == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(d))
    grid = (num_rows, triton.cdiv(d, block))
    pdl = pdl_enabled(x.device, num_rows)
    _silu_and_mul_kernel[grid](
        x,
        out,
        x.stride(0),
        out.stride(0),
        d,
        BLOCK=block,
        PRECISE_EXP=not interpreting(),
        USE_PDL=pdl,
        num_warps=4,
        enable_fp_fusion=False,
        launch_pdl=pdl,
    )
    return out
