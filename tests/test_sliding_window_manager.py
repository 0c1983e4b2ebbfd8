"""Sliding-window groups: dropping blocks behind the window (null-padded, position-aligned rows), the
live-block bound during a long decode, sliding-window prefix hits, and the hybrid full + sliding
coordinator agreeing on one hit length over one shared pool."""

import pytest
import torch

from kvcore import Request, SamplingParams
from kvcore.kv_cache.block_pool import BlockPool
from kvcore.kv_cache.hashing import update_request_block_hashes
from kvcore.kv_cache.single_type_manager import SlidingWindowManager, cdiv
from kvcore.kv_cache_manager import KVCacheManager
from kvcore.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

BS = 16


def swa_spec(window, block_size=BS):
    return SlidingWindowSpec(block_size, 2, 8, torch.float32, sliding_window=window)


def swa_config(num_blocks, window):
    return KVCacheConfig(num_blocks, [KVCacheGroupSpec(["l0"], swa_spec(window))])


def hybrid_config(num_blocks, window):
    full = FullAttentionSpec(BS, 2, 8, torch.float32)
    return KVCacheConfig(num_blocks, [KVCacheGroupSpec(["f0"], full), KVCacheGroupSpec(["s0"], swa_spec(window))])


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=1000))


def snapshot(m, r):
    pool = m.block_pool
    return (
        [(b.ref_cnt, b.block_hash, b.in_free_queue) for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue],
        m.get_block_ids(r.request_id),
        r.num_computed_tokens,
        list(r.block_hashes),
    )


def test_blocks_behind_the_window_become_null_and_return_to_the_pool():
    m = KVCacheManager(swa_config(4, window=16), max_model_len=1024)  # usable 1..3
    r = req("r", range(48))
    assert m.allocate_slots(r, 48).get_block_ids() == ([1, 2, 3],)
    r.num_computed_tokens = 48
    r.append_output_token_ids(48)
    # The token at position 48 sees keys 33..48: blocks 0 and 1 are behind the window. They are freed
    # before allocating, so the full pool still serves the new block, reusing the least recent one.
    assert m.allocate_slots(r, 1).get_block_ids() == ([2],)
    assert m.get_block_ids("r") == ([0, 0, 3, 2],)
    assert [b.block_id for b in m.block_pool.free_block_queue] == [1]
    assert m.block_pool.blocks[1].block_hash is not None  # a freed full block stays cached
    m.check_invariants([r])


def test_allocate_none_does_not_drop_skipped_blocks():
    m = KVCacheManager(swa_config(4, window=16), max_model_len=1024)
    r = req("r", range(80))
    assert m.allocate_slots(r, 40).get_block_ids() == ([1, 2, 3],)  # first prefill chunk
    r.num_computed_tokens = 40
    before = snapshot(m, r)
    # The next chunk needs 2 new blocks; dropping block 0 (behind position 40's window) frees only 1.
    assert m.allocate_slots(r, 40) is None
    assert snapshot(m, r) == before
    assert m.get_block_ids("r") == ([1, 2, 3],)


@pytest.mark.parametrize("window,prompt_len", [(40, 20), (16, 5), (33, 64), (100, 7)])
def test_live_blocks_stay_bounded_during_a_long_decode(window, prompt_len):
    bound = cdiv(window - 1, BS) + 1  # W consecutive positions touch at most this many blocks
    m = KVCacheManager(swa_config(bound + 2, window), max_model_len=4096)  # far fewer than the decode needs
    r = req("r", range(prompt_len))
    assert m.allocate_slots(r, prompt_len) is not None
    r.num_computed_tokens = prompt_len
    seen_max = 0
    for step in range(300):
        r.append_output_token_ids(step % 50)
        assert m.allocate_slots(r, 1) is not None, f"decode step {step} ran out of blocks"
        row = m.get_block_ids("r")[0]
        n = r.num_computed_tokens  # the position being computed
        assert len(row) == cdiv(n + 1, BS)  # index i still covers positions [i*BS, (i+1)*BS)
        live = [i for i, b in enumerate(row) if b != 0]
        assert live == list(range(len(row) - len(live), len(row)))  # nulls only in front
        assert live[0] <= max(0, n - window + 1) // BS  # every key the query needs is live
        assert len(live) <= bound
        seen_max = max(seen_max, len(live))
        m.check_invariants([r])
        r.num_computed_tokens += 1
    assert seen_max == min(bound, cdiv(prompt_len + 300, BS))
    m.free(r)
    m.check_invariants([])
    assert m.usage == 0.0


def _cached_pool(hit_indices, num_hashes, bs=4):
    pool = BlockPool(16)
    r = req("a", range(num_hashes * bs))
    update_request_block_hashes(r, bs)
    blocks = pool.get_new_blocks(num_hashes)
    pool.cache_full_blocks(r, blocks, 0, num_hashes, group_id=0)
    for i, b in enumerate(blocks):
        if i not in hit_indices:  # evict: drop it from the cache map
            pool.evict_cached_block(b)
    pool.free_blocks(reversed(blocks))
    return pool, r.block_hashes, blocks


