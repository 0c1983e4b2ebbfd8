"""The gated MLP activations. SiLU: the input holds [gate | up] (as MergedColumnParallelLinear
produces it, per rank), the output is silu(gate) * up. Backend "triton" does it in one kernel
launch with the same rounding (silu rounded to the dtype, then the product)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actors.layers.kernels import layer_ops
from kvcore.kernels import check_backend


class SiluAndMul(nn.Module):
    def __init__(self, backend: str = "torch") -> None:
        super().__init__()
        check_backend(backend)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton":
            return layer_ops.silu_and_mul(x, backend="triton")
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class GeluAndMul(nn.Module):
    """GeGLU (Gemma): gelu(gate) * up on [gate | up], with HF's `hidden_activation` naming:
    "gelu_pytorch_tanh" is the tanh approximation, "gelu" the exact erf form."""

    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in GELU_APPROXIMATIONS:
            raise ValueError(f"hidden_activation={hidden_act!r}: must be one of {sorted(GELU_APPROXIMATIONS)}")
        self.approximate = GELU_APPROXIMATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]
