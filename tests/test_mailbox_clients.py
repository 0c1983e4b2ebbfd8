"""A driver's mailbox with several clients (the ingress replicas of `kvray serve` share a driver): each
client polls its own outbox; a request's outputs, timing and "returned" notice reach only the client
that submitted it; the prefix cache's events reach every client, each bounded on its own, and a client
new to the driver starts from the whole cache. One client under DEFAULT_CLIENT (`kvray run`, LLM)
works as before."""

from __future__ import annotations

import threading

from actors.driver.mailbox import MAX_PENDING_CACHE_EVENTS, Mailbox
from actors.messages import DEFAULT_CLIENT, PollResult, RequestSpec
from kvcore.kv_cache.block_pool import CacheEvents
from kvcore.messages import EngineCoreOutput
from kvcore.request import SamplingParams
from kvcore.wire import decode, encode


def _spec(rid: str, client: str = DEFAULT_CLIENT) -> RequestSpec:
    return RequestSpec(rid, [1, 2, 3], SamplingParams(max_tokens=4), client_id=client)


def _submit(box: Mailbox, *specs: RequestSpec) -> None:
    assert box.submit(list(specs), lambda s: None) == [None] * len(specs)
    box.next_work(lambda: False)  # the step loop takes them


def test_outputs_and_timings_go_only_to_the_submitting_client():
    box = Mailbox()
    _submit(box, _spec("a", "ingress-1"), _spec("b", "ingress-2"))
    box.publish([EngineCoreOutput("a", [7]), EngineCoreOutput("b", [8])], 0.1)
    box.publish([EngineCoreOutput("a", [9], finished=True, finish_reason="length")], 0.1)
    one = box.poll(0.0, "ingress-1")
    two = box.poll(0.0, "ingress-2")
    assert [(o.request_id, o.new_token_ids) for o in one.outputs] == [("a", [7]), ("a", [9])]
    assert [(o.request_id, o.new_token_ids) for o in two.outputs] == [("b", [8])]
    assert one.outputs[-1].timing is not None  # the finished one carries its timing, to its own client
    assert one.num_live == two.num_live == 1  # b still runs: every client sees the driver's whole load
    assert box.poll(0.0, "ingress-1").outputs == [] and box.num_undelivered == 0


def test_returned_notices_and_errors_go_to_their_client():
    box = Mailbox()
    _submit(box, _spec("a", "x"), _spec("b", "y"), _spec("c", "y"))
    box.finish_with_error("c", "bad")
    box.hand_back("placement lost")
    x, y = box.poll(0.0, "x"), box.poll(0.0, "y")
    assert x.returned == ["a"] and sorted(y.returned) == ["b"]
    assert [o.request_id for o in y.outputs] == ["c"] and y.outputs[0].error == "bad" and not x.outputs
    assert not x.available and not y.available


def test_fatal_reaches_every_client_and_each_live_request_ends_at_its_own():
    box = Mailbox()
    _submit(box, _spec("a", "x"), _spec("b", "y"))
    box.fail_all("down")
    x, y = box.poll(0.0, "x"), box.poll(0.0, "y")
    assert x.fatal == y.fatal == "down"
    assert [o.request_id for o in x.outputs] == ["a"] and [o.request_id for o in y.outputs] == ["b"]


def test_cache_events_reach_every_client_and_a_new_client_starts_from_the_whole_cache():
    box = Mailbox()
    keys = [11, 12]
    box.poll(0.0, "x")  # x is known before the first step
    box.publish([], 0.0, CacheEvents(stored=[11, 12], reset=True), lambda: list(keys))
    box.publish([], 0.0, CacheEvents(stored=[13]), lambda: list(keys))
    keys.append(13)
    x = box.poll(0.0, "x")
    assert [e.stored for e in x.cache_events] == [[11, 12], [13]] and x.cache_events[0].reset
    box.poll(0.0, "y")  # y comes later: its first events are the whole cache
    box.publish([], 0.0, CacheEvents(removed=[11]), lambda: [12, 13])
    y, x = box.poll(0.0, "y"), box.poll(0.0, "x")
    assert len(y.cache_events) == 1 and y.cache_events[0].reset and y.cache_events[0].stored == [12, 13]
    assert [e.removed for e in x.cache_events] == [[11]] and not x.cache_events[0].reset


def test_a_client_that_stops_polling_keeps_a_bounded_backlog_while_the_other_gets_every_event():
    box = Mailbox()
    box.poll(0.0, "idle")
    box.poll(0.0, "busy")
    for k in range(3 * MAX_PENDING_CACHE_EVENTS):
        box.publish([], 0.0, CacheEvents(stored=[k]), lambda: [0])
        if k % 10 == 0:
            assert box.poll(0.0, "busy").cache_events
    idle = box.poll(0.0, "idle")
    assert 1 <= len(idle.cache_events) <= MAX_PENDING_CACHE_EVENTS
    assert idle.cache_events[0].reset  # it fell behind: the whole cache, then what followed


def test_one_clients_outputs_do_not_end_another_clients_wait():
    box = Mailbox()
    _submit(box, _spec("a", "x"), _spec("b", "y"))
    got: list[PollResult] = []
    waiter = threading.Thread(target=lambda: got.append(box.poll(30.0, "y")))
    waiter.start()
    box.publish([EngineCoreOutput("a", [1])], 0.0)  # x's output: y keeps waiting
    assert [o.request_id for o in box.poll(0.0, "x").outputs] == ["a"]
    box.publish([EngineCoreOutput("b", [2])], 0.0)
    waiter.join(timeout=30)
    assert [o.request_id for o in got[0].outputs] == ["b"]


def test_the_default_client_works_alone_as_before():
    box = Mailbox()
    _submit(box, RequestSpec("a", [1], SamplingParams(max_tokens=2)))
    box.publish([EngineCoreOutput("a", [5], finished=True, finish_reason="length")], 0.0)
    res = box.poll(0.0)
    assert [o.new_token_ids for o in res.outputs] == [[5]] and res.outputs[0].timing is not None


def test_the_client_id_travels_on_the_wire():
    spec = _spec("a", "ingress-7")
    assert decode(RequestSpec, encode(spec)).client_id == "ingress-7"


def test_a_client_that_goes_away_leaves_its_requests_to_abort_and_nothing_piling_up():
    box = Mailbox()
    _submit(box, _spec("a", "gone"), _spec("b", "stays"))
    assert box.forget_client("gone") == ["a"]
    assert box.clients == ["stays"]
    box.publish([EngineCoreOutput("a", [1]), EngineCoreOutput("b", [2])], 0.0)
    assert box.num_undelivered == 1  # a's output has no reader: dropped
    assert [o.request_id for o in box.poll(0.0, "stays").outputs] == ["b"]