@pytest.mark.parametrize(
    "cached,max_len,expect",
    [
        ({0, 1, 3, 4}, 24, [None, None, None, 3, 4]),  # rightmost run of 2 wins; earlier slots are null
        ({0, 1, 3, 4}, 16, [0, 1]),  # capped at 4 blocks: the run 0..1 ends at 2 blocks
        ({0, 1, 2, 3, 4, 5}, 23, [None, None, None, 3, 4]),  # max length rounds down to whole blocks
        ({0}, 24, [0]),  # no full window anywhere: a run from block 0 still works
        ({2, 5}, 24, []),  # isolated blocks: no hit
    ],
)
def test_sliding_window_longest_hit(cached, max_len, expect):
    spec = swa_spec(9, block_size=4)  # the next token needs the 8 keys before it: 2 blocks
    pool, hashes, blocks = _cached_pool(cached, 6)
    got = SlidingWindowManager.find_longest_cache_hit(hashes, max_len, 0, pool, spec)
    assert [None if b.is_null else blocks.index(b) for b in got] == expect


def test_sliding_window_request_hits_with_null_padding():
    m = KVCacheManager(swa_config(20, window=20), max_model_len=1024)
    a = req("a", range(80))
    assert m.allocate_slots(a, 80).get_block_ids() == ([1, 2, 3, 4, 5],)
    b = req("b", list(range(80)) + [7, 7, 7, 7, 7])
    hit, n = m.get_computed_blocks(b)
    assert n == 80 and hit.get_block_ids() == ([0, 0, 0, 4, 5],)  # only the window's 2 blocks needed
    assert m.allocate_slots(b, 5, n, hit).get_block_ids() == ([6],)
    assert m.get_block_ids("b") == ([0, 0, 0, 4, 5, 6],)
    assert [m.block_pool.blocks[i].ref_cnt for i in range(1, 7)] == [1, 1, 1, 2, 2, 1]
    m.check_invariants([a, b])


def _cache_group(m, tokens, gid, keep):
    """Put `tokens`' full blocks in group `gid`'s cache, then evict those not in `keep` (by index)."""
    pool = m.block_pool
    r = req("seed", tokens)
    update_request_block_hashes(r, BS)
    n = len(r.block_hashes)
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(r, blocks, 0, n, group_id=gid)
    for i, b in enumerate(blocks):
        if i not in keep:
            pool.evict_cached_block(b)
    pool.free_blocks(reversed(blocks))
    return blocks


def test_hybrid_groups_agree_on_one_hit_length():
    m = KVCacheManager(hybrid_config(30, window=32), max_model_len=1024)  # window needs 2 blocks
    prompt = list(range(96))
    full = _cache_group(m, prompt, gid=0, keep=set(range(6)))  # ids 1..6, all cached
    swa = _cache_group(m, prompt, gid=1, keep={0, 1, 2, 4})  # ids 7..12, blocks 3 and 5 evicted
    b = req("b", prompt + [1])
    hit, n = m.get_computed_blocks(b)
    # Full attention alone would hit 96 tokens; the window at 96 needs blocks 4, 5 (5 is gone), its
    # longest hit is 48 (blocks 1, 2); full attention then agrees at 48.
    assert n == 48
    assert hit.get_block_ids() == (
        [full[0].block_id, full[1].block_id, full[2].block_id],
        [0, swa[1].block_id, swa[2].block_id],
    )
    new = m.allocate_slots(b, b.num_tokens - n, n, hit)
    row_full, row_swa = m.get_block_ids("b")
    assert len(row_full) == len(row_swa) == cdiv(b.num_tokens, BS)  # rows stay position-aligned
    assert set(row_full).isdisjoint(set(row_swa) - {0})  # one pool, no id in two groups
    assert [len(g) for g in new.get_block_ids()] == [4, 4]
    m.check_invariants([b])


def test_hybrid_groups_share_one_pool_and_never_share_block_ids():
    m = KVCacheManager(hybrid_config(17, window=32), max_model_len=1024)  # usable 1..16
    a = req("a", range(100))
    assert m.allocate_slots(a, 64).get_block_ids() == ([1, 2, 3, 4], [5, 6, 7, 8])
    a.num_computed_tokens = 64
    # Position 64 sees keys from 33: the window group drops blocks 0 and 1 (ids 5, 6) first.
    assert m.allocate_slots(a, 36).get_block_ids() == ([9, 10, 11], [12, 13, 14])
    assert m.get_block_ids("a") == ([1, 2, 3, 4, 9, 10, 11], [0, 0, 7, 8, 12, 13, 14])
    a.num_computed_tokens = 100
    c = req("c", range(500, 517))  # 2 blocks per group: takes 15, 16, then the dropped 6, 5
    assert m.allocate_slots(c, 17).get_block_ids() == ([15, 16], [6, 5])
    m.check_invariants([a, c])
    # b shares a's first 48 tokens: full attention has them, but the window group lost block 1 (id 6),
    # so no window-complete hit exists at 48 or 32 tokens: the groups agree on no hit at all.
    b = req("b", list(range(48)) + [999])
    hit, n = m.get_computed_blocks(b)
    assert n == 0 and hit.get_block_ids() == ([], [])
    # A prompt sharing 64 tokens hits in both groups: the window's blocks 2, 3 (ids 7, 8) are alive.
    d = req("d", list(range(64)) + [999])
    hit, n = m.get_computed_blocks(d)
    assert n == 64 and hit.get_block_ids() == ([1, 2, 3, 4], [0, 0, 7, 8])
    assert m.allocate_slots(d, 1, n, hit) is None  # 1 new block per group, the pool is empty
    m.free(c)
    assert m.allocate_slots(d, 1, n, hit).get_block_ids() == ([5], [16])  # unhashed ones first
    m.check_invariants([a, d])
    for r in (a, d):
        m.free(r)
    m.check_invariants([])
    assert m.block_pool.num_free_blocks == 16
