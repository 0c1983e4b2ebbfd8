"""Scheduler: budgets and chunking, messages (new / cached deltas / resumed), preemption, prefix hits.
Runs against the real KVCacheManager. Stops, aborts and refused requests: test_scheduler_stops.py."""

from __future__ import annotations

import pytest

from kvcore import Request, RequestStatus, SamplingParams
from kvcore.sched.scheduler import Scheduler
from tests.scheduler_helpers import drain, make_request, make_scheduler, run_output, step, tokens_of

# ---------------------------------------------------------------- budgets and chunking


def test_chunked_prefill_budget_and_threshold():
    sched = make_scheduler(num_blocks=256, max_num_batched_tokens=1024, threshold=400, max_model_len=2048)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 800, start=i * 1000))
    out, outs = step(sched)
    assert out.num_scheduled_tokens == {"r0": 400, "r1": 400, "r2": 224}
    assert out.total_num_scheduled_tokens == 1024
    assert outs == []  # partial chunks sample nothing
    out, outs = step(sched)
    # r0 and r1 finish their prompt (400 each); r2 gets what is left of the budget.
    assert out.num_scheduled_tokens == {"r0": 400, "r1": 400, "r2": 224}
    assert sorted(o.request_id for o in outs) == ["r0", "r1"]
    out, outs = step(sched)
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 1, "r2": 352}
    assert [n.num_computed_tokens for n in out.scheduled_new_reqs] == []
    assert out.scheduled_cached_reqs.num_computed_tokens == [800, 800, 448]


def test_max_num_seqs_caps_running():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 8, max_tokens=2, start=100 * i))
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 3
    out, outs = step(sched)  # both decode their last token and finish; nobody else is admitted yet
    assert list(out.num_scheduled_tokens) == ["r0", "r1"]
    assert all(o.finished for o in outs)
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["r2", "r3"]
    assert out.finished_req_ids == {"r0", "r1"}


def test_admission_batching_waits_for_free_rows_or_max_wait():
    """admission_min_batch=3: finished rows are refilled 3 at a time (or when every waiting request fits,
    or after admission_max_wait_steps deferrals); an idle engine admits at once."""
    sched = make_scheduler(max_num_seqs=4, admission_min_batch=3, admission_max_wait_steps=5)
    lengths = {"a": 1, "b": 2, "c": 3, "d": 20}  # max_tokens: a, b, c finish on steps 1, 2, 3
    for rid, n in lengths.items():
        sched.add_request(make_request(rid, 4, max_tokens=n, start=ord(rid) * 10))
    for i in range(4):
        sched.add_request(make_request(f"w{i}", 4, max_tokens=20, start=1000 + 10 * i))
    out, _ = step(sched)  # idle engine: the first 4 at once
    assert list(out.num_scheduled_tokens) == ["a", "b", "c", "d"]
    admitted = []
    for _ in range(2):  # a, b, c finish one a step: 1, then 2 free rows: kept out
        out, _ = step(sched)
        admitted.append([r.req_id for r in out.scheduled_new_reqs])
    assert admitted == [[], []], admitted
    out, _ = step(sched)  # 3 free rows now
    assert [r.req_id for r in out.scheduled_new_reqs] == ["w0", "w1", "w2"]
    drain(sched)

    # The wait cap: one free row, admitted after 2 deferred steps.
    sched = make_scheduler(max_num_seqs=2, admission_min_batch=2, admission_max_wait_steps=2)
    sched.add_request(make_request("x", 4, max_tokens=1, start=0))
    sched.add_request(make_request("y", 4, max_tokens=30, start=100))
    for i in range(3):
        sched.add_request(make_request(f"v{i}", 4, max_tokens=5, start=200 + 10 * i))
    step(sched)
    news = []
    for _ in range(4):
        out, _ = step(sched)
        news.append([r.req_id for r in out.scheduled_new_reqs])
    assert news == [[], [], ["v0"], []], news
    drain(sched)

    with pytest.raises(ValueError, match="admission_min_batch"):
        make_scheduler(admission_min_batch=0)


