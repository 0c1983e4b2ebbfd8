"""The SiLU-gated MLP activation: the input holds [gate | up] (as MergedColumnParallelLinear
produces it, per rank), the output is silu(gate) * up."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
