"""The block pool: KV-cache blocks, their free queue, and the prefix-cache map.

Every block id in [0, num_blocks) exists once. Block 0 is the null block: it pads sliding-window rows
and is never handed out, freed or cached. A block with ref_cnt 0 sits in the free queue; if it still
carries a block hash it stays findable in the prefix cache until it is popped for reuse, at which
point its hash entry is dropped (lazy eviction).

Free-queue order decides what is reused first:
  head: unhashed blocks (freed partial blocks, then never-used blocks in id order)
  tail: cached (hashed) blocks, least recently freed first (LRU eviction from the head side).
A freed unhashed block is put at the head, a freed hashed block at the tail, so holding no
prefix-cache content is always reused before evicting any.

Cache events (off until `enable_cache_events`): which prefixes became findable in the prefix cache and
which stopped being findable, for a router outside the engine that sends a request to the replica
holding its prefix (cluster/serve/kv_index.py). They name group 0's blocks (every group caches the same
prefixes) by `event_key`, 8 bytes of the chained hash: an index of what an engine holds, not a cache key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from kvcore.kv_cache.hashing import BlockHash
from kvcore.request import Request

# A cached block is keyed by its chained hash and its KV-cache group: the same tokens in two groups
# are two different blocks of KV.
BlockHashKey = tuple[BlockHash, int]


def event_key(block_hash: BlockHash) -> int:
    """A cached prefix's name in cache events: the first 8 bytes of its chained hash, as an int."""
    return int.from_bytes(block_hash[:8], "little")


@dataclass
class CacheEvents:
    """Changes of the prefix cache since the last take: keys (event_key) now findable, keys no longer
    findable. `reset`: the receiver forgets what it knew first (`stored` is then the whole cache)."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    reset: bool = False


class KVCacheBlock:
    """One block id's metadata; prev/next link it into the free queue while ref_cnt is 0."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHashKey | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    @property
    def in_free_queue(self) -> bool:
        # The queue has sentinels at both ends, so a queued block always has both neighbours.
        return self.prev_free_block is not None

    def __repr__(self) -> str:
        h = None if self.block_hash is None else self.block_hash[0][:4].hex()
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Intrusive doubly linked list of free blocks: O(1) popleft, append, appendleft and remove.

    Built on the blocks' own prev/next fields (no per-node allocation), with two sentinel blocks so
    every operation is branch-free at the ends.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-2)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is None or block is self._tail:
            raise ValueError("FreeKVCacheBlockQueue.popleft: no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"FreeKVCacheBlockQueue.popleft_n: n={n} exceeds {self.num_free_blocks} free blocks")
        # Unlink the first n blocks as one run: one splice instead of n removals (allocation hot path).
        head = self._head
        out: list[KVCacheBlock] = []
        block = head.next_free_block
        for _ in range(n):
            # The sentinels guarantee a linked neighbour for every block counted in num_free_blocks.
            assert block is not None
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"FreeKVCacheBlockQueue.remove: block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None  # the tail sentinel always has a predecessor
        self._insert_after(last, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.in_free_queue:
            raise ValueError(f"FreeKVCacheBlockQueue: block {block.block_id} is already in the free queue")
        nxt = prev.next_free_block
        assert nxt is not None  # prev is queued (or the head sentinel), so it has a successor
        block.prev_free_block, block.next_free_block = prev, nxt
        prev.next_free_block = block
        nxt.prev_free_block = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Head to tail, i.e. in reuse order (for tests and invariant checks, O(n))."""
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free_block

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self)


class BlockPool:
    """All KV-cache blocks of one pool, shared by every KV-cache group."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"BlockPool: num_blocks={num_blocks} must be >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        # Block 0 never enters the queue, so a fresh pool hands out 1, 2, 3, ...
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # Several blocks may hold the same content (e.g. two requests that computed the same prefix
        # before either was cached), hence a dict of blocks per key.
        self.cached_block_hash_to_block: dict[BlockHashKey, dict[int, KVCacheBlock]] = {}
        # Cache events since the last take: event key -> findable now (the last change wins). None: off.
        self._changes: dict[int, bool] | None = None
        self._reset = False

    # ---- cache events ----------------------------------------------------------------------------
    def enable_cache_events(self) -> None:
        """Start recording cache events; the first take hands out the whole cache (a reset)."""
        self._changes = {}
        self._reset = True

    def take_cache_events(self) -> CacheEvents | None:
        """The changes since the last take (None: events off, or nothing changed)."""
        changes = self._changes
        if changes is None or not (changes or self._reset):
            return None
        self._changes = {}
        if self._reset:
            self._reset = False
            return CacheEvents(stored=self.cached_event_keys(), reset=True)
        return CacheEvents([k for k, v in changes.items() if v], [k for k, v in changes.items() if not v])

    def cached_event_keys(self) -> list[int]:
        """Every prefix findable now (group 0), by event key."""
        return [event_key(h) for h, gid in self.cached_block_hash_to_block if gid == 0]

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (cached or not): what get_new_blocks can hand out."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable (non-null) blocks held by requests."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash, group_id: int) -> KVCacheBlock | None:
        blocks = self.cached_block_hash_to_block.get((block_hash, group_id))
        if not blocks:
            return None
        return next(iter(blocks.values()))

    # ---- allocation ------------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue, evicting their cached hashes."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(
                f"BlockPool.get_new_blocks: asked for {num_blocks} blocks, only {self.num_free_blocks} free"
            )
        new_blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in new_blocks:
            assert block.ref_cnt == 0, f"block {block.block_id} in the free queue has ref_cnt {block.ref_cnt}"
            if block.block_hash is not None:  # most reused blocks hold no cached content
                self.evict_cached_block(block)
            block.ref_cnt = 1
        return new_blocks

    def evict_cached_block(self, block: KVCacheBlock) -> None:
        """Forget a block's prefix-cache entry (its content is about to change); uncached: nothing."""
        key = block.block_hash
        if key is None:
            return
        same = self.cached_block_hash_to_block.get(key)
        if same is not None:
            same.pop(block.block_id, None)
            if not same:
                del self.cached_block_hash_to_block[key]
                if self._changes is not None and key[1] == 0:
                    self._changes[event_key(key[0])] = False
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit sitting in the free queue leaves it."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 join the free queue in the given order.

        Unhashed blocks go to the head (reused first, they hold nothing worth keeping); hashed blocks
        go to the tail, so the earliest freed cached block is evicted first (LRU).
        """
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"BlockPool.free_blocks: block {block.block_id} is already free")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    # ---- prefix cache ----------------------------------------------------------------------------
    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under the request's chained hashes."""
        if num_cached_blocks >= num_full_blocks:
            return
        hashes = request.block_hashes
        if len(hashes) < num_full_blocks:
            raise ValueError(
                f"cache_full_blocks: request {request.request_id!r} has "
                f"{len(hashes)} block hashes, needs {num_full_blocks}"
            )
        cached = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:  # a sliding-window slot already dropped: nothing to cache
                continue
            key = (hashes[i], group_id)
            if block.block_hash is not None:
                assert block.block_hash == key, f"block {block.block_id} is cached under another hash"
                continue
            block.block_hash = key
            same = cached.get(key)
            if same is None:
                cached[key] = {block.block_id: block}
                if self._changes is not None and group_id == 0:
                    self._changes[event_key(key[0])] = True
            else:
                same[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is held by a request."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self._changes is not None:
            self._changes.clear()
            self._reset = True
        return True
