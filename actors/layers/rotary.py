"""Rotary position embedding, neox style (rotate_half), as HF Llama/Qwen/Mistral apply it.

Supported `rope_type`s: "default", "linear" and Llama-3.1's "llama3". The inverse frequencies and
the cos/sin table are computed in float32 on the CPU with the same operations HF uses, then kept on
the model's device; at use they are cast to the activation dtype, as HF does before multiplying.

Backend "torch" runs the ops below; "triton" runs one kernel for q and k together (see
actors/layers/kernels/qk_norm_rope.py), which can also apply Qwen3's per-head q/k RMSNorm first
(`forward_fused`) and reads q/k straight out of the QKV projection's output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from actors.layers.kernels import layer_ops
from kvcore.kernels import check_backend
from kvcore.kernels.ops import KVCacheWrite

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeParams:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_params_from_config(cfg: dict[str, Any]) -> RopeParams:
    """Reads both spellings HF has used: `rope_parameters` (transformers 5) and the older
    `rope_theta` + `rope_scaling` (what most published checkpoints carry)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("rope_parameters: per-layer-type RoPE parameters are not supported")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial}: only 1.0 (full rotary) is supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return RopeParams(theta=theta)
    if "factor" not in params:
        raise ValueError(f"rope_scaling: rope_type={rope_type!r} requires 'factor'")
    if rope_type == "linear":
        return RopeParams(theta=theta, rope_type="linear", factor=float(params["factor"]))
    for key in ("low_freq_factor", "high_freq_factor"):
        if key not in params:
            raise ValueError(f"rope_scaling: rope_type='llama3' requires {key!r}")
    orig = params.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    if orig is None:
        raise ValueError("rope_scaling: rope_type='llama3' requires 'original_max_position_embeddings'")
    return RopeParams(
        theta=theta,
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(orig),
    )


def inverse_frequencies(head_size: int, rope: RopeParams) -> torch.Tensor:
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64, device="cpu").float() / head_size
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeParams) -> torch.Tensor:
    """Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between them
    interpolated smoothly."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True)
class QKNormArgs:
    """Per-head q/k RMSNorm applied before rotary (Qwen3, Gemma-3: `gemma` scales by 1 + w)."""

    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 1e-6
    gemma: bool = False


class RotaryEmbedding(nn.Module):
    cos_sin_cache: torch.Tensor  # a non-persistent buffer, registered in __init__

    def __init__(self, head_size: int, max_position: int, rope: RopeParams, backend: str = "torch") -> None:
        super().__init__()
        check_backend(backend)
        self.backend = backend
        if head_size % 2:
            raise ValueError(f"head_dim={head_size}: rotary embedding needs an even head size")
        self.head_size, self.max_position = head_size, max_position
        inv_freq = inverse_frequencies(head_size, rope)
        freqs = torch.arange(max_position, dtype=torch.int64, device="cpu").float()[:, None] * inv_freq[None, :]
        table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, head_size]: cos | sin
        # Allocated on the ambient device (the loader builds models under torch.device(target)).
        self.register_buffer("cos_sin_cache", torch.empty(table.shape, dtype=torch.float32), persistent=False)
        self.cos_sin_cache.copy_(table)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, Hq*D] or [T, Hq, D], key likewise; positions [T] int64. Returns the same shapes."""
        if self.backend == "triton":
            q, k = self.forward_fused(positions, query, key)
            return q.view(query.shape), k.view(key.shape)
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def forward_fused(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, norm: QKNormArgs | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Triton path: per-head RMSNorm of q and k (with `norm`), then rotary, in one launch.
        query/key may be row-strided [T, H*D] views (no copies are made); returns new contiguous
        q [T, Hq*D], k [T, Hkv*D]."""
        n = norm or QKNormArgs()
        return layer_ops.qk_norm_rope(
            query, key, positions, self.cos_sin_cache, n.q_weight, n.k_weight, n.eps, backend="triton", gemma=n.gemma
        )

    def forward_into_cache(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: KVCacheWrite,
        norm: QKNormArgs | None = None,
    ) -> torch.Tensor:
        """forward_fused that writes the rotated K, and V, into the paged cache in the same launch
        instead of returning K; returns q [T, Hq*D]."""
        n = norm or QKNormArgs()
        return layer_ops.qk_norm_rope_into_cache(
            query,
            key,
            value,
            positions,
            self.cos_sin_cache,
            cache,
            n.q_weight,
            n.k_weight,
            n.eps,
            backend="triton",
            gemma=n.gemma,
        )

    # Not `_apply`: that name is nn.Module's hook for .to()/.float(), which this would shadow.
    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_size)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return (x * cos + _rotate_half(x) * sin).view(shape)
