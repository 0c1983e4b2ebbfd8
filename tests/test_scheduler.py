"""Scheduler: budgets and chunking, messages (new / cached deltas / resumed), preemption, stops,
abort, impossible and duplicate requests, prefix hits. Runs against the real KVCacheManager."""
from __future__ import annotations

import pytest
import torch

from kvcore import Request, RequestStatus, SamplingParams
from kvcore.kv_cache_manager import KVCacheManager
from kvcore.messages import ModelRunnerOutput, SchedulerOutput
from kvcore.scheduler import Scheduler
from kvcore.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec


def make_scheduler(num_blocks: int = 64, block_size: int = 16, max_model_len: int = 1024,
                   max_num_seqs: int = 16, max_num_batched_tokens: int = 1024, threshold: int = 0,
                   sliding_window: int | None = None, caching: bool = True, **kwargs) -> Scheduler:
    full = FullAttentionSpec(block_size, 1, 8, torch.float32)
    groups = [KVCacheGroupSpec(["l0"], full)]
    if sliding_window is not None:
        sw = SlidingWindowSpec(block_size, 1, 8, torch.float32, sliding_window=sliding_window)
        groups.append(KVCacheGroupSpec(["l1"], sw))
    manager = KVCacheManager(KVCacheConfig(num_blocks, groups), max_model_len, enable_caching=caching)
    return Scheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     max_model_len=max_model_len, long_prefill_token_threshold=threshold,
                     debug_invariants=True, **kwargs)


def make_request(rid: str, num_prompt: int, max_tokens: int = 16, start: int = 0, ignore_eos: bool = True,
                 eos: int | None = None, stop: tuple[int, ...] = ()) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=list(stop))
    return Request(rid, list(range(start, start + num_prompt)), params, eos_token_id=eos)


def default_token(rid: str, pos: int) -> int:
    return 1000 + pos


def run_output(sched: Scheduler, out: SchedulerOutput, token_fn=default_token) -> ModelRunnerOutput:
    """A fake model runner: one token for every request whose prefill completes this step."""
    ids, sampled = [], []
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        ids.append(rid)
        done = req.num_computed_tokens >= req.num_tokens
        sampled.append([token_fn(rid, req.num_tokens)] if done else [])
    return ModelRunnerOutput(ids, sampled, out.step_id)


def step(sched: Scheduler, token_fn=default_token):
    out = sched.schedule()
    return out, sched.update_from_output(out, run_output(sched, out, token_fn))


def drain(sched: Scheduler, token_fn=default_token, max_steps: int = 10_000) -> dict[str, list]:
    """Run to completion; returns req_id -> list of its EngineCoreOutputs."""
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        for o in step(sched, token_fn)[1]:
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("scheduler did not drain")


def tokens_of(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


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
        Scheduler(manager, max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8,
                  long_prefill_token_threshold=-1)


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
            resumed = (cached.new_block_ids[i], cached.resumed_token_ids[i], cached.num_computed_tokens[i],
                       sched.kv_cache_manager.get_block_ids("c"))
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


# ---------------------------------------------------------------- stop conditions

def test_eos_stops_unless_ignored():
    sched = make_scheduler()
    sched.add_request(make_request("eos", 5, max_tokens=10, ignore_eos=False, eos=7, start=0))
    sched.add_request(make_request("ign", 5, max_tokens=10, ignore_eos=True, eos=7, start=100))
    fn = lambda rid, pos: 7 if pos == 7 else 3  # noqa: E731  (3rd output token is EOS)
    outs = drain(sched, fn)
    assert tokens_of(outs["eos"]) == [3, 3, 7]
    assert outs["eos"][-1].finish_reason == "stop" and outs["eos"][-1].stop_reason is None
    assert len(tokens_of(outs["ign"])) == 10 and outs["ign"][-1].finish_reason == "length"


def test_stop_token_ids_and_max_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("stop", 5, max_tokens=10, stop=(42,), start=0))
    sched.add_request(make_request("len", 5, max_tokens=4, start=100))
    fn = lambda rid, pos: 42 if pos == 6 else 1  # noqa: E731
    outs = drain(sched, fn)
    assert tokens_of(outs["stop"]) == [1, 42]
    assert outs["stop"][-1].finish_reason == "stop" and outs["stop"][-1].stop_reason == 42
    assert tokens_of(outs["len"]) == [1, 42, 1, 1]  # 42 is not a stop token for this one
    assert outs["len"][-1].finish_reason == "length"
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 63


def test_max_model_len_stop():
    sched = make_scheduler(max_model_len=12, block_size=4)
    sched.add_request(make_request("a", 8, max_tokens=4))
    outs = drain(sched)
    assert len(tokens_of(outs["a"])) == 4 and outs["a"][-1].finish_reason == "length"


