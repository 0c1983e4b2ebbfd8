"""KV-cache specs, groups and sizing.

A spec describes one attention layer's cache per block; a group is a set of layers with the same spec,
which share one block table and one slot mapping. All groups draw from one block pool, and since a
block id belongs to one group at a time, the i-th layer of every group can alias the same memory:
one block of memory holds `max_layers_per_group` layer pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Bytes per element of the cache dtypes. Specs name their dtype, so that the driver, which sizes and
# groups caches but holds none, never imports torch (unpickling a torch.dtype would).
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any  # a torch.dtype or its name; kept as the name ("bfloat16")

    def __post_init__(self) -> None:
        name = str(self.dtype).removeprefix("torch.")
        if name not in ITEMSIZE:
            raise ValueError(f"{type(self).__name__}.dtype={self.dtype!r}: must be one of {sorted(ITEMSIZE)}")
        object.__setattr__(self, "dtype", name)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of K and V for one block of one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * ITEMSIZE[self.dtype]

    def max_blocks_per_request(self, max_model_len: int) -> int:
        return -(-max_model_len // self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
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
    """Layers of one spec, cut into groups of (about) equal size, as vLLM's hybrid allocator does.

    One block id costs a page in every memory slot, and there are as many slots as layers in the
    largest group; so with 10 global and 52 sliding layers in two groups, a global block would pay
    for 52 pages and the window would save almost nothing. Cutting every kind into groups of the
    smallest kind's size (10: one global group, six sliding ones, the last shorter) makes a block
    cost 10 pages, and a sliding group's few blocks are cheap. When the kinds are within 25% of each
    other the largest size is used instead, so no group is split needlessly. Groups keep the order
    in which their kinds first appear (full attention usually first)."""
    if not layer_specs:
        raise ValueError("group_layers_by_spec: the model has no attention layers")
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        by_spec.setdefault(spec, []).append(name)
    page_sizes = {s.page_size_bytes for s in by_spec}
    if len(page_sizes) != 1:
        raise ValueError(f"all KV-cache groups must share one page size to share a pool; got {sorted(page_sizes)}")
    sizes = [len(names) for names in by_spec.values()]
    group_size = max(sizes) if max(sizes) <= 1.25 * min(sizes) else min(sizes)
    return [
        KVCacheGroupSpec(names[i : i + group_size], spec)
        for spec, names in by_spec.items()
        for i in range(0, len(names), group_size)
    ]


def as_full_attention(layer_specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Every layer's cache managed as full attention (vLLM's disable_hybrid_kv_cache_manager):
    sliding-window layers keep every block, while attention still applies their window."""
    return {
        name: FullAttentionSpec(s.block_size, s.num_kv_heads, s.head_size, s.dtype) for name, s in layer_specs.items()
    }


def blocks_per_request(spec: KVCacheSpec, max_model_len: int, max_num_batched_tokens: int) -> int:
    """Blocks one request of max_model_len tokens holds at its peak in a group of this spec. A
    sliding window keeps the window plus one step's chunk, one block more for alignment, as vLLM
    counts it."""
    full = spec.max_blocks_per_request(max_model_len)
    if not isinstance(spec, SlidingWindowSpec):
        return full
    tokens = min(spec.sliding_window - 1 + max_num_batched_tokens, max_model_len)
    return min(full, -(-tokens // spec.block_size) + 1)


def max_concurrency(config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int) -> float:
    """How many requests of max_model_len tokens the pool holds at once (block 0 excluded)."""
    per_request = sum(
        blocks_per_request(g.kv_cache_spec, max_model_len, max_num_batched_tokens) for g in config.kv_cache_groups
    )
    return (config.num_blocks - 1) / per_request


def bytes_per_block(groups: list[KVCacheGroupSpec]) -> int:
    """Memory one block id costs: one page for each layer of the largest group (groups alias memory)."""
    return groups[0].kv_cache_spec.page_size_bytes * max(len(g.layer_names) for g in groups)


def num_blocks_for_budget(groups: list[KVCacheGroupSpec], budget_bytes: int) -> int:
    """How many blocks fit in `budget_bytes`, counting the null block 0 among them."""
    return max(0, int(budget_bytes) // bytes_per_block(groups))


def make_kv_cache_config(
    layer_specs: dict[str, KVCacheSpec], budget_bytes: int | None = None, num_blocks: int | None = None
) -> KVCacheConfig:
    """Group layers by spec and size the pool, from an explicit block count or a byte budget."""
    groups = group_layers_by_spec(layer_specs)
    if num_blocks is None:
        if budget_bytes is None:
            raise ValueError("make_kv_cache_config: give num_blocks or budget_bytes")
        num_blocks = num_blocks_for_budget(groups, budget_bytes)
    if num_blocks < 2:
        raise ValueError(
            f"KV cache: num_blocks={num_blocks} must be >= 2 (block 0 is the null block); "
            f"raise gpu_memory_utilization or num_gpu_blocks"
        )
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)
