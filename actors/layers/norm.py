"""RMSNorm, computed exactly as HF Llama/Qwen do: statistics in float32, cast back to the input
dtype before the weight multiply (the order matters for bit-faithful bf16 results).

Backend "torch" runs the ops below (the CPU path, compared token for token with HF); "triton" runs
one fused kernel (residual add included) that rounds at the same points."""

from __future__ import annotations

import torch
from torch import nn

from actors.layers.kernels import layer_ops
from actors.layers.weight_utils import default_weight_loader, new_param
from kvcore.kernels import check_backend


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype, backend: str = "torch") -> None:
        super().__init__()
        check_backend(backend)
        self.eps = eps
        self.backend = backend
        self.weight = new_param((hidden_size,), params_dtype, default_weight_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: the pre-norm block's residual add fused in front,
        returning (norm(x + residual), x + residual), the same values HF gets in two steps."""
        if self.backend == "triton":
            return layer_ops.rms_norm(x, self.weight, self.eps, residual, backend="triton")
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 (scale = 1 + w), and the product is
    taken in float32 before rounding to the input dtype (Llama rounds first, then multiplies).
    Backend "triton" runs the RMSNorm kernel in its Gemma mode (the same rounding)."""

    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype, backend: str = "torch") -> None:
        super().__init__()
        check_backend(backend)
        self.eps, self.backend = eps, backend
        self.weight = new_param((hidden_size,), params_dtype, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton":
            return layer_ops.rms_norm(x, self.weight, self.eps, backend="triton", gemma=True)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)
