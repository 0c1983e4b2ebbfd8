"""KVCacheManager with prefix caching: exact hits and block ids, the last prompt token, free order,
the eviction hazard, all-or-nothing allocate_slots, caching disabled, stats, and randomized
operation sequences checked against ref-count invariants and a simulated KV content model."""

import random

import pytest
import torch

from kvcore import Request, SamplingParams
from kvcore.kv_cache_manager import KVCacheBlocks, KVCacheManager, empty_kv_cache_blocks
from kvcore.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

BS = 16


def full_config(num_blocks, block_size=BS):
    spec = FullAttentionSpec(block_size, 2, 8, torch.float32)
    return KVCacheConfig(num_blocks, [KVCacheGroupSpec(["l0", "l1"], spec)])


def hybrid_config(num_blocks, window, block_size=BS):
    full = FullAttentionSpec(block_size, 2, 8, torch.float32)
    swa = SlidingWindowSpec(block_size, 2, 8, torch.float32, sliding_window=window)
    return KVCacheConfig(num_blocks, [KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["l1"], swa)])


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def admit(m, r):
    """What the scheduler does for a waiting request: look up hits, then allocate the rest."""
    hit, n = m.get_computed_blocks(r)
    new = m.allocate_slots(r, r.num_tokens - n, n, hit)
    if new is not None:
        r.num_computed_tokens = r.num_tokens
    return hit, n, new


def free_ids(m):
    return [b.block_id for b in m.block_pool.free_block_queue]


def snapshot(m, requests):
    """Everything allocate_slots could change, in comparable form."""
    pool = m.block_pool
    return (
        [(b.ref_cnt, b.block_hash, b.in_free_queue) for b in pool.blocks],
        free_ids(m),
        {k: sorted(v) for k, v in pool.cached_block_hash_to_block.items()},
        [
            ({r: [b.block_id for b in row] for r, row in sm.req_to_blocks.items()}, dict(sm.num_cached_block))
            for sm in m.coordinator.managers
        ],
        [(r.num_computed_tokens, list(r.block_hashes)) for r in requests],
    )


SHARED = list(range(1000, 1048))  # 3 full blocks


def test_second_request_hits_exactly_the_three_shared_blocks_and_gets_one_new_block():
    m = KVCacheManager(full_config(20), max_model_len=1024)
    a = req("a", SHARED + list(range(10)))  # 58 tokens: blocks 1, 2, 3 full, block 4 partial
    _, n, new = admit(m, a)
    assert n == 0 and new.get_block_ids() == ([1, 2, 3, 4],)
    b = req("b", SHARED + list(range(500, 510)))  # 58 tokens, shares the 48-token prefix only
    hit, n, new = admit(m, b)
    assert n == 48 and hit.get_block_ids() == ([1, 2, 3],)
    assert new.get_block_ids() == ([5],)
    assert m.get_block_ids("b") == ([1, 2, 3, 5],)
    assert [m.block_pool.blocks[i].ref_cnt for i in range(1, 6)] == [2, 2, 2, 1, 1]
    assert (m.prefix_cache_stats.queries, m.prefix_cache_stats.hits) == (116, 48)
    m.check_invariants([a, b])
    m.free(a)
    m.free(b)
    m.check_invariants([])
    assert m.usage == 0.0


def test_full_blocks_are_cached_at_allocation_so_a_same_step_request_hits():
    m = KVCacheManager(full_config(20), max_model_len=1024)
    a = req("a", SHARED + [1])
    new = m.allocate_slots(a, a.num_tokens)  # scheduled, not yet run: num_computed_tokens still 0
    assert new.get_block_ids() == ([1, 2, 3, 4],)
    hit, n = m.get_computed_blocks(req("b", SHARED + [2, 3]))
    assert n == 48 and hit.get_block_ids() == ([1, 2, 3],)


def test_chunked_prefill_caches_only_blocks_the_scheduled_tokens_fill():
    m = KVCacheManager(full_config(20), max_model_len=1024)
    a = req("a", SHARED + [1])
    assert m.allocate_slots(a, 20).get_block_ids() == ([1, 2],)  # block 1 full, block 2 partial
    _, n = m.get_computed_blocks(req("b", SHARED + [2]))
    assert n == 16
    a.num_computed_tokens = 20
    assert m.allocate_slots(a, 29).get_block_ids() == ([3, 4],)
    _, n = m.get_computed_blocks(req("c", SHARED + [2]))
    assert n == 48


