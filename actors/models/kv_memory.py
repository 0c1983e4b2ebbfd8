"""What the KV cache holds for a model, computed from its config.json alone (no weights, no device):
the per-layer specs one rank would report, the groups they form, the memory a request of
max_model_len tokens needs, and how many such requests a pool holds. Both layouts are reported, the
hybrid groups (sliding-window groups keep only their window) and every layer as full attention, so
the saving is visible before anything runs (`kvray info`).

With pipeline stages each stage holds the cache of its own layers only: the engine's groups (of every
stage's layers, one block-id space) cut to the stage's layers. A block id then costs each stage a page
for each of its layers in its largest cut group, so the stages' block counts differ, and the engine takes
the smallest (the workers size it so: actors/worker/kv_cache_sizing.py uses the same cut)."""

from __future__ import annotations

from typing import Any

import torch

from kvcore.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
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


def cut_groups(groups: list[KVCacheGroupSpec], own_layers: set[str]) -> list[KVCacheGroupSpec]:
    """The groups with only `own_layers` left in each (the same groups, in the same order: their ids)."""
    return [KVCacheGroupSpec([n for n in g.layer_names if n in own_layers], g.kv_cache_spec) for g in groups]


def describe_group(group: KVCacheGroupSpec) -> str:
    spec = group.kv_cache_spec
    kind = f"sliding {spec.sliding_window}" if isinstance(spec, SlidingWindowSpec) else "full"
    return f"{len(group.layer_names)} x {kind}"


def stage_attention_layers(partition: list[int], specs: dict[str, KVCacheSpec]) -> list[list[str]]:
    """The attention layers of each pipeline stage, from its decoder-layer counts."""
    from actors.models.decoder import attention_layer_name  # the model zoo loads only where it is used

    out: list[list[str]] = []
    start = 0
    for count in partition:
        names = (attention_layer_name(i) for i in range(start, start + count))
        out.append([n for n in names if n in specs])
        start += count
    return out


def stage_summaries(
    groups: list[KVCacheGroupSpec],
    partition: list[int],
    stage_layers: list[list[str]],
    num_blocks: int | None,
    budget_bytes: int | None,
) -> tuple[list[dict[str, Any]], list[int], str]:
    """Per stage: its decoder layers [start, end), the engine's groups it holds layers of (by group id),
    what one block id costs it, and the blocks it holds (the override, or what the budget buys it).
    Also the stages that bound the engine's block count, and why."""
    stages: list[dict[str, Any]] = []
    start = 0
    for s, (count, names) in enumerate(zip(partition, stage_layers, strict=True)):
        cut = cut_groups(groups, set(names))
        held = [(gid, g) for gid, g in enumerate(cut) if g.layer_names]
        per_block = bytes_per_block([g for _, g in held]) if held else 0
        blocks = num_blocks
        if blocks is None and budget_bytes is not None and per_block:
            blocks = budget_bytes // per_block
        stages.append(
            {
                "stage": s,
                "layers": [start, start + count],
                "groups": [f"g{gid}: {describe_group(g)}" for gid, g in held],
                "bytes_per_block": per_block,
                "num_blocks": blocks,
            }
        )
        start += count
    if num_blocks is not None:
        return stages, list(range(len(stages))), "cache.num_gpu_blocks: every stage holds that many"
    costliest = max(st["bytes_per_block"] for st in stages)
    bound = [st["stage"] for st in stages if st["bytes_per_block"] == costliest]
    if budget_bytes is not None:
        return stages, bound, "the most bytes per block: the fewest blocks for the same budget"
    return stages, bound, "the most bytes per block: the fewest blocks for equal free memory (known after profiling)"


def layout_summary(
    specs: dict[str, KVCacheSpec],
    max_model_len: int,
    max_num_batched_tokens: int,
    num_blocks: int | None = None,
    budget_bytes: int | None = None,
    partition: list[int] | None = None,
) -> dict[str, Any]:
    """Groups, bytes per block, blocks and bytes one max_model_len request holds, and the max
    concurrency for `num_blocks` (or for the blocks `budget_bytes` buys). With pipeline stages
    (`partition`: decoder layers per stage) `budget_bytes` is each stage's, the block count the
    smallest any stage holds, and the stages are described one by one."""
    groups = group_layers_by_spec(specs)
    per_block = bytes_per_block(groups)
    per_request = sum(blocks_per_request(g.kv_cache_spec, max_model_len, max_num_batched_tokens) for g in groups)
    out: dict[str, Any] = {
        "groups": [describe_group(g) for g in groups],
        "bytes_per_block": per_block,
        "blocks_per_request": per_request,
        "kv_bytes_per_request": per_block * per_request,
    }
    if partition is not None and len(partition) > 1:
        stages, bound, why = stage_summaries(
            groups, partition, stage_attention_layers(partition, specs), num_blocks, budget_bytes
        )
        out["stages"] = stages
        out["block_count_bound_by"] = {"stages": bound, "why": why}
        if num_blocks is None and budget_bytes is not None:
            num_blocks = min(st["num_blocks"] for st in stages if st["num_blocks"] is not None)
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
    partition: list[int] | None = None,
) -> dict[str, Any]:
    """Hybrid vs all-full-attention layouts of one rank, side by side, for the same pool memory.
    `partition`: decoder layers per pipeline stage (each stage then holds its own layers' cache)."""
    specs = layer_specs_from_hf_config(hf_config, dtype, block_size, tensor_parallel_size, cache_dtype)
    hybrid = layout_summary(specs, max_model_len, max_num_batched_tokens, num_blocks, budget_bytes, partition)
    # The same memory as the hybrid pool (or budget), spent on the full-attention layout: with stages,
    # what the bounding stage spends.
    staged = partition is not None and len(partition) > 1
    spent = bounding_stage_bytes_per_block(hybrid) if staged else hybrid["bytes_per_block"]
    budget = budget_bytes if budget_bytes is not None else (spent * num_blocks if num_blocks is not None else None)
    full = layout_summary(as_full_attention(specs), max_model_len, max_num_batched_tokens, None, budget, partition)
    return {"max_model_len": max_model_len, "hybrid": hybrid, "all_full_attention": full}


def bounding_stage_bytes_per_block(summary: dict[str, Any]) -> int:
    """Bytes per block of the stage that bounds the block count."""
    return int(max(st["bytes_per_block"] for st in summary["stages"]))
