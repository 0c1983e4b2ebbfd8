"""HF transformers under fp8's rounding: the control beside check_logprobs_close's fp8 runs.

A random-weight model's next-token distribution is nearly flat (the top logprob sits near -7 to -9.5, HF's
top-5 within ~0.3 nats of each other), so any fp8 rounding reorders it, whoever implements it. Whether
kvray's fp8 is faithful therefore reads from this control: HF's own modules with fp8's rounding applied,
run on the same prompts and held to the same rule against HF bf16. kvray's fp8 should diverge from bf16
about as much as the control does, not less and not more.

What is rounded, as kvray does it (actors/layers/fp8_linear.py and the fp8 KV cache):
- weights: every nn.Linear inside the decoder layers whose shape kvray's fp8 GEMM takes (fp8_shape_ok), to
  e4m3 per output channel (scale: the row's amax / 448), kept in the model's dtype; the embedding and the
  LM head stay as they are (as in kvray and vLLM's online fp8);
- activations: the input of each such linear, per token the same way (kvray's path above 64 rows; vLLM's
  online fp8 rounds per tensor, a coarser rule);
- KV cache: each layer's new keys (after RoPE and any norm) and values, to e4m3 at scale 1.0 as they enter
  the cache, so attention reads them rounded, as from an fp8 cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from actors.layers.fp8_linear import fp8_shape_ok

FMAX = 448.0  # e4m3's largest finite value


def round_rows_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 with one scale per row (the row's amax / 448), back in x's dtype."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FMAX).clamp(min=1e-12)
    return ((xf / scale).clamp(-FMAX, FMAX).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 at scale 1.0, saturated, back in x's dtype (the fp8 KV cache's rule)."""
    return x.float().clamp(-FMAX, FMAX).to(torch.float8_e4m3fn).to(x.dtype)


def round_linears(model: Any) -> int:
    """Every decoder-layer nn.Linear: its weight rounded in place, its input rounded at each call.
    -> how many linears."""
    layers = model.get_decoder().layers
    n = 0
    with torch.no_grad():
        for mod in layers.modules():
            if isinstance(mod, torch.nn.Linear) and fp8_shape_ok(mod.weight):
                mod.weight.copy_(round_rows_e4m3(mod.weight))
                mod.register_forward_pre_hook(lambda _m, args: (round_rows_e4m3(args[0]), *args[1:]))
                n += 1
    if not n:
        raise RuntimeError(f"{type(model).__name__}: no nn.Linear in its decoder layers to round")
    return n


def fp8_kv_cache_factory(model: torch.nn.Module) -> Callable[[], Any]:
    """-> a maker of fresh HF caches (one per generate call) that store keys and values rounded to e4m3."""
    from transformers import DynamicCache

    class Fp8RoundedCache(DynamicCache):
        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return super().update(round_e4m3(key_states), round_e4m3(value_states), *args, **kwargs)

    return lambda: Fp8RoundedCache(config=model.config)