def test_output_tokens_fill_blocks_that_get_cached():
    m = KVCacheManager(full_config(20), max_model_len=1024)
    a = req("a", list(range(10)))
    admit(m, a)
    for t in range(10, 17):  # decode: one token per step, each scheduled as one new token
        a.append_output_token_ids(t)
        assert m.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    assert m.get_block_ids("a") == ([1, 2],)
    hit, n = m.get_computed_blocks(req("b", list(range(17)) + [99]))
    assert n == 16 and hit.get_block_ids() == ([1],)


def test_last_prompt_token_is_never_a_hit():
    m = KVCacheManager(full_config(20), max_model_len=1024)
    a = req("a", list(range(32)))  # exactly 2 full blocks
    admit(m, a)
    hit, n = m.get_computed_blocks(req("b", list(range(32))))
    assert n == 16 and hit.get_block_ids() == ([1],)  # the 2nd block holds the last prompt token
    hit, n = m.get_computed_blocks(req("c", list(range(33))))
    assert n == 32 and hit.get_block_ids() == ([1, 2],)
    hit, n = m.get_computed_blocks(req("d", list(range(16))))  # one block: nothing may hit
    assert n == 0 and hit.get_block_ids() == ([],)


def test_freed_request_blocks_reuse_order_unhashed_first_then_lru_tail_first():
    m = KVCacheManager(full_config(8), max_model_len=1024)  # usable blocks 1..7
    a = req("a", SHARED + list(range(10)))  # blocks 1, 2, 3 cached, 4 partial
    admit(m, a)
    m.free(a)
    assert free_ids(m) == [4, 5, 6, 7, 3, 2, 1]
    c = req("c", range(2000, 2000 + 16 * 7))
    _, n, new = admit(m, c)
    assert n == 0 and new.get_block_ids() == ([4, 5, 6, 7, 3, 2, 1],)
    _, n = m.get_computed_blocks(req("a2", SHARED + [7]))
    assert n == 0  # all of a's cached blocks were evicted on reuse


def test_lru_evicts_the_earliest_freed_request_first():
    m = KVCacheManager(full_config(7), max_model_len=1024)  # usable 1..6
    a, b = req("a", range(0, 32)), req("b", range(100, 132))
    admit(m, a)
    admit(m, b)
    m.free(a)
    m.free(b)
    assert free_ids(m) == [5, 6, 2, 1, 4, 3]
    c = req("c", range(300, 340))  # 3 blocks: the two unhashed ones, then a's tail block
    assert admit(m, c)[2].get_block_ids() == ([5, 6, 2],)
    assert m.get_computed_blocks(req("a2", range(0, 33)))[1] == 16  # a's first block survives
    assert m.get_computed_blocks(req("b2", range(100, 133)))[1] == 32  # b, freed later, fully


def test_hit_block_is_never_evicted_to_serve_its_own_request():
    m = KVCacheManager(full_config(7), max_model_len=1024)  # usable 1..6
    a = req("a", range(0, 32))  # blocks 1, 2 cached
    admit(m, a)
    m.free(a)
    e = req("e", range(500, 564))  # takes 3, 4, 5, 6, all cached
    admit(m, e)
    m.free(e)
    assert free_ids(m) == [2, 1, 6, 5, 4, 3]  # a's blocks are now the LRU head
    b = req("b", list(range(0, 32)) + [7, 8, 9])
    hit, n, new = admit(m, b)
    assert n == 32 and hit.get_block_ids() == ([1, 2],)
    assert new.get_block_ids() == ([6],)  # not 2, which heads the queue but is b's own hit
    assert m.get_block_ids("b") == ([1, 2, 6],)
    m.check_invariants([b])


def test_capacity_counts_free_hits_once_and_shared_hits_not_at_all():
    m = KVCacheManager(full_config(4), max_model_len=1024)  # usable 1..3
    a = req("a", range(0, 32))
    admit(m, a)
    # a running holds 1, 2; b hits them (ref 1 -> not taken from the queue) and needs one new block.
    b = req("b", list(range(0, 32)) + [1])
    hit, n, new = admit(m, b)
    assert n == 32 and new.get_block_ids() == ([3],)
    assert [m.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 1]
    m.free(b)
    m.free(a)
    # Now the hits sit in the free queue: 2 hits + 1 new = all 3 free blocks: fits exactly.
    c = req("c", list(range(0, 32)) + [5])
    hit, n, new = admit(m, c)
    assert n == 32 and new.get_block_ids() == ([3],)
    m.free(c)
    # 2 free hits + 2 new blocks = 4 > 3: must not fit, and nothing may change.
    d = req("d", list(range(0, 32)) + list(range(17)))
    hit, n = m.get_computed_blocks(d)
    before = snapshot(m, [d])
    assert m.allocate_slots(d, d.num_tokens - n, n, hit) is None
    assert snapshot(m, [d]) == before


