"""KVCacheManager: the scheduler's one door to the KV cache (vLLM V1 semantics).

The scheduler asks `get_computed_blocks` for a waiting request's prefix-cache hit, then
`allocate_slots` for the blocks its scheduled tokens need; `free` gives a finished or preempted
request's blocks back. Block ids are handed out per KV-cache group from one shared pool.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from kvcore.kv_cache.block_pool import BlockPool
from kvcore.kv_cache.coordinator import GroupBlocks, KVCacheCoordinator
from kvcore.kv_cache.hashing import update_request_block_hashes
from kvcore.kv_cache.single_type_manager import FullAttentionManager
from kvcore.request import Request
from kvcore.spec import KVCacheConfig


@dataclass(slots=True)
class KVCacheBlocks:
    """Blocks per KV-cache group. Always truthy: `None`, not an empty value, means "does not fit"."""

    blocks: GroupBlocks

    def get_block_ids(self) -> tuple[list[int], ...]:
        blocks = self.blocks
        if len(blocks) == 1:  # the common single-group layout: skip the outer comprehension
            return ([b.block_id for b in blocks[0]],)
        return tuple([[b.block_id for b in group] for group in blocks])

    @property
    def num_blocks(self) -> int:
        return sum(len(group) for group in self.blocks)

    def __add__(self, other: "KVCacheBlocks") -> "KVCacheBlocks":
        return KVCacheBlocks(tuple([*a, *b] for a, b in zip(self.blocks, other.blocks, strict=True)))


def empty_kv_cache_blocks(num_groups: int) -> KVCacheBlocks:
    """ "No blocks" for every group (e.g. a request with no prefix-cache hit)."""
    return KVCacheBlocks(tuple([] for _ in range(num_groups)))


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since creation (or the last reset), counted in tokens, once per admission.

    A request resumed after preemption mostly hits its own blocks; as in vLLM its lookups are kept
    apart (preempted_*) so that they do not inflate the hit rate.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, enable_caching: bool = True) -> None:
        if max_model_len < 1:
            raise ValueError(f"KVCacheManager: max_model_len={max_model_len} must be >= 1")
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching)
        self.coordinator = KVCacheCoordinator(kv_cache_config, self.block_pool)
        self.block_size = self.coordinator.block_size
        self.num_groups = self.coordinator.num_groups
        self.prefix_cache_stats = PrefixCacheStats()
        # Group 0's rows: "holds a row" = running, the test allocate_slots makes for every decode.
        self._rows_of_group0 = self.coordinator.managers[0].req_to_blocks
        coord = self.coordinator
        self._extend_running = coord.extend_single_full if coord.single_full is not None else coord.extend_running
        # The coordinator's shared "nothing new" answer, and one KVCacheBlocks wrapping it: it holds
        # empty tuples, so sharing it cannot leak blocks between callers.
        self._no_blocks = coord._no_blocks
        self._no_new_blocks = KVCacheBlocks(coord._no_blocks)
        # With one full-attention group and caching on: each running request's count of blocks registered
        # in the prefix cache (read-only for callers). The scheduler reads it to skip a call that could
        # only register a block whose tokens are not all known yet (async: the last one is in flight).
        self.num_cached_blocks: dict[str, int] | None = (
            coord.single_full.num_cached_block if coord.single_full is not None and enable_caching else None
        )

    @property
    def empty_kv_cache_blocks(self) -> KVCacheBlocks:
        return empty_kv_cache_blocks(self.num_groups)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) held by requests."""
        return self.block_pool.usage

    # ---- prefix cache -------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The request's prefix-cache hit and its length in tokens. Takes no references.

        The last token is never counted as computed: the model must run at least one token to produce
        the next token's logits, so the hit covers at most num_tokens - 1 tokens, in whole blocks.
        A lookup is only counted in `prefix_cache_stats` when allocate_slots admits the request with
        its blocks: a request that did not fit looks again next step, and is still one query.
        """
        if not self.enable_caching:
            return self.empty_kv_cache_blocks, 0
        if request.sampling_params is not None and request.sampling_params.prompt_logprobs is not None:
            # As vLLM: every prompt position must be computed to score it (its blocks are still cached).
            return self.empty_kv_cache_blocks, 0
        update_request_block_hashes(request, self.block_size)
        blocks, num_hit_tokens = self.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        return KVCacheBlocks(blocks), num_hit_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content; False (and nothing done) while any request holds blocks."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats = PrefixCacheStats()
        return True

    # ---- allocation ---------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """Blocks for `num_new_tokens` more tokens (after the new prefix-cache hit, if any).

        Returns only the newly allocated blocks per group, or None when the pool cannot hold them, in
        which case nothing at all has changed. On success it also registers the full blocks these
        tokens complete in the prefix cache, so a request admitted later (even in the same step) hits,
        and counts the lookup that `new_computed_blocks` came from (the request is admitted now).
        """
        if (
            new_computed_blocks is None
            and not num_new_computed_tokens
            and num_new_tokens > 0
            and request.request_id in self._rows_of_group0
        ):
            # A running request grows (decode or next prefill chunk): the fused hot path.
            num_tokens = request.num_computed_tokens + num_new_tokens
            num_known = len(request.all_token_ids)
            max_len = self.max_model_len
            new_blocks = self._extend_running(
                request,
                num_tokens if num_tokens < max_len else max_len,
                (num_tokens if num_tokens < num_known else num_known) if self.enable_caching else 0,
            )
            if new_blocks is self._no_blocks:
                return self._no_new_blocks  # most decode calls only register a filled block
            return None if new_blocks is None else KVCacheBlocks(new_blocks)
        new_blocks = self._allocate_general(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks)
        if new_blocks is None:
            return None
        if self.enable_caching:
            num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
            update_request_block_hashes(request, self.block_size)
            self.coordinator.cache_blocks(request, min(num_tokens, request.num_tokens))
            if new_computed_blocks is not None:
                self.prefix_cache_stats.record(
                    request.num_tokens, num_new_computed_tokens, preempted=request.num_preemptions > 0
                )
        return KVCacheBlocks(new_blocks)

    def _allocate_general(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
    ) -> GroupBlocks | None:
        """A request that (re)starts, possibly with prefix-cache hits; the reference path."""
        rid = request.request_id
        hit_blocks = self._check_allocate_args(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(num_computed + num_new_tokens, self.max_model_len)
        coord = self.coordinator
        # Plan before touching anything: blocks the window lets go of count as free, hit blocks
        # that sit in the free queue count as taken (each exactly once).
        need = coord.get_num_blocks_to_allocate(rid, num_tokens_need_slot, hit_blocks)
        available = self.block_pool.num_free_blocks + coord.num_blocks_freed_by_skipping(
            rid, request.num_computed_tokens
        )
        if need > available:
            return None
        coord.remove_skipped_blocks(rid, request.num_computed_tokens)
        # Hits are referenced before any allocation, so popping the free queue can never evict
        # a block this very request is about to use.
        if self.enable_caching:
            for group in hit_blocks:
                self.block_pool.touch(group)
        coord.save_new_computed_blocks(rid, hit_blocks)
        return coord.allocate_new_blocks(rid, num_tokens_need_slot)

    def _check_allocate_args(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
    ) -> GroupBlocks:
        rid = request.request_id
        if num_new_tokens < 1:
            raise ValueError(f"allocate_slots({rid!r}): num_new_tokens={num_new_tokens} must be >= 1")
        if num_new_computed_tokens < 0:
            raise ValueError(f"allocate_slots({rid!r}): num_new_computed_tokens={num_new_computed_tokens} must be >= 0")
        if new_computed_blocks is None:
            if num_new_computed_tokens:
                raise ValueError(
                    f"allocate_slots({rid!r}): num_new_computed_tokens={num_new_computed_tokens} "
                    f"needs the new_computed_blocks that hold them"
                )
            return tuple([] for _ in range(self.num_groups))
        hit = new_computed_blocks.blocks
        if len(hit) != self.num_groups:
            raise ValueError(
                f"allocate_slots({rid!r}): new_computed_blocks has {len(hit)} groups, "
                f"the KV cache has {self.num_groups}"
            )
        if not self.enable_caching and any(hit):
            raise ValueError(f"allocate_slots({rid!r}): new_computed_blocks given with prefix caching disabled")
        for gid, group in enumerate(hit):
            if len(group) * self.block_size != num_new_computed_tokens:
                raise ValueError(
                    f"allocate_slots({rid!r}): num_new_computed_tokens={num_new_computed_tokens} "
                    f"!= {len(group)} hit blocks x block_size {self.block_size} (group {gid})"
                )
        if any(hit) and self.coordinator.has_request(rid):
            raise ValueError(
                f"allocate_slots({rid!r}): prefix-cache hits are only allowed for a request "
                f"that holds no blocks (new or resumed)"
            )
        hashes = update_request_block_hashes(request, self.block_size) if any(hit) else []
        for gid, group in enumerate(hit):
            for i, block in enumerate(group):
                # A hit is only valid until the next allocation could evict it; catch a stale one here
                # rather than let the request read another prefix's KV.
                if not block.is_null and (i >= len(hashes) or block.block_hash != (hashes[i], gid)):
                    raise ValueError(
                        f"allocate_slots({rid!r}): new_computed_blocks are stale (block "
                        f"{block.block_id} was evicted since get_computed_blocks); look them up again"
                    )
        return hit

    def free(self, request: Request | str) -> None:
        """Give the request's blocks back, tail first (its chain's last blocks are evicted first)."""
        self.coordinator.free(request if isinstance(request, str) else request.request_id)

    # ---- views ----------------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(list(g) for g in self.coordinator.get_blocks(request_id)))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in g] for g in self.coordinator.get_blocks(request_id))

    def pool_accounting(self) -> dict[str, int]:
        """The pool's books: free_uncached + cached_free + held == usable_blocks, and the refs held."""
        pool = self.block_pool
        free = pool.free_block_queue.get_all_free_blocks()
        cached_free = sum(1 for b in free if b.block_hash is not None)
        held = [b for b in pool.blocks[1:] if b.ref_cnt > 0]
        return {
            "usable_blocks": pool.num_blocks - 1,
            "free_uncached": len(free) - cached_free,
            "cached_free": cached_free,
            "held": len(held),
            "ref_count_total": sum(b.ref_cnt for b in held),
        }

    def check_invariants(self, live_requests: Iterable[Request | str]) -> None:
        """Raise AssertionError naming the first inconsistency between rows, ref counts and the free queue.

        `live_requests` are the requests allowed to hold blocks (running ones); a row of any other
        request is a leak.
        """
        live = {r if isinstance(r, str) else r.request_id for r in live_requests}
        expected_refs = _check_rows(self, live)
        _check_blocks(self.block_pool, expected_refs)


