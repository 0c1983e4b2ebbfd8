"""BlockPool, free queue and block hashing: allocation order, the null block, ref counts, O(1) queue
operations, lazy LRU eviction of cached blocks, and reuse of unhashed blocks before cached ones."""

import pytest

from kvcore import Request, SamplingParams
from kvcore.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from kvcore.kv_cache.hashing import compute_block_hashes, hash_block_tokens, update_request_block_hashes


def ids(blocks):
    return [b.block_id for b in blocks]


def queue_ids(pool):
    return ids(pool.free_block_queue)


def hashed_request(rid, tokens, block_size=4):
    req = Request(rid, tokens, SamplingParams())
    update_request_block_hashes(req, block_size)
    return req


# ---- hashing ----------------------------------------------------------------------------------
def test_block_hashes_are_chained_and_deterministic():
    a = compute_block_hashes(list(range(12)), 4)
    assert len(a) == 3
    assert a == compute_block_hashes(list(range(12)), 4)
    assert a[1] == hash_block_tokens(a[0], [4, 5, 6, 7])
    # Same tokens in block 1 but a different block 0: the chain makes block 1's hash differ too.
    b = compute_block_hashes([9, 1, 2, 3] + list(range(4, 12)), 4)
    assert b[0] != a[0] and b[1] != a[1] and b[2] != a[2]
    # A trailing partial block has no hash.
    assert compute_block_hashes(list(range(11)), 4) == a[:2]


def test_request_block_hashes_extend_incrementally_over_output_tokens():
    req = Request("r", list(range(6)), SamplingParams())
    update_request_block_hashes(req, 4)
    assert len(req.block_hashes) == 1
    first = req.block_hashes[0]
    req.append_output_token_ids([6, 7, 8])
    update_request_block_hashes(req, 4)
    assert req.block_hashes[0] is first  # earlier hashes are kept, not recomputed
    assert req.block_hashes == compute_block_hashes(list(range(9)), 4)
    with pytest.raises(ValueError, match="block_size"):
        update_request_block_hashes(req, 0)


# ---- free queue -------------------------------------------------------------------------------
def test_free_queue_o1_remove_append_popleft():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert len(q) == 5 and ids(q) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])  # from the middle, by reference: neighbours are relinked directly
    assert ids(q) == [0, 1, 3, 4] and len(q) == 4
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    assert blocks[1].next_free_block is blocks[3] and blocks[3].prev_free_block is blocks[1]
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert ids(q) == [1, 3]
    q.append(blocks[2])
    q.appendleft(blocks[4])
    assert ids(q) == [4, 1, 3, 2]
    assert q.popleft() is blocks[4]
    assert ids(q.popleft_n(2)) == [1, 3]
    assert ids(q) == [2] and len(q) == 1


def test_free_queue_rejects_misuse():
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[0])
    q.remove(blocks[0])
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[0])
    with pytest.raises(ValueError, match="exceeds"):
        q.popleft_n(2)
    q.popleft()
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()


# ---- pool -------------------------------------------------------------------------------------
def test_fresh_pool_hands_out_ids_in_order_and_never_the_null_block():
    pool = BlockPool(6)
    assert pool.num_free_blocks == 5 and pool.usage == 0.0
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    assert ids(pool.get_new_blocks(2)) == [4, 5]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    # Freeing or touching the null block is a no-op: it never enters the queue, its count never moves.
    pool.free_blocks([pool.null_block])
    pool.touch([pool.null_block])
    assert pool.null_block.ref_cnt == 0 and not pool.null_block.in_free_queue
    assert 0 not in queue_ids(pool)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


def test_ref_counts_touch_and_free():
    pool = BlockPool(5)
    b1, b2 = pool.get_new_blocks(2)
    assert (b1.ref_cnt, b2.ref_cnt) == (1, 1)
    pool.touch([b1])  # a second request shares b1
    assert b1.ref_cnt == 2
    pool.free_blocks([b1])
    assert b1.ref_cnt == 1 and not b1.in_free_queue  # still held by one request
    pool.free_blocks([b2, b1])
    assert b1.ref_cnt == 0 and b2.ref_cnt == 0
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="already free"):
        pool.free_blocks([b1])
    # Touching a free block (a prefix-cache hit) takes it out of the queue in O(1).
    pool.touch([b2])
    assert b2.ref_cnt == 1 and not b2.in_free_queue and pool.num_free_blocks == 3