def test_decode_budget_shared_fcfs():
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_request("a", 6, start=0))
    sched.add_request(make_request("b", 6, start=100))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 6, "b": 4}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 2}


def test_invalid_scheduler_config():
    manager = make_scheduler().kv_cache_manager
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(manager, max_num_seqs=0, max_num_batched_tokens=8, max_model_len=8)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        Scheduler(manager, max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8, long_prefill_token_threshold=-1)


# ---------------------------------------------------------------- messages


def test_new_then_delta_messages():
    sched = make_scheduler(block_size=4)
    sched.add_request(make_request("a", 6, max_tokens=10))
    out, _ = step(sched)
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "a" and new.block_ids == ([1, 2],) and new.num_computed_tokens == 0
    assert new.prompt_token_ids == list(range(6))
    assert out.scheduled_cached_reqs.num_reqs == 0
    deltas = []
    for _ in range(6):  # positions 6..11: block 3 is needed at position 8, block 4 at 12
        out, _ = step(sched)
        cached = out.scheduled_cached_reqs
        assert cached.req_ids == ["a"] and cached.resumed_from_preemption == [False]
        assert cached.resumed_token_ids == [None]
        deltas.append(cached.new_block_ids[0])
    assert deltas == [None, None, ([3],), None, None, None]
    out, _ = step(sched)
    assert out.scheduled_cached_reqs.new_block_ids == [([4],)]
    assert sched.kv_cache_manager.get_block_ids("a") == ([1, 2, 3, 4],)


def test_step_ids_increase_and_empty_step():
    sched = make_scheduler()
    out1 = sched.schedule()
    assert out1.is_empty and sched.update_from_output(out1, None) == []
    out2 = sched.schedule()
    assert out2.step_id > out1.step_id


def test_multi_group_messages_carry_every_group():
    sched = make_scheduler(block_size=4, sliding_window=4, num_blocks=64)
    sched.add_request(make_request("a", 10, max_tokens=20))
    out, _ = step(sched)
    (new,) = out.scheduled_new_reqs
    assert len(new.block_ids) == 2 and len(new.block_ids[0]) == 3 and len(new.block_ids[1]) == 3
    outs = drain(sched)
    assert len(tokens_of(outs["a"])) == 19  # 1 token came from the first step
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 63


# ---------------------------------------------------------------- preemption


def test_preemption_last_running_is_victim_and_resumes_with_full_row():
    # 6 usable blocks of 4 tokens; three 4-token prompts decode until the pool runs dry.
    sched = make_scheduler(num_blocks=7, block_size=4, max_model_len=64)
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, 4, max_tokens=8, start=100 * i))
    preempt_out = None
    for _ in range(10):
        out, _ = step(sched)
        if out.preempted_req_ids:
            preempt_out = out
            break
    assert preempt_out is not None and preempt_out.preempted_req_ids == {"c"}
    assert list(preempt_out.num_scheduled_tokens) == ["a", "b"]
    c = sched.waiting[0]
    assert c.request_id == "c" and c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1 and sched.num_preemptions == 1
    assert sched.kv_cache_manager.get_block_ids("c") == ([],)
    resumed = None
    outs: dict[str, list] = {}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        cached = out.scheduled_cached_reqs
        if "c" in cached.req_ids and cached.resumed_from_preemption[cached.req_ids.index("c")]:
            i = cached.req_ids.index("c")
            resumed = (
                cached.new_block_ids[i],
                cached.resumed_token_ids[i],
                cached.num_computed_tokens[i],
                sched.kv_cache_manager.get_block_ids("c"),
            )
            assert "c" not in [n.req_id for n in out.scheduled_new_reqs]
        for o in sched.update_from_output(out, run_output(sched, out)):
            outs.setdefault(o.request_id, []).append(o)
    assert resumed is not None
    block_ids, token_ids, num_computed, manager_ids = resumed
    assert block_ids == manager_ids  # the full row, which replaces the worker's row
    assert num_computed == 0  # a and b used different tokens: no prefix hit
    # Its full token ids: prompt plus the outputs it had produced before the preemption.
    assert token_ids == list(range(200, 204)) + [1000 + p for p in range(4, len(token_ids))]
    assert len(token_ids) > 4
    assert outs["c"][-1].finish_reason == "length"
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 6


