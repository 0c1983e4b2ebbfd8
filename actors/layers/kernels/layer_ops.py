"""Dispatchers of the fused layer ops (RMSNorm, q/k norm + rotary, SiLU-and-mul): "torch" runs the
plain-torch references, "triton" the kernels (also runnable under TRITON_INTERPRET=1).

Validation reads only shapes, dtypes, strides and devices, never tensor values, so the ops stay
free of host synchronisation and capturable in CUDA graphs. `positions` must lie in
[0, max_position) of the cos/sin table; like the rest of the hot path, that is the caller's promise.
"""

from __future__ import annotations

from typing import overload

import torch

from actors.layers.kernels.layer_reference import qk_norm_rope_ref, rms_norm_ref, silu_and_mul_ref
from kvcore.kernels import check_backend as _check_backend
from kvcore.kernels import require as _require
from kvcore.kernels.ops import FLOAT_DTYPES, KVCacheWrite, check_cache_write
from kvcore.kernels.reference import reshape_and_cache_ref

MAX_HIDDEN = 16384  # widest row the RMSNorm kernel holds in one program


def _check_float(name: str, t: torch.Tensor) -> None:
    _require(t.dtype in FLOAT_DTYPES, f"{name} dtype must be one of {FLOAT_DTYPES}, got {t.dtype}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, last dim] with unit column stride: a view when the layout allows, else a copy."""
    flat = t if t.dim() == 2 else t.reshape(-1, t.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


@overload
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: None = None,
    backend: str = "torch",
    gemma: bool = False,
) -> torch.Tensor: ...
@overload
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor,
    backend: str = "torch",
    gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    backend: str = "torch",
    gemma: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x [..., N]; with residual returns (norm(x + residual), x + residual).
    `gemma`: Gemma's (1 + w) scale, applied in float32 (see layer_reference.rms_norm_ref)."""
    _check_backend(backend)
    _require(x.dim() >= 1, "x must have at least one dimension")
    _check_float("x", x)
    _check_float("weight", weight)
    n = x.shape[-1]
    _require(
        weight.dim() == 1 and weight.shape[0] == n,
        f"weight must be [{n}] (x's last dim), got shape {tuple(weight.shape)}",
    )
    if residual is not None:
        _require(
            residual.shape == x.shape and residual.dtype == x.dtype,
            f"residual must match x: shape {tuple(x.shape)} dtype {x.dtype}, got "
            f"{tuple(residual.shape)} {residual.dtype}",
        )
    if backend == "torch":
        return rms_norm_ref(x, weight, eps, residual, gemma=gemma)
    _require(0 < n <= MAX_HIDDEN, f"x's last dim (hidden size) must be in 1..{MAX_HIDDEN}, got {n}")
    _require(
        len({t.device for t in (x, weight, residual) if t is not None}) == 1,
        "x, weight and residual must be on one device",
    )
    from actors.layers.kernels.rms_norm import rms_norm_triton

    out = rms_norm_triton(_rows(x), weight, eps, None if residual is None else _rows(residual), gemma=gemma)
    if isinstance(out, torch.Tensor):  # no residual: the norm alone
        return out.view(x.shape)
    return out[0].view(x.shape), out[1].view(x.shape)


def _heads(name: str, t: torch.Tensor, head_size: int) -> torch.Tensor:
    """[T, H*D] or [T, H, D] -> [T, H, D] with unit stride on D (a view when possible)."""
    _require(t.dim() in (2, 3), f"{name} must be [T, H*D] or [T, H, D], got shape {tuple(t.shape)}")
    _require(
        t.shape[-1] % head_size == 0, f"{name}'s last dim {t.shape[-1]} must be a multiple of head_size {head_size}"
    )
    if t.dim() == 2:
        t = t if t.stride(-1) == 1 else t.contiguous()
        return t.view(t.shape[0], t.shape[1] // head_size, head_size)
    _require(t.shape[2] == head_size, f"{name} [T, H, D] must have D = head_size {head_size}, got {t.shape[2]}")
    return t if t.stride(-1) == 1 else t.contiguous()


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    backend: str = "torch",
    gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm of q and k, then neox rotary embedding at `positions`.

    q [T, Hq*D] or [T, Hq, D], k likewise (row/head-strided views welcome: the kernel reads them in
    place); cos_sin_cache [max_pos, D] float32 = cos | sin halves. Returns new contiguous
    q [T, Hq*D] and k [T, Hkv*D]."""
    q3, k3 = _check_qk(q, k, positions, cos_sin_cache, q_weight, k_weight, backend)
    if backend == "torch":
        return qk_norm_rope_ref(q3, k3, positions, cos_sin_cache, q_weight, k_weight, eps, gemma=gemma)
    from actors.layers.kernels.qk_norm_rope import qk_norm_rope_triton

    return qk_norm_rope_triton(q3, k3, positions, cos_sin_cache, q_weight, k_weight, eps, gemma=gemma)


def qk_norm_rope_into_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    cache: KVCacheWrite,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    backend: str = "torch",
    gemma: bool = False,
) -> torch.Tensor:
    """qk_norm_rope, then this step's rotated K and its V written into the paged cache at
    cache.slot_mapping (ops.reshape_and_cache's rules); returns q [T, Hq*D]. The Triton path is one
    launch: K goes from the rotary's registers to its slot, never through a K tensor."""
    q3, k3 = _check_qk(q, k, positions, cos_sin_cache, q_weight, k_weight, backend)
    v3 = _heads("v", v, cos_sin_cache.shape[1])
    check_cache_write(k3, v3, cache)
    if backend == "torch":
        q_out, k_out = qk_norm_rope_ref(q3, k3, positions, cos_sin_cache, q_weight, k_weight, eps, gemma=gemma)
        reshape_and_cache_ref(
            k_out.view(k3.shape),
            v3,
            cache.key_cache,
            cache.value_cache,
            cache.slot_mapping,
            cache.k_scale,
            cache.v_scale,
        )
        return q_out
    _require(v.dtype == q.dtype, f"v dtype {v.dtype} must equal q dtype {q.dtype}")
    from actors.layers.kernels.qk_norm_rope import qk_norm_rope_cache_triton

    return qk_norm_rope_cache_triton(q3, k3, v3, positions, cos_sin_cache, q_weight, k_weight, eps, cache, gemma=gemma)


def _check_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rules of the rotary ops; q and k as [T, H, D] views."""
    _check_backend(backend)
    _require(
        cos_sin_cache.dim() == 2 and cos_sin_cache.dtype == torch.float32,
        f"cos_sin_cache must be 2-D float32 [max_pos, head_size], got {cos_sin_cache.dtype} "
        f"shape {tuple(cos_sin_cache.shape)}",
    )
    head_size = cos_sin_cache.shape[1]
    _require(head_size % 2 == 0 and head_size > 0, f"head_size {head_size} must be even and positive")
    q3, k3 = _heads("q", q, head_size), _heads("k", k, head_size)
    _require(q3.shape[0] == k3.shape[0], f"q and k must have equal token counts, got {q3.shape[0]} and {k3.shape[0]}")
    _check_float("q", q)
    _require(k.dtype == q.dtype, f"k dtype {k.dtype} must equal q dtype {q.dtype}")
    _require(
        positions.dim() == 1 and positions.dtype in (torch.int32, torch.int64) and positions.shape[0] == q3.shape[0],
        f"positions must be 1-D int32/int64 with {q3.shape[0]} entries, got {positions.dtype} "
        f"shape {tuple(positions.shape)}",
    )
    _require((q_weight is None) == (k_weight is None), "q_weight and k_weight must both be given or both None")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None:
            _require(
                w.shape == (head_size,) and w.dtype == q.dtype,
                f"{name} must be [{head_size}] of dtype {q.dtype}, got {tuple(w.shape)} {w.dtype}",
            )
    if backend == "triton":
        tensors = (q, k, positions, cos_sin_cache, q_weight, k_weight)
        _require(len({t.device for t in tensors if t is not None}) == 1, "all tensors must be on one device")
        _require(cos_sin_cache.stride(-1) == 1, "cos_sin_cache: rows must be contiguous (stride 1)")
    return q3, k3


def silu_and_mul(x: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """x [..., 2*d] = [gate | up] -> silu(gate) * up, [..., d]."""
    _check_backend(backend)
    _require(
        x.dim() >= 1 and x.shape[-1] % 2 == 0, f"x's last dim must be even ([gate | up]), got shape {tuple(x.shape)}"
    )
    _check_float("x", x)
    if backend == "torch":
        return silu_and_mul_ref(x)
    from actors.layers.kernels.silu_mul import silu_and_mul_triton

    out = silu_and_mul_triton(_rows(x))
    return out.view(*x.shape[:-1], x.shape[-1] // 2)