def test_unhashed_freed_blocks_are_reused_before_cached_ones_and_lru_among_cached():
    bs = 4
    pool = BlockPool(8)
    req = hashed_request("a", list(range(8)), bs)
    a = pool.get_new_blocks(3)  # ids 1, 2, 3: two full blocks (cached) and a partial one
    pool.cache_full_blocks(req, a, 0, 2, group_id=0)
    other = hashed_request("b", list(range(100, 104)), bs)
    b = pool.get_new_blocks(2)  # ids 4, 5: block 4 is cached, block 5 is not
    pool.cache_full_blocks(other, b, 0, 1, group_id=0)
    pool.free_blocks(reversed(a))  # tail first: 3 (unhashed) -> head; 2 then 1 -> tail
    pool.free_blocks(reversed(b))  # 5 (unhashed) -> head; 4 -> tail, after 2 and 1
    assert queue_ids(pool) == [5, 3, 6, 7, 2, 1, 4]
    assert pool.get_cached_block(req.block_hashes[0], 0) is a[0]  # freed but still cached
    # Reuse order: unhashed first (freed ones, then never-used ones), then the least recently freed
    # cached block, the tail of a's chain before its head.
    got = pool.get_new_blocks(5)
    assert ids(got) == [5, 3, 6, 7, 2]
    # Popping cached block 2 evicted its hash lazily; block 1 (a's first block) is still a hit.
    assert a[1].block_hash is None
    assert pool.get_cached_block(req.block_hashes[1], 0) is None
    assert pool.get_cached_block(req.block_hashes[0], 0) is a[0]
    assert queue_ids(pool) == [1, 4]


def test_cache_map_is_per_group_and_tolerates_duplicate_content():
    pool = BlockPool(6)
    req = hashed_request("a", list(range(4)), 4)
    g0 = pool.get_new_blocks(1)
    g1 = pool.get_new_blocks(1)
    dup = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, g0, 0, 1, group_id=0)
    pool.cache_full_blocks(req, g1, 0, 1, group_id=1)
    pool.cache_full_blocks(req, dup, 0, 1, group_id=0)  # same content computed twice
    h = req.block_hashes[0]
    assert pool.get_cached_block(h, 1) is g1[0]
    assert pool.get_cached_block(h, 0) in (g0[0], dup[0])
    pool.free_blocks(g0 + dup)
    assert ids(pool.get_new_blocks(3)) == [4, 5, 1]  # unhashed 4, 5, then cached 1 (oldest), evicted
    assert pool.get_cached_block(h, 0) is dup[0]  # the duplicate keeps the content findable
    assert pool.get_cached_block(h, 2) is None


def test_cache_full_blocks_needs_hashes_and_skips_null():
    pool = BlockPool(4)
    req = hashed_request("a", list(range(5)), 4)  # one full block
    blocks = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="block hashes"):
        pool.cache_full_blocks(req, blocks, 0, 2, group_id=0)
    pool.cache_full_blocks(req, [pool.null_block], 0, 1, group_id=0)
    assert pool.null_block.block_hash is None and not pool.cached_block_hash_to_block


def test_reset_prefix_cache_refused_while_blocks_are_held():
    pool = BlockPool(4)
    req = hashed_request("a", list(range(8)), 4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, group_id=0)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(req.block_hashes[0], 0) is blocks[0]
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(req.block_hashes[0], 0) is None
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.num_free_blocks == 3


def test_cache_events_name_what_became_findable_and_what_was_evicted():
    from kvcore.kv_cache.block_pool import CacheEvents, event_key

    pool = BlockPool(6)
    assert pool.take_cache_events() is None  # off until enabled
    pool.enable_cache_events()
    assert pool.take_cache_events() == CacheEvents(reset=True)  # the first take: the whole (empty) cache
    assert pool.take_cache_events() is None  # nothing changed since
    req = hashed_request("a", list(range(8)), 4)
    keys = [event_key(h) for h in req.block_hashes]
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, a, 0, 2, group_id=0)
    dup = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, dup, 0, 1, group_id=0)  # the same prefix twice: no new event
    g1 = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, g1, 0, 1, group_id=1)  # another group's copy: not published
    assert pool.take_cache_events() == CacheEvents(stored=keys)
    pool.free_blocks(reversed(a))
    pool.free_blocks(dup)
    pool.get_new_blocks(2)  # the never-used block 5, then cached block 2 (a's second): evicted
    assert pool.take_cache_events() == CacheEvents(removed=[keys[1]])  # block 1 still findable via dup
    pool.free_blocks(g1)
    pool.get_new_blocks(3)  # 4 (g1's group-1 copy), then 1 and 3: the first prefix is gone too
    assert pool.take_cache_events() == CacheEvents(removed=[keys[0]])
    assert pool.cached_event_keys() == []
