"""Per-group block bookkeeping: one manager per KV-cache group, by attention type.

Each manager holds, per request, the row of blocks its group uses (index i covers token positions
[i*block_size, (i+1)*block_size)), and how many leading blocks of that row are already registered in
the prefix cache. All managers draw from the same BlockPool.
"""

from __future__ import annotations

from typing import Sequence

from kvcore.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvcore.kv_cache.hashing import BlockHash
from kvcore.request import Request
from kvcore.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeKVCacheManager:
    """Shared logic: allocation, caching and freeing of one group's rows."""

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    # ---- planning (no side effects) -----------------------------------------------------------
    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Blocks this group takes out of the free queue to hold `num_tokens` tokens.

        Counts new blocks plus prefix-cache hits that currently sit in the free queue (ref_cnt 0):
        touching those removes them from the queue just like an allocation would.
        """
        row = self.req_to_blocks.get(request_id, ())
        num_new = cdiv(num_tokens, self.block_size) - len(new_computed_blocks) - len(row)
        num_evictable_hits = 0
        for b in new_computed_blocks:
            if b.ref_cnt == 0 and not b.is_null:
                num_evictable_hits += 1
        return max(0, num_new) + num_evictable_hits

    def num_blocks_freed_by_skipping(self, request_id: str, num_computed_tokens: int) -> int:
        """How many blocks remove_skipped_blocks would return to the free queue (0 for full attention)."""
        return 0

    # ---- state changes --------------------------------------------------------------------------
    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """Start a new request's row with its prefix-cache hits (already touched by the caller)."""
        if request_id not in self.req_to_blocks:
            self.req_to_blocks[request_id] = list(new_computed_blocks)
            self.num_cached_block[request_id] = len(new_computed_blocks)
        elif new_computed_blocks:
            raise ValueError(
                f"request {request_id!r} already holds blocks; prefix-cache hits can only be "
                f"added when a request (re)starts"
            )

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Extend the row so it covers `num_tokens` tokens; return the blocks added."""
        row = self.req_to_blocks.setdefault(request_id, [])
        self.num_cached_block.setdefault(request_id, 0)
        num_new = cdiv(num_tokens, self.block_size) - len(row)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        row.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the row's full blocks among the first `num_tokens` tokens in the prefix cache."""
        rid = request.request_id
        num_cached = self.num_cached_block[rid]
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[rid], num_cached, num_full, self.group_id)
        self.num_cached_block[rid] = num_full

    def free(self, request_id: str) -> None:
        """Release the request's row tail first, so a chain's last blocks are evicted before its head."""
        row = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks(reversed(row))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Drop blocks no future token can attend to (only sliding windows have any)."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_id: int,
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
    ) -> list[KVCacheBlock]:
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every token attends to the whole prefix, so a hit must start at block 0."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_id: int,
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
    ) -> list[KVCacheBlock]:
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[: max_length // kv_cache_spec.block_size]:
            block = block_pool.get_cached_block(block_hash, group_id)
            if block is None:
                break
            hits.append(block)
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window W: the query at position p attends keys in (p - W, p].

    Blocks wholly before the window of the next token to compute are returned to the pool and their
    row entries become the null block, which keeps every later block at its positional index.
    """

    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(kv_cache_spec, block_pool, group_id)
        self.sliding_window = kv_cache_spec.sliding_window

    def _first_useful_block(self, num_computed_tokens: int) -> int:
        # The next token (position num_computed_tokens) still needs keys from here on.
        first_useful_token = num_computed_tokens - self.sliding_window + 1
        return max(0, first_useful_token) // self.block_size

    def _skippable(self, request_id: str, num_computed_tokens: int) -> tuple[int, list[KVCacheBlock]]:
        """(end, blocks): live blocks before row index `end`, walking back until an already-dropped one."""
        row = self.req_to_blocks.get(request_id)
        if not row:
            return 0, []
        end = min(self._first_useful_block(num_computed_tokens), len(row))
        out = []
        for i in range(end - 1, -1, -1):
            if row[i].is_null:  # everything before was dropped by an earlier call
                break
            out.append(row[i])
        return end, out

    def num_blocks_freed_by_skipping(self, request_id: str, num_computed_tokens: int) -> int:
        return sum(1 for b in self._skippable(request_id, num_computed_tokens)[1] if b.ref_cnt == 1)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        end, removed = self._skippable(request_id, num_computed_tokens)
        if not removed:
            return
        row = self.req_to_blocks[request_id]
        null = self.block_pool.null_block
        for i in range(end - len(removed), end):
            row[i] = null
        # `removed` runs from the window backwards: the chain's later blocks are evicted first.
        self.block_pool.free_blocks(removed)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_id: int,
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
    ) -> list[KVCacheBlock]:
        """Longest hit whose last `cdiv(W - 1, block_size)` blocks are cached; earlier slots are null.

        A hit of k blocks means the next token is at position k*block_size; it needs keys from the
        W - 1 positions before it, i.e. the last cdiv(W - 1, block_size) blocks. The search runs from
        the right so the longest such run wins; a run that starts at block 0 may be shorter.
        """
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        bs = kv_cache_spec.block_size
        needed = cdiv(kv_cache_spec.sliding_window - 1, bs)
        max_blocks = min(max_length // bs, len(block_hashes))
        hits = [block_pool.null_block] * max_blocks
        if needed == 0:
            return hits
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            block = block_pool.get_cached_block(block_hashes[i], group_id)
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run >= needed:
                return hits[: i + run]
        # No full window anywhere: only a run that starts at block 0 is usable (it needs no more).
        return hits[:run]


def manager_for_spec(kv_cache_spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> SingleTypeKVCacheManager:
    if isinstance(kv_cache_spec, SlidingWindowSpec):
        return SlidingWindowManager(kv_cache_spec, block_pool, group_id)
    if isinstance(kv_cache_spec, FullAttentionSpec):
        return FullAttentionManager(kv_cache_spec, block_pool, group_id)
    raise TypeError(f"no KV-cache manager for spec type {type(kv_cache_spec).__name__}")