def test_allocate_slots_none_changes_nothing_for_a_running_request():
    m = KVCacheManager(full_config(6), max_model_len=1024)  # usable 1..5
    a, b = req("a", range(0, 40)), req("b", range(100, 130))
    admit(m, a)
    admit(m, b)
    a.append_output_token_ids(list(range(40, 70)))
    before = snapshot(m, [a, b])
    assert m.allocate_slots(a, 30) is None  # 70 tokens need 2 more blocks, 0 are free
    assert snapshot(m, [a, b]) == before
    m.check_invariants([a, b])


def test_caching_disabled_nothing_hits():
    m = KVCacheManager(full_config(20), max_model_len=1024, enable_caching=False)
    a = req("a", SHARED + [1])
    admit(m, a)
    hit, n = m.get_computed_blocks(req("b", SHARED + [2]))
    assert n == 0 and hit.get_block_ids() == ([],)
    assert not m.block_pool.cached_block_hash_to_block
    assert all(b.block_hash is None for b in m.block_pool.blocks)
    m.free(a)
    assert free_ids(m)[:4] == [1, 2, 3, 4]  # all unhashed: reused first, in the freed request's order
    with pytest.raises(ValueError, match="caching disabled"):
        m.allocate_slots(req("c", SHARED), 1, 16, KVCacheBlocks(([m.block_pool.blocks[1]],)))


def test_views_usage_stats_and_reset():
    m = KVCacheManager(full_config(11), max_model_len=1024)  # usable 1..10
    a = req("a", SHARED + [1])
    admit(m, a)
    assert m.usage == pytest.approx(0.4)
    assert m.get_blocks("a").get_block_ids() == m.get_block_ids("a") == ([1, 2, 3, 4],)
    assert m.get_block_ids("nobody") == ([],)
    assert m.num_groups == 1 and m.empty_kv_cache_blocks.get_block_ids() == ([],)
    assert empty_kv_cache_blocks(2).get_block_ids() == ([], [])
    m.get_computed_blocks(req("x", SHARED + [3]))  # a lookup alone is not a query: nothing admitted
    b = req("b", SHARED + [2])
    admit(m, b)
    s = m.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (2, 98, 48) and s.hit_rate == pytest.approx(48 / 98)
    assert m.reset_prefix_cache() is False  # a and b still hold blocks
    m.free(a)
    m.free(b)
    assert m.reset_prefix_cache() is True
    c = req("c", SHARED + [2])
    assert admit(m, c)[1] == 0
    assert m.prefix_cache_stats.queries == 49


def test_bad_arguments_raise_clear_errors():
    m = KVCacheManager(full_config(20), max_model_len=1024)
    a = req("a", SHARED + [1])
    with pytest.raises(ValueError, match="num_new_tokens=0"):
        m.allocate_slots(a, 0)
    with pytest.raises(ValueError, match="needs the new_computed_blocks"):
        m.allocate_slots(a, 1, 16)
    admit(m, a)
    hit, n = m.get_computed_blocks(req("x", SHARED + [1]))
    with pytest.raises(ValueError, match="num_new_computed_tokens=32"):
        m.allocate_slots(req("b", SHARED + [1]), 1, 32, hit)
    with pytest.raises(ValueError, match="holds no blocks"):
        m.allocate_slots(a, 1, n, hit)
    m.free(a)
    c = req("c", range(3000, 3000 + 16 * 19))  # takes every block, evicting a's cached ones
    assert m.allocate_slots(c, c.num_tokens) is not None
    m.free(c)
    with pytest.raises(ValueError, match="stale"):
        m.allocate_slots(req("x", SHARED + [1]), 1, n, hit)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(
            KVCacheConfig(
                8,
                [
                    KVCacheGroupSpec(["a"], FullAttentionSpec(16, 1, 8, torch.float32)),
                    KVCacheGroupSpec(["b"], FullAttentionSpec(8, 2, 8, torch.float32)),
                ],
            ),
            64,
        )


