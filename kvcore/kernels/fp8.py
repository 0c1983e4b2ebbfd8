"""The fp8 KV-cache formats (vLLM's kv_cache_dtype "fp8" / "fp8_e4m3" and "fp8_e5m2"): their names, their
limits, and the quantization the torch reference applies (the Triton cache write, cache_write.py,
rounds the same way).

A value is stored as round(x / scale), saturated to the format's largest finite value, nearest even;
attention reads it back as stored * scale. The scale is per layer and per K / V (vLLM's k_scale and
v_scale), 1.0 unless a checkpoint says otherwise.

Torch only (no triton import): the op dispatchers import this, and they load no Triton until a
kernel launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# vLLM's names for the fp8 caches -> the torch dtype the cache is allocated in.
FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class Fp8Format:
    mantissa_bits: int
    min_exponent: int  # of the smallest normal number; below it the grid is the subnormal step
    max_value: float  # the largest finite value: stores saturate here


FORMATS = {
    torch.float8_e4m3fn: Fp8Format(3, -6, 448.0),
    torch.float8_e5m2: Fp8Format(2, -14, 57344.0),
}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """cache.kv_cache_dtype ("auto": the model's dtype, as vLLM) as the dtype the cache is allocated in."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FP8_KV_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: must be 'auto' or one of {sorted(FP8_KV_DTYPES)}")
    return FP8_KV_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FORMATS


def quantize_ref(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale as the cache stores it (the kernel multiplies by the fp32 reciprocal, so does this)."""
    fmt = FORMATS[dtype]
    inv = torch.tensor(1.0 / scale, dtype=torch.float32, device=x.device)
    return (x.float() * inv).clamp(-fmt.max_value, fmt.max_value).to(dtype)


def format_constexprs(dtype: torch.dtype) -> dict:
    """The kernel constexprs of a cache dtype (zeros for a non-fp8 cache: the branch compiles away)."""
    fmt = FORMATS.get(dtype)
    if fmt is None:
        return dict(FP8_MANT=0, FP8_EMIN=0, FP8_MAX=0.0)
    return dict(FP8_MANT=fmt.mantissa_bits, FP8_EMIN=fmt.min_exponent, FP8_MAX=fmt.max_value)
