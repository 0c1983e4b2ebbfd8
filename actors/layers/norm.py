"""RMSNorm, computed exactly as HF Llama/Qwen do: statistics in float32, cast back to the input
dtype before the weight multiply (the order matters for bit-faithful bf16 results)."""
from __future__ import annotations

import torch
from torch import nn

from actors.layers.weight_utils import default_weight_loader, new_param


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param((hidden_size,), params_dtype, default_weight_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: the pre-norm block's residual add fused in front,
        returning (norm(x + residual), x + residual), the same values HF gets in two steps."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
