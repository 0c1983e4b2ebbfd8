"""Triton RMSNorm with the pre-norm residual add fused in front: one launch per call.

One program per row (a grid over rows, so any token count reuses one compiled kernel and a CUDA
graph captures it like any launch). Rounding follows HF/the torch layer exactly: x + residual is
rounded to the activation dtype, the statistics are fp32, the normalised value is rounded to the
activation dtype and only then multiplied by the weight, that product rounded to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actors.layers.kernels.rounding import round_to
from kvcore.kernels.pdl import pdl_enabled, wait_for_previous


@triton.jit
def _rms_norm_kernel(
    x_ptr: tl.tensor,
    res_ptr: tl.tensor,
    w_ptr: tl.tensor,
    out_ptr: tl.tensor,
    res_out_ptr: tl.tensor,
    stride_x: tl.tensor,
    stride_res: tl.tensor,
    stride_out: tl.tensor,
    stride_res_out: tl.tensor,
    n_cols: tl.tensor,
    inv_n: tl.tensor,
    eps: tl.tensor,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GEMMA: tl.constexpr,
    USE_PDL: tl.constexpr = False,
) -> None:
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        x = round_to(x + r, x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    # torch's GPU mean multiplies the sum by 1/N; exact for power-of-two hidden sizes either way.
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) * inv_n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        # Gemma: scale (1 + w) applied in fp32, one rounding at the end.
        out = round_to(x * rstd * (1.0 + w), out_ptr.dtype.element_ty)
    else:
        out = round_to(round_to(x * rstd, x_ptr.dtype.element_ty) * w, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def _num_warps(block_n: int) -> int:
    # About 8 elements per thread: full 16-byte loads without spilling at 8K columns.
    return max(1, min(16, block_n // 256))


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, gemma: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x (and residual) [M, N] with unit column stride, any row stride; weight [N].
    Returns norm(x) or, with residual, (norm(x + residual), x + residual), both contiguous."""
    num_rows, n_cols = x.shape
    out_dtype = x.dtype if gemma else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((num_rows, n_cols), dtype=out_dtype, device=x.device)
    res_out = torch.empty_like(out, dtype=x.dtype) if residual is not None else out
    if num_rows == 0:
        return out if residual is None else (out, res_out)
    res_in = residual if residual is not None else x
    block_n = triton.next_power_of_2(n_cols)
    pdl = pdl_enabled(x.device, num_rows)
    _rms_norm_kernel[(num_rows,)](
        x,
        res_in,
        weight,
        out,
        res_out,
        x.stride(0),
        res_in.stride(0),
        out.stride(0),
        res_out.stride(0),
        n_cols,
        1.0 / n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=block_n,
        GEMMA=gemma,
        USE_PDL=pdl,
        num_warps=_num_warps(block_n),
        enable_fp_fusion=False,
        launch_pdl=pdl,
    )
    return out if residual is None else (out, res_out)
