"""Plain-torch references of the fused layer kernels: the oracles the Triton kernels are tested
against. They restate the torch layers of actors/layers (norm.py, rotary.py, activation.py) op for
op, so they round exactly where those layers (and HF) round; tests check that they agree with the
layers bit for bit.
"""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F


@overload
def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None, gemma: bool = False
) -> torch.Tensor: ...
@overload
def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor, gemma: bool = False
) -> tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, gemma: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x), or (norm(x + residual), x + residual); the norm is over the last dimension.
    `gemma`: Gemma's scale (1 + w), multiplied in float32 before the one rounding to x's dtype."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (h * (1.0 + weight.float())).to(dtype) if gemma else weight * h.to(dtype)
    return out if residual is None else (out, x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def qk_norm_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] -> (q [T, Hq*D], k [T, Hkv*D]): optional per-head RMSNorm
    (Qwen3's q_norm/k_norm), then neox rotary at `positions` from the fp32 cos | sin table."""
    if q_weight is not None and k_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps, gemma=gemma), rms_norm_ref(k, k_weight, eps, gemma=gemma)
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
    num_tokens = q.shape[0]
    return _rope(q, cos, sin).reshape(num_tokens, -1), _rope(k, cos, sin).reshape(num_tokens, -1)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2*d] = [gate | up] -> silu(gate) * up, [..., d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