# ---- randomized operation sequences -------------------------------------------------------------
class KVContentModel:
    """What each block would hold on the GPU: the token written at each slot (a stand-in for its KV).

    Reading a slot must return the token the request has at that position; that fails if a block
    was reused while still needed, or a hit served another prefix's content.
    """

    def __init__(self, m):
        self.m = m
        self.slots = {}  # (group, block_id, offset) -> token

    def write(self, r, start, end):
        for gid, row in enumerate(self.m.get_blocks(r.request_id).blocks):
            for pos in range(start, end):
                block = row[pos // BS]
                assert not block.is_null, f"{r.request_id}: position {pos} maps to the null block"
                self.slots[(gid, block.block_id, pos % BS)] = r.all_token_ids[pos]

    def check_readable(self, r, upto):
        """Every key the next token (at position `upto`) attends to holds the right token."""
        for gid, row in enumerate(self.m.get_blocks(r.request_id).blocks):
            spec = self.m.kv_cache_config.kv_cache_groups[gid].kv_cache_spec
            lo = max(0, upto - spec.sliding_window + 1) if isinstance(spec, SlidingWindowSpec) else 0
            for pos in range(lo, upto):
                block = row[pos // BS]
                assert not block.is_null, f"{r.request_id}: needed position {pos} is a null block (g{gid})"
                got = self.slots.get((gid, block.block_id, pos % BS))
                assert got == r.all_token_ids[pos], f"{r.request_id}: stale KV at position {pos} (g{gid})"


def run_random_ops(m, seed, steps):
    rng = random.Random(seed)
    kv = KVContentModel(m)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 70))] for _ in range(4)]
    running, waiting, n = [], [], 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.3 or not (running or waiting):
            tail = [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
            waiting.append(req(f"r{n}", rng.choice(prefixes)[: rng.randrange(0, 70)] + tail))
            n += 1
        elif op < 0.45 and waiting:
            r = waiting.pop(0)
            hit, k = m.get_computed_blocks(r)
            num_new = min(r.num_tokens - k, rng.randrange(1, 48))  # possibly a prefill chunk
            before = snapshot(m, [r])
            if m.allocate_slots(r, num_new, k, hit) is None:
                assert snapshot(m, [r]) == before
                waiting.insert(0, r)
            else:
                kv.check_readable(r, k)  # the hit serves exactly this prompt's tokens
                r.num_computed_tokens = k
                kv.write(r, k, k + num_new)
                r.num_computed_tokens += num_new
                running.append(r)
        elif op < 0.9 and running:
            r = rng.choice(running)
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token_ids(rng.randrange(50))  # decode: the sampled token joins the row
            num_new = min(r.num_tokens - r.num_computed_tokens, rng.randrange(1, 24))
            before = snapshot(m, running)
            if m.allocate_slots(r, num_new) is None:
                assert snapshot(m, running) == before
                running.remove(r)  # preempt by recompute
                m.free(r)
                r.num_computed_tokens = 0
                waiting.insert(0, r)
            else:
                kv.check_readable(r, r.num_computed_tokens)
                kv.write(r, r.num_computed_tokens, r.num_computed_tokens + num_new)
                r.num_computed_tokens += num_new
        elif running:
            r = running.pop(rng.randrange(len(running)))
            m.free(r)
        m.check_invariants(running)
    for r in running:
        m.free(r)
    m.check_invariants([])
    assert m.block_pool.num_free_blocks == m.block_pool.num_blocks - 1


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "make_config",
    [
        lambda: full_config(24),
        lambda: hybrid_config(40, window=20),
        lambda: hybrid_config(40, window=48),
    ],
    ids=["full", "hybrid-w20", "hybrid-w48"],
)
def test_random_operations_keep_invariants_and_kv_content(make_config, seed):
    m = KVCacheManager(make_config(), max_model_len=4096)
    run_random_ops(m, seed, steps=600)
    assert m.prefix_cache_stats.hits > 0  # the shared prefixes did hit


def test_random_operations_without_caching():
    m = KVCacheManager(full_config(24), max_model_len=4096, enable_caching=False)
    run_random_ops(m, seed=7, steps=400)
    assert m.prefix_cache_stats.hits == 0