def test_request_can_preempt_itself():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)  # 3 usable blocks
    sched.add_request(make_request("a", 4, max_tokens=8, start=0))
    sched.add_request(make_request("b", 4, max_tokens=8, start=100))
    _, first = step(sched)  # a: block 1, b: block 2; both sample their first token
    out, second = step(sched)  # both need a second block; a gets the last one, b preempts itself
    assert out.preempted_req_ids == {"b"} and list(out.num_scheduled_tokens) == ["a"]
    assert [r.request_id for r in sched.running] == ["a"] and sched.waiting[0].request_id == "b"
    assert [o.request_id for o in second] == ["a"]
    outs = drain(sched)
    for o in first + second:
        outs[o.request_id].insert(0, o)
    b_tokens = tokens_of(sorted(outs["b"], key=lambda o: o.finished))
    assert len(tokens_of(outs["a"])) == 8 and len(b_tokens) == 8
    assert b_tokens == [1000 + p for p in range(4, 12)]  # recompute loses nothing


# ---------------------------------------------------------------- prefix caching


def test_prefix_hits_counted_and_skip_computation():
    sched = make_scheduler(block_size=4)
    shared = list(range(12))
    sched.add_request(Request("a", shared + [50, 51], SamplingParams(max_tokens=2)))
    drain(sched)
    sched.add_request(Request("b", shared + [60], SamplingParams(max_tokens=2)))
    out, _ = step(sched)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 12 and out.num_scheduled_tokens == {"b": 1}
    assert new.block_ids[0][:3] == sched.kv_cache_manager.get_block_ids("b")[0][:3]
    outs = drain(sched)
    assert outs["b"][-1].num_cached_tokens == 12
    stats = sched.stats()
    assert stats["prefix_cache_hits"] == 12 and stats["prefix_cache_queries"] == 14 + 13
    assert stats["prefix_cache_hit_rate"] == pytest.approx(12 / 27)
    assert stats["running"] == 0 and stats["kv_cache_usage"] == 0.0


def test_prefix_lookup_counted_once_under_memory_pressure():
    """A request that does not fit looks up the prefix cache again every step; it is one query, counted
    when it is admitted, so a full pool does not inflate the hit rate."""
    sched = make_scheduler(num_blocks=7, block_size=4, max_model_len=64)  # 6 usable blocks
    shared = list(range(12))
    sched.add_request(Request("a", shared + [50, 51], SamplingParams(max_tokens=8, ignore_eos=True)))
    sched.add_request(Request("b", shared + list(range(60, 69)), SamplingParams(max_tokens=1)))
    steps_waiting = 0
    for _ in range(20):
        out, _ = step(sched)
        if "b" in out.num_scheduled_tokens:
            (new,) = [r for r in out.scheduled_new_reqs if r.req_id == "b"]
            assert new.num_computed_tokens == 12  # a's prompt blocks, freed but still cached
            break
        steps_waiting += 1
    else:
        raise AssertionError("b was never admitted")
    assert steps_waiting >= 5, steps_waiting  # b looked up, did not fit, and looked again
    drain(sched)
    stats = sched.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (14 + 21, 12), stats
    assert stats["prefix_cache_hit_rate"] == pytest.approx(12 / 35)


def test_decode_blocks_become_prefix_hits():
    # Output tokens fill blocks too; a later request with those tokens as prompt hits them.
    sched = make_scheduler(block_size=4)
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=9)))
    outs = drain(sched)
    generated = tokens_of(outs["a"])
    sched.add_request(Request("b", [1, 2, 3] + generated, SamplingParams(max_tokens=1)))
    out, _ = step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8  # 12 tokens: all blocks but the last
