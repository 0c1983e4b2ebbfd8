"""fp8 weights for the dense linear layers (vLLM's `quantization="fp8"` on a bf16 checkpoint).

At load time each weight is quantized per output channel to e4m3 (scale = the row's amax / 448). At run
time, two paths by the number of rows M:
- M > SMALL_M_MAX (prefill chunks, big decode steps, bound by their FLOPs): each input row is quantized per
  token the same way, and one scaled GEMM (torch._scaled_mm: cuBLASLt / CUTLASS on Hopper, a reference on
  the CPU) multiplies them and applies both scales: y = (xq * sx) (wq * sw)^T, on Hopper's fp8 tensor cores;
- M <= SMALL_M_MAX (decode steps, bound by the weight read): the activations stay as they are and a Triton
  kernel widens the weights to fp16 in registers (actors.layers.kernels.small_m_gemm.py): no quantizer launch,
  where torch's scaled GEMM ran at 0.55-0.81x bf16. It is off (SMALL_M_MAX = 0) until an H200 has timed it:
  `KVRAY_FP8_SMALL_M=64` turns it on (`python -m benchmarks.kernels.bench_fp8_linear` times the kernel
  beside bf16 and the scaled GEMM).
Half the weight bytes a step, at fp8's rounding: outputs follow vLLM's logprobs rule, not HF's greedy
tokens, so it is never a default.

The embedding, the LM head and mixture-of-experts weights stay in the model's dtype (as in vLLM's online
fp8 for the first two). On the GPU the row-wise scaled GEMM writes bf16 only, so the model must be bf16.
"""

from __future__ import annotations

import os

import torch

from actors.layers.kernels.fp8_scale import E4M3, FMAX, MIN_SCALE
from actors.layers.kernels.small_m_gemm import w8a16_linear, w8a16_linear_ref

SMALL_M_MAX = int(os.environ.get("KVRAY_FP8_SMALL_M", "0"))


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x as e4m3 with its own fp32 scale [rows, 1]: round(x * (1 / scale)), saturated."""
    xf = x.float()
    # Tensor by tensor: CUDA divides a tensor by a Python scalar as a multiply by its reciprocal, which
    # rounds differently from the kernel's correctly rounded division.
    one, fmax = torch.ones((), device=x.device), torch.full((), FMAX, device=x.device)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / fmax).clamp(min=MIN_SCALE)
    q = (xf * (one / scale)).clamp(-FMAX, FMAX).to(E4M3)
    return q, scale


def per_token_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 [M, 1]): the torch reference of the Triton quantizer."""
    return _quantize_rows(x)


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear weight [N, K] -> (e4m3 [N, K], fp32 scales [1, N]: one per output channel)."""
    q, scale = _quantize_rows(w)
    return q.contiguous(), scale.reshape(1, -1).contiguous()


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda:
        from actors.layers.kernels.fp8_quant import per_token_quant_fp8_triton

        return per_token_quant_fp8_triton(x if x.stride(-1) == 1 else x.contiguous())
    return per_token_quant_fp8_ref(x)


def fp8_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    small_m_max: int = SMALL_M_MAX,
) -> torch.Tensor:
    """x [..., K] in the model's dtype, wq [N, K] e4m3, w_scale [1, N] -> [..., N] in out_dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] <= small_m_max:
        if x.is_cuda:
            y = w8a16_linear(x2 if x2.stride(-1) == 1 else x2.contiguous(), wq, w_scale, bias, out_dtype)
        else:
            y = w8a16_linear_ref(x2, wq, w_scale, bias, out_dtype)
        return y.reshape(*lead, wq.shape[0])
    xq, x_scale = per_token_quant_fp8(x2)
    y = torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=out_dtype)
    return y.reshape(*lead, wq.shape[0])


def fp8_shape_ok(w: torch.Tensor) -> bool:
    """The scaled GEMM's rule on the GPU: both dims of the weight multiples of 16."""
    return w.dim() == 2 and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0
