"""The SiLU-gated MLP activation: the input holds [gate | up] (as MergedColumnParallelLinear
produces it, per rank), the output is silu(gate) * up. Backend "triton" does it in one kernel
launch with the same rounding (silu rounded to the dtype, then the product)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvcore.kernels import layer_ops


class SiluAndMul(nn.Module):
    def __init__(self, backend: str = "torch") -> None:
        super().__init__()
        if backend not in layer_ops.BACKENDS:
            raise ValueError(f"backend={backend!r}: must be one of {layer_ops.BACKENDS}")
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton":
            return layer_ops.silu_and_mul(x, backend="triton")
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
