"""KV-cache specs, groups and sizing.

A spec describes one attention layer's cache per block; a group is a set of layers with the same spec,
which share one block table and one slot mapping. All groups draw from one block pool, and since a
block id belongs to one group at a time, the i-th layer of every group can alias the same memory:
one block of memory holds `max_layers_per_group` layer pages.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes of K and V for one block of one layer."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * itemsize

    def max_blocks_per_request(self, max_model_len: int) -> int:
        return -(-max_model_len // self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 0

    def __post_init__(self) -> None:
        if self.sliding_window <= 0:
            raise ValueError(f"SlidingWindowSpec.sliding_window={self.sliding_window}: must be >= 1")


KVCacheSpec = FullAttentionSpec  # SlidingWindowSpec is a subclass


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]

    @property
    def block_sizes(self) -> list[int]:
        return [g.kv_cache_spec.block_size for g in self.kv_cache_groups]

    def layer_to_group(self) -> dict[str, int]:
        return {name: gid for gid, g in enumerate(self.kv_cache_groups) for name in g.layer_names}

    def layer_to_slot(self) -> dict[str, int]:
        """Which shared memory tensor each layer uses: its index within its group."""
        return {name: i for g in self.kv_cache_groups for i, name in enumerate(g.layer_names)}

    @property
    def num_memory_slots(self) -> int:
        return max(len(g.layer_names) for g in self.kv_cache_groups)


def group_layers_by_spec(layer_specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """One group per distinct spec, in the order specs first appear (full attention usually first)."""
    if not layer_specs:
        raise ValueError("group_layers_by_spec: the model has no attention layers")
    groups: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        groups.setdefault(spec, []).append(name)
    page_sizes = {s.page_size_bytes for s in groups}
    if len(page_sizes) != 1:
        raise ValueError(f"all KV-cache groups must share one page size to share a pool; got {sorted(page_sizes)}")
    return [KVCacheGroupSpec(names, spec) for spec, names in groups.items()]


def bytes_per_block(groups: list[KVCacheGroupSpec]) -> int:
    """Memory one block id costs: one page for each layer of the largest group (groups alias memory)."""
    return groups[0].kv_cache_spec.page_size_bytes * max(len(g.layer_names) for g in groups)


def num_blocks_for_budget(groups: list[KVCacheGroupSpec], budget_bytes: int) -> int:
    """How many blocks fit in `budget_bytes`, counting the null block 0 among them."""
    return max(0, int(budget_bytes) // bytes_per_block(groups))


def make_kv_cache_config(layer_specs: dict[str, KVCacheSpec], budget_bytes: int | None = None,
                         num_blocks: int | None = None) -> KVCacheConfig:
    """Group layers by spec and size the pool, from an explicit block count or a byte budget."""
    groups = group_layers_by_spec(layer_specs)
    if num_blocks is None:
        if budget_bytes is None:
            raise ValueError("make_kv_cache_config: give num_blocks or budget_bytes")
        num_blocks = num_blocks_for_budget(groups, budget_bytes)
    if num_blocks < 2:
        raise ValueError(f"KV cache: num_blocks={num_blocks} must be >= 2 (block 0 is the null block); "
                         f"raise gpu_memory_utilization or num_gpu_blocks")
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)