def test_min_tokens_holds_eos_and_stop_tokens_back():
    """No stop on EOS or a stop token before min_tokens outputs (the sampler masks them; the scheduler
    keeps the rule even if one is sampled); the min_tokens-th output may stop; length still caps."""
    sched = make_scheduler()
    sp = lambda **kw: SamplingParams(max_tokens=10, **kw)  # noqa: E731
    sched.add_request(Request("eos", list(range(5)), sp(min_tokens=3), eos_token_id=7))
    sched.add_request(Request("stop", list(range(5)), sp(min_tokens=4, stop_token_ids=[7]), eos_token_id=None))
    sched.add_request(Request("zero", list(range(5)), sp(min_tokens=0), eos_token_id=7))
    sched.add_request(Request("max", list(range(5)), SamplingParams(max_tokens=3, min_tokens=3), eos_token_id=8))
    outs = drain(sched, lambda rid, pos: 7)  # every sampled token is 7
    assert tokens_of(outs["eos"]) == [7, 7, 7] and outs["eos"][-1].finish_reason == "stop"
    assert outs["eos"][-1].stop_reason is None
    assert tokens_of(outs["stop"]) == [7] * 4 and outs["stop"][-1].stop_reason == 7
    assert tokens_of(outs["zero"]) == [7] and outs["zero"][-1].finish_reason == "stop"
    assert tokens_of(outs["max"]) == [7] * 3 and outs["max"][-1].finish_reason == "length"
    # Several tokens in one output (append_until_stop) follow the same rule.
    req = Request("multi", list(range(5)), sp(min_tokens=2), eos_token_id=7)
    sched.add_request(req)
    out = sched.schedule()
    (o,) = sched.update_from_output(out, ModelRunnerOutput(["multi"], [[7, 7, 7]], out.step_id))
    assert o.new_token_ids == [7, 7] and o.finish_reason == "stop"


def test_min_tokens_past_max_model_len_finishes_with_length():
    sched = make_scheduler(max_model_len=12, block_size=4)
    sched.add_request(Request("a", list(range(8)), SamplingParams(max_tokens=10, min_tokens=6), eos_token_id=7))
    outs = drain(sched, lambda rid, pos: 7)
    assert tokens_of(outs["a"]) == [7] * 4 and outs["a"][-1].finish_reason == "length"


def test_min_tokens_validated():
    with pytest.raises(ValueError, match=r"SamplingParams.min_tokens=5: must be >= 0 and <= max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match=r"SamplingParams.min_tokens=-1"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match=r"SamplingParams.min_tokens=1.5: must be an integer"):
        SamplingParams(min_tokens=1.5)


def test_tokens_after_stop_are_dropped():
    sched = make_scheduler()
    req = make_request("a", 5, max_tokens=10, stop=(9,))
    sched.add_request(req)
    out = sched.schedule()
    outs = sched.update_from_output(out, ModelRunnerOutput(["a"], [[1, 9, 3, 4]], out.step_id))
    (o,) = outs
    assert o.new_token_ids == [1, 9] and o.finished and o.stop_reason == 9
    assert req.output_token_ids == [1, 9] and req.status == RequestStatus.FINISHED_STOPPED
    assert sched.schedule().finished_req_ids == {"a"}


def test_missing_runner_output_is_an_error():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5))
    out = sched.schedule()
    with pytest.raises(ValueError, match="model_runner_output"):
        sched.update_from_output(out, None)


def test_partial_prefill_tokens_ignored():
    sched = make_scheduler(max_num_batched_tokens=8)
    req = make_request("a", 20)
    sched.add_request(req)
    out = sched.schedule()
    assert sched.update_from_output(out, ModelRunnerOutput(["a"], [[5]], out.step_id)) == []
    assert req.output_token_ids == []


# ---------------------------------------------------------------- abort

def test_abort_waiting_and_running_frees_blocks():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", 40, start=0))
    sched.add_request(make_request("wait", 40, start=100))
    step(sched)
    pool = sched.kv_cache_manager.block_pool
    assert pool.num_free_blocks == 63 - 3
    sched.abort(["run", "wait", "unknown"])
    assert pool.num_free_blocks == 63 and sched.num_running == 0 and sched.num_waiting == 0
    outs = sched.update_from_output(sched.schedule(), None)
    assert {(o.request_id, o.finish_reason, o.finished) for o in outs} == {("run", "abort", True),
                                                                        ("wait", "abort", True)}
    assert not sched.has_unfinished_requests()
    sched.abort(["run"])  # finished: ignored
    assert sched.update_from_output(sched.schedule(), None) == []


