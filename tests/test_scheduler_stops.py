"""Scheduler: stop conditions (EOS, stop tokens, max_tokens, max_model_len, min_tokens), aborts and
finishes from outside, impossible and duplicate requests. Runs against the real KVCacheManager."""

from __future__ import annotations

import functools

import pytest

from kvcore import Request, RequestStatus, SamplingParams
from kvcore.messages import ModelRunnerOutput
from tests.scheduler_helpers import drain, make_request, make_scheduler, step, tokens_of

# ---------------------------------------------------------------- stop conditions


def test_eos_stops_unless_ignored():
    sched = make_scheduler()
    sched.add_request(make_request("eos", 5, max_tokens=10, ignore_eos=False, eos=7, start=0))
    sched.add_request(make_request("ign", 5, max_tokens=10, ignore_eos=True, eos=7, start=100))

    def fn(rid: str, pos: int) -> int:
        return 7 if pos == 7 else 3  # the 3rd output token is EOS

    outs = drain(sched, fn)
    assert tokens_of(outs["eos"]) == [3, 3, 7]
    assert outs["eos"][-1].finish_reason == "stop" and outs["eos"][-1].stop_reason is None
    assert len(tokens_of(outs["ign"])) == 10 and outs["ign"][-1].finish_reason == "length"


def test_stop_token_ids_and_max_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("stop", 5, max_tokens=10, stop=(42,), start=0))
    sched.add_request(make_request("len", 5, max_tokens=4, start=100))

    def fn(rid: str, pos: int) -> int:
        return 42 if pos == 6 else 1

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
    sp = functools.partial(SamplingParams, max_tokens=10)
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
    assert {(o.request_id, o.finish_reason, o.finished) for o in outs} == {
        ("run", "abort", True),
        ("wait", "abort", True),
    }
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
    sched = make_scheduler(num_blocks=15, block_size=4, sliding_window=4, max_num_batched_tokens=7, max_model_len=64)
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
