"""The paged attention layer: writes this step's K/V into the layer's paged cache, then attends
over the cache through the block table of the layer's KV-cache group.

The layer holds no per-step state. The model runner installs one AttentionMetadata per KV-cache
group in the forward context and binds `kv_cache` ([2, num_blocks, block_size, Hkv, D], K then V)
after allocating it; layers of one group share the metadata, each layer has its own cache tensor.

`forward` writes K/V and attends. A caller that writes K/V itself (the decoder's fused rotary kernel,
actors/layers/kernels/qk_norm_rope.py) asks `cache_write()` where they go and then calls `attend`.
"""

from __future__ import annotations

import torch
from torch import nn

from actors.forward_context import AttentionMetadata, get_forward_context
from kvcore.kernels import check_backend, ops
from kvcore.kernels.ops import KVCacheWrite


class Attention(nn.Module):
    def __init__(
        self,
        layer_name: str,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        sliding_window: int | None = None,
        backend: str = "torch",
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        check_backend(backend, "attention_backend")
        if num_heads % num_kv_heads:
            raise ValueError(f"{layer_name}: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"{layer_name}: sliding_window={sliding_window} must be >= 1")
        self.layer_name = layer_name
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = scale
        if softcap is not None and not softcap > 0:
            raise ValueError(f"{layer_name}: attn_logit_softcapping={softcap} must be > 0")
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None
        # An fp8 cache stores K / k_scale and V / v_scale (vLLM's per-layer scales); 1.0 unless set.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D]."""
        cache = self.cache_write()
        if cache is None:
            # Profile run: no cache exists yet; the runner only measures activation memory.
            return torch.zeros_like(q)
        num_tokens = q.shape[0]
        n = self._metadata().num_actual_tokens
        ops.reshape_and_cache(
            k.view(num_tokens, self.num_kv_heads, self.head_size)[:n],
            v.view(num_tokens, self.num_kv_heads, self.head_size)[:n],
            cache.key_cache,
            cache.value_cache,
            cache.slot_mapping,
            backend=self.backend,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        return self.attend(q)

    def cache_write(self) -> KVCacheWrite | None:
        """Where this step's K/V go (a caller that writes them itself, as the fused rotary kernel does,
        then calls `attend`); None in the profile run, before any cache exists."""
        ctx = get_forward_context()
        if ctx.attn_metadata is None:
            return None
        if self.kv_cache is None:
            raise RuntimeError(f"{self.layer_name}: kv_cache is not bound (initialize the KV cache first)")
        md = self._metadata()
        return KVCacheWrite(self.kv_cache[0], self.kv_cache[1], md.slot_mapping, self.k_scale, self.v_scale)

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """Attention of q [T, Hq*D] over the cache, which already holds this step's K/V -> [T, Hq*D]."""
        md = self._metadata()
        assert self.kv_cache is not None, "cache_write() checks the binding first"
        num_tokens = q.shape[0]
        n = md.num_actual_tokens
        query = q.view(num_tokens, self.num_heads, self.head_size)
        out = torch.empty_like(query)
        if n < num_tokens:
            out[n:].zero_()  # padding rows: the kernels leave them untouched
        ops.paged_attention(
            query,
            self.kv_cache[0],
            self.kv_cache[1],
            out,
            md.query_start_loc,
            md.seq_lens,
            md.block_table,
            self.scale,
            sliding_window=self.sliding_window,
            max_query_len=md.max_query_len,
            max_seq_len=md.max_seq_len,
            backend=self.backend,
            softcap=self.softcap,
            seq_order=md.seq_order,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        return out.view(num_tokens, self.num_heads * self.head_size)

    def _metadata(self) -> AttentionMetadata:
        ctx = get_forward_context()
        assert ctx.attn_metadata is not None
        return ctx.attn_metadata[ctx.layer_to_group[self.layer_name]]