def _check_rows(manager: KVCacheManager, live: set[str]) -> Counter:
    """Rows belong to live requests, full-attention rows hold no null block, and no block id is held
    by two groups; returns how many rows hold each block id."""
    refs: Counter = Counter()
    owner_group: dict[int, int] = {}
    for gid, m in enumerate(manager.coordinator.managers):
        for rid, row in m.req_to_blocks.items():
            assert rid in live, f"request {rid!r} holds blocks in group {gid} but is not live (leak)"
            assert m.num_cached_block.get(rid, 0) <= len(row), (
                f"request {rid!r}: {m.num_cached_block.get(rid)} cached blocks > row length {len(row)}"
            )
            for block in row:
                if block.is_null:
                    assert not isinstance(m, FullAttentionManager), (
                        f"request {rid!r}: null block in full-attention group {gid}"
                    )
                    continue
                other = owner_group.setdefault(block.block_id, gid)
                assert other == gid, f"block {block.block_id} is held by groups {other} and {gid} at once"
                refs[block.block_id] += 1
    return refs


def _check_blocks(pool: BlockPool, expected_refs: Counter) -> None:
    """Ref counts match the rows; the free queue holds exactly the ref-0 blocks, linked both ways,
    unhashed ones before hashed ones; the hash map and the blocks' hashes agree."""
    null = pool.null_block
    assert null.ref_cnt == 0 and not null.in_free_queue and null.block_hash is None, (
        f"null block 0 was touched: {null!r}, in free queue={null.in_free_queue}"
    )
    for block in pool.blocks[1:]:
        want = expected_refs.get(block.block_id, 0)
        assert block.ref_cnt == want, f"block {block.block_id}: ref_cnt {block.ref_cnt} != {want} rows holding it"
        assert block.in_free_queue == (want == 0), (
            f"block {block.block_id}: ref_cnt {want} but in_free_queue={block.in_free_queue}"
        )
    queue = pool.free_block_queue.get_all_free_blocks()
    assert len(queue) == pool.num_free_blocks, (
        f"free queue walks {len(queue)} blocks, counter says {pool.num_free_blocks}"
    )
    assert len({b.block_id for b in queue}) == len(queue), "a block appears twice in the free queue"
    prev = pool.free_block_queue._head
    seen_hashed = False
    for block in queue:
        assert block.prev_free_block is prev, f"free queue: block {block.block_id} has a stale prev link"
        prev = block
        if block.block_hash is not None:
            seen_hashed = True
        assert not (seen_hashed and block.block_hash is None), (
            f"free queue: unhashed block {block.block_id} sits behind a cached block (would be reused later)"
        )
    assert used_blocks(pool) + pool.num_free_blocks == pool.num_blocks - 1, "free + used != usable blocks"
    for key, blocks in pool.cached_block_hash_to_block.items():
        assert blocks, f"empty entry for hash {key[0][:4].hex()} left in the prefix-cache map"
        for bid, block in blocks.items():
            assert block.block_id == bid and block.block_hash == key, f"block {bid} is mapped under a hash it lacks"
    num_mapped = sum(len(v) for v in pool.cached_block_hash_to_block.values())
    num_hashed = sum(1 for b in pool.blocks if b.block_hash is not None)
    assert num_mapped == num_hashed, f"{num_hashed} blocks carry a hash but {num_mapped} are in the map"


def used_blocks(pool: BlockPool) -> int:
    return sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
