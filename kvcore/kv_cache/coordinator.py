"""The coordinator: drives one single-type manager per KV-cache group over one shared BlockPool.

It makes multi-group operations all-or-nothing: the number of blocks every group needs is summed
before any group allocates, and a prefix-cache hit is only reported at a length every group can
serve.
"""

from __future__ import annotations

from typing import Sequence

from kvcore.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvcore.kv_cache.hashing import BlockHash, hash_block_tokens, update_request_block_hashes
from kvcore.kv_cache.single_type_manager import FullAttentionManager, SingleTypeKVCacheManager, manager_for_spec
from kvcore.request import Request
from kvcore.spec import KVCacheConfig

GroupBlocks = tuple[Sequence[KVCacheBlock], ...]  # one per group; read-only (the shared "none" is tuples)


class KVCacheCoordinator:
    def __init__(self, kv_cache_config: KVCacheConfig, block_pool: BlockPool) -> None:
        groups = kv_cache_config.kv_cache_groups
        if not groups:
            raise ValueError("KVCacheConfig.kv_cache_groups: must hold at least one group")
        block_sizes = {g.kv_cache_spec.block_size for g in groups}
        if len(block_sizes) != 1:
            # One chain of block hashes per request serves every group only if they share a block size.
            raise ValueError(
                f"KVCacheConfig.kv_cache_groups: all groups must share one block_size, got {sorted(block_sizes)}"
            )
        self.block_size = block_sizes.pop()
        self.block_pool = block_pool
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            manager_for_spec(g.kv_cache_spec, block_pool, gid) for gid, g in enumerate(groups)
        )
        # Shared "nothing new" answer; tuples, so a caller cannot append to it by mistake.
        self._no_blocks: GroupBlocks = tuple(() for _ in self.managers)
        self._sliding = tuple(m for m in self.managers if not isinstance(m, FullAttentionManager))
        # The common layout (one full-attention group) gets a straight-line extend_running.
        self.single_full = self.managers[0] if len(self.managers) == 1 and not self._sliding else None
        # Full attention first: its hit is a plain prefix, the cheapest upper bound for the others.
        self._hit_order = sorted(
            range(len(self.managers)), key=lambda g: not isinstance(self.managers[g], FullAttentionManager)
        )

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    # ---- prefix-cache lookup ------------------------------------------------------------------
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> tuple[GroupBlocks, int]:
        """Hit blocks per group and the hit length in tokens (a multiple of block_size) all groups agree on.

        Each group, in turn, looks for its longest hit no longer than the current candidate length; a
        shorter answer lowers the candidate and the round repeats until a full round changes nothing.
        The length only shrinks, so this ends; at the fixed point every group's hit has that length.
        """
        bs = self.block_size
        length = min(max_length, len(block_hashes) * bs) // bs * bs
        hits: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        while True:
            candidate = length
            for gid in self._hit_order:
                m = self.managers[gid]
                hits[gid] = m.find_longest_cache_hit(block_hashes, candidate, gid, self.block_pool, m.kv_cache_spec)
                candidate = len(hits[gid]) * bs
            if candidate == length:
                break
            length = candidate
        # Groups asked before the last shrink may hold longer lists; full-attention hits are prefixes.
        num_blocks = length // bs
        return tuple(h[:num_blocks] for h in hits), length

    # ---- allocation ---------------------------------------------------------------------------
    def extend_running(self, request: Request, num_tokens: int, num_tokens_to_cache: int) -> GroupBlocks | None:
        """Hot path of a decode step or a next prefill chunk: grow a request that already holds rows
        (and has no new prefix hit) to `num_tokens` tokens in every group, then register the full
        blocks among the first `num_tokens_to_cache` tokens (0 = caching off). None = does not fit,
        nothing changed.

        Same semantics as plan, remove_skipped_blocks, allocate_new_blocks and cache_blocks, fused
        into one pass per group because the scheduler calls it for every running request every step.
        """
        if self.single_full is not None:
            return self.extend_single_full(request, num_tokens, num_tokens_to_cache)
        rid = request.request_id
        bs = self.block_size
        num_blocks = -(-num_tokens // bs)
        need = 0
        for m in self.managers:
            deficit = num_blocks - len(m.req_to_blocks[rid])
            if deficit > 0:
                need += deficit
        free = self.block_pool.free_block_queue.num_free_blocks
        if self._sliding:
            if need > free:
                free += sum(m.num_blocks_freed_by_skipping(rid, request.num_computed_tokens) for m in self._sliding)
            if need > free:
                return None
            for m in self._sliding:
                m.remove_skipped_blocks(rid, request.num_computed_tokens)
        elif need > free:
            return None
        new_blocks = (
            self._no_blocks if need == 0 else tuple(m.allocate_new_blocks(rid, num_tokens) for m in self.managers)
        )
        num_full = num_tokens_to_cache // bs
        for m in self.managers:
            if num_full > m.num_cached_block[rid]:
                if num_full > len(request.block_hashes):
                    update_request_block_hashes(request, bs)
                m.cache_blocks(request, num_tokens_to_cache)
        return new_blocks

    def extend_single_full(self, request: Request, num_tokens: int, num_tokens_to_cache: int) -> GroupBlocks | None:
        """extend_running for one full-attention group: no window to slide, one row to grow.

        A decode step lands here once per block_size tokens to take one block, and once to register
        the block its token just filled, so every call saved here is paid 2/block_size times per request.
        """
        m = self.single_full
        assert m is not None, "extend_single_full is chosen only for one full-attention group"
        rid = request.request_id
        bs = self.block_size
        row = m.req_to_blocks[rid]
        need = -(-num_tokens // bs) - len(row)
        if need > 0:
            pool = self.block_pool
            if need > pool.free_block_queue.num_free_blocks:
                return None
            new = pool.get_new_blocks(need)
            row.extend(new)
            new_blocks: GroupBlocks = (new,)
        else:
            new_blocks = self._no_blocks
        num_full = num_tokens_to_cache // bs
        num_cached = m.num_cached_block[rid]
        if num_full > num_cached:  # what m.cache_blocks does, minus a call and its lookups
            hashes = request.block_hashes
            num_hashed = len(hashes)
            if num_full == num_hashed + 1:
                # A decode just filled one block: hash it here (what update_request_block_hashes would do,
                # without its generic loop; this runs once per block_size tokens for every request).
                start = num_hashed * bs
                hashes.append(
                    hash_block_tokens(hashes[-1] if hashes else None, request.all_token_ids[start : start + bs])
                )
            elif num_full > num_hashed:
                update_request_block_hashes(request, bs)
            self.block_pool.cache_full_blocks(request, row, num_cached, num_full, m.group_id)
            m.num_cached_block[rid] = num_full
        return new_blocks

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: GroupBlocks) -> int:
        return sum(
            m.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[gid])
            for gid, m in enumerate(self.managers)
        )

    def num_blocks_freed_by_skipping(self, request_id: str, num_computed_tokens: int) -> int:
        return sum(m.num_blocks_freed_by_skipping(request_id, num_computed_tokens) for m in self.managers)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: GroupBlocks) -> None:
        for gid, m in enumerate(self.managers):
            m.save_new_computed_blocks(request_id, new_computed_blocks[gid])

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> GroupBlocks:
        return tuple(m.allocate_new_blocks(request_id, num_tokens) for m in self.managers)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        for m in self.managers:
            m.cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def get_blocks(self, request_id: str) -> GroupBlocks:
        return tuple(m.req_to_blocks.get(request_id, []) for m in self.managers)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.managers[0].req_to_blocks
