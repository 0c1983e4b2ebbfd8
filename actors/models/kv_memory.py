"""What the KV cache holds for a model, computed from its config.json alone (no weights, no device):
the per-layer specs one rank would report, the groups they form, the memory a request of
max_model_len tokens needs, and how many such requests a pool holds. Both layouts are reported, the
hybrid groups (sliding-window groups keep only their window) and every layer as full attention, so
the saving is visible before anything runs (`kvray info`)."""

from __future__ import annotations

from typing import Any

import torch

from kvcore.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    as_full_attention,
    blocks_per_request,
    bytes_per_block,
    group_layers_by_spec,
    max_concurrency,
)


def layer_specs_from_hf_config(
    hf_config: dict[str, Any],
    dtype: torch.dtype,
    block_size: int,
    tensor_parallel_size: int,
    cache_dtype: torch.dtype | None = None,
) -> dict[str, KVCacheSpec]:
    """The specs a rank reports for this model: the model is built on the meta device (shapes only);
    its caches hold `cache_dtype` (None: the model's dtype)."""
    from actors.models.registry import build_model

    with torch.device("meta"):
        model = build_model(hf_config, dtype)
    specs: dict[str, KVCacheSpec] = {}
    for layer in model.attention_layers():
        kv_heads = max(1, layer.num_kv_heads // tensor_parallel_size)  # replicated when tp > kv heads
        shape = (block_size, kv_heads, layer.head_size, cache_dtype or dtype)  # what both spec classes start with
        specs[layer.layer_name] = (
            SlidingWindowSpec(*shape, sliding_window=layer.sliding_window)
            if layer.sliding_window
            else FullAttentionSpec(*shape)
        )
    return specs


def layout_summary(
    specs: dict[str, KVCacheSpec],
    max_model_len: int,
    max_num_batched_tokens: int,
    num_blocks: int | None = None,
    budget_bytes: int | None = None,
) -> dict[str, Any]:
    """Groups, bytes per block, blocks and bytes one max_model_len request holds, and the max
    concurrency for `num_blocks` (or for the blocks `budget_bytes` buys)."""
    groups = group_layers_by_spec(specs)
    per_block = bytes_per_block(groups)
    per_request = sum(blocks_per_request(g.kv_cache_spec, max_model_len, max_num_batched_tokens) for g in groups)
    out: dict[str, Any] = {
        "groups": [
            f"{len(g.layer_names)} x {'sliding ' + str(g.kv_cache_spec.sliding_window) if isinstance(g.kv_cache_spec, SlidingWindowSpec) else 'full'}"  # noqa: E501
            for g in groups
        ],
        "bytes_per_block": per_block,
        "blocks_per_request": per_request,
        "kv_bytes_per_request": per_block * per_request,
    }
    if num_blocks is None and budget_bytes is not None:
        num_blocks = budget_bytes // per_block
    if num_blocks is not None:
        pool = KVCacheConfig(int(num_blocks), groups)
        out["num_blocks"] = int(num_blocks)
        # vLLM's figure: each request at its peak, a whole max_num_batched_tokens chunk in flight.
        out["max_concurrency"] = round(max_concurrency(pool, max_model_len, max_num_batched_tokens), 2)
        # Requests past their prefill, decoding one token a step: a window's worth of blocks each.
        out["max_concurrency_decoding"] = round(max_concurrency(pool, max_model_len, 1), 2)
    return out


def kv_cache_report(
    hf_config: dict[str, Any],
    dtype: torch.dtype,
    block_size: int,
    tensor_parallel_size: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    num_blocks: int | None = None,
    budget_bytes: int | None = None,
    cache_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Hybrid vs all-full-attention layouts of one rank, side by side, for the same pool memory."""
    specs = layer_specs_from_hf_config(hf_config, dtype, block_size, tensor_parallel_size, cache_dtype)
    hybrid = layout_summary(specs, max_model_len, max_num_batched_tokens, num_blocks, budget_bytes)
    # The same memory as the hybrid pool (or budget), spent on the full-attention layout.
    budget = (
        budget_bytes
        if budget_bytes is not None
        else (hybrid["bytes_per_block"] * num_blocks if num_blocks is not None else None)
    )
    full = layout_summary(as_full_attention(specs), max_model_len, max_num_batched_tokens, None, budget)
    return {"max_model_len": max_model_len, "hybrid": hybrid, "all_full_attention": full}