def test_finish_requests_with_a_status_frees_blocks_and_reports_it():
    """The driver's abort path (a client-side stop string, a dropped stream): finish_requests frees a
    running request's blocks at once and reports the status it was given."""
    sched = make_scheduler()
    sched.add_request(make_request("a", 40))
    sched.add_request(make_request("b", 20, start=100))
    step(sched)
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    sched.finish_requests("b")  # ABORTED by default
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 63
    out = sched.schedule()
    assert out.finished_req_ids == {"a", "b"}
    outs = sched.update_from_output(out, None)
    assert {(o.request_id, o.finish_reason) for o in outs} == {("a", "stop"), ("b", "abort")}
    with pytest.raises(ValueError, match="finished_status=.*RUNNING.* is not a finished status"):
        sched.finish_requests(["x"], RequestStatus.RUNNING)


def test_aborted_ids_reach_workers():
    sched = make_scheduler()
    sched.add_request(make_request("a", 10))
    step(sched)
    sched.abort("a")
    out = sched.schedule()
    assert out.finished_req_ids == {"a"} and out.num_scheduled_tokens == {}


# ---------------------------------------------------------------- impossible and duplicate requests

def test_prompt_longer_than_max_model_len_is_rejected():
    sched = make_scheduler(max_model_len=32)
    sched.add_request(make_request("long", 33, max_tokens=5))
    assert sched.has_unfinished_requests() and sched.num_waiting == 0
    out = sched.schedule()
    assert out.is_empty
    (o,) = sched.update_from_output(out, None)
    assert o.finished and o.finish_reason == "error"
    assert "prompt (33 tokens) exceeds max_model_len=32" in o.error
    assert not sched.has_unfinished_requests()


def test_max_tokens_past_max_model_len_is_capped_with_length():
    """As in vLLM: prompt + max_tokens past max_model_len is not an error; the generation stops at
    max_model_len with finish_reason "length". A prompt of exactly max_model_len gets one token."""
    sched = make_scheduler(max_model_len=32, block_size=4)
    sched.add_request(make_request("over", 30, max_tokens=5))
    sched.add_request(make_request("full", 32, max_tokens=5, start=100))
    sched.add_request(make_request("huge", 4, max_tokens=10**6, start=200))
    outs = drain(sched)
    assert len(tokens_of(outs["over"])) == 2 and outs["over"][-1].finish_reason == "length"
    assert len(tokens_of(outs["full"])) == 1 and outs["full"][-1].finish_reason == "length"
    assert len(tokens_of(outs["huge"])) == 28 and outs["huge"][-1].finish_reason == "length"
    assert all(o.error is None for v in outs.values() for o in v)


def test_more_blocks_than_pool_is_rejected():
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=64)  # 4 usable blocks
    sched.add_request(make_request("big", 14, max_tokens=3))  # 17 tokens -> 5 blocks
    sched.add_request(make_request("ok", 14, max_tokens=2, start=100))  # 16 tokens -> 4 blocks
    outs = drain(sched)
    (o,) = outs["big"]
    assert o.finish_reason == "error" and o.new_token_ids == []
    assert "5 KV-cache blocks" in o.error and "4 usable blocks" in o.error
    assert len(tokens_of(outs["ok"])) == 2


def test_sliding_window_group_counts_only_its_window():
    # bs 4, window 4, chunks of <= 7 tokens: the window group holds at most cdiv(3 + 7, 4) + 1 = 4
    # blocks; the full group needs cdiv(40, 4) = 10. 14 usable blocks fit a 40-token request.
    sched = make_scheduler(num_blocks=15, block_size=4, sliding_window=4, max_num_batched_tokens=7,
                           max_model_len=64)
    sched.add_request(make_request("fits", 30, max_tokens=10))
    sched.add_request(make_request("over", 31, max_tokens=10, start=100))  # 11 + 4 = 15 blocks
    outs = drain(sched)
    assert len(tokens_of(outs["fits"])) == 10 and outs["fits"][-1].finish_reason == "length"
    assert outs["over"][-1].finish_reason == "error" and "15 KV-cache blocks" in outs["over"][-1].error


def test_empty_prompt_is_rejected():
    sched = make_scheduler()
    sched.add_request(Request("e", [], SamplingParams()))
    (o,) = sched.update_from_output(sched.schedule(), None)
    assert o.finish_reason == "error" and "empty" in o.error


def test_duplicate_request_id():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="'a'.*already in use"):
        sched.add_request(make_request("a", 4))
    drain(sched)
    sched.add_request(make_request("a", 4))  # a finished id may be reused
    assert sched.num_waiting == 1


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
