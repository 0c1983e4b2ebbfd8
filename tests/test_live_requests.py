"""The driver's books on live requests: timings, and one unbroken stream per request across a restart."""

from actors.driver.live_requests import LiveRequests
from actors.messages import RequestSpec
from kvcore.messages import EngineCoreOutput
from kvcore.request import SamplingParams

GREEDY = SamplingParams(max_tokens=10)
SAMPLED = SamplingParams(temperature=1.0, seed=7, max_tokens=10)


def out(rid, tokens, finished=False):
    return EngineCoreOutput(rid, list(tokens), finished=finished, finish_reason="length" if finished else None)


def books_with(spec, published):
    live = LiveRequests()
    live.add(spec, now=100.0)
    live.record(out(spec.request_id, published), now=100.5)
    return live


def test_a_finished_request_leaves_the_books_with_its_timing():
    live = books_with(RequestSpec("a", [1, 2, 3], GREEDY), [4])
    timing = live.record(out("a", [5], finished=True), now=102.0)
    assert (timing.ttft_s, timing.e2e_s, timing.num_prompt_tokens, timing.num_output_tokens) == (0.5, 2.0, 3, 2)
    assert "a" not in live and len(live) == 0
    live.add(RequestSpec("b", [1], GREEDY), now=10.0)
    timing = live.retire("b", now=11.0)
    assert (timing.ttft_s, timing.e2e_s, timing.num_prompt_tokens, timing.num_output_tokens) == (None, 1.0, 1, 0)
    assert live.retire("b", now=12.0) is None


def test_a_greedy_request_goes_on_from_its_tokens_so_far():
    live = books_with(RequestSpec("g", [1, 2, 3], GREEDY), [7, 8])
    req = live.restart("g", eos_token_id=0)
    # They join its outputs, not its prompt: output positions, penalties and token limits go on.
    assert req.prompt_token_ids == [1, 2, 3] and req.output_token_ids == [7, 8]
    assert req.all_token_ids == [1, 2, 3, 7, 8] and req.sampling_params.max_tokens == 10
    assert live.num_replayed == 0
    # Nothing is replayed: the next output passes as it is.
    assert live.drop_replayed([out("g", [9])], abort=lambda ids: None) == [out("g", [9])]


def test_a_sampled_request_starts_over_and_its_replayed_tokens_are_dropped():
    live = books_with(RequestSpec("s", [1, 2], SAMPLED), [5, 6, 7])
    req = live.restart("s", eos_token_id=None)
    assert req.prompt_token_ids == [1, 2] and req.sampling_params.max_tokens == 10
    assert live.num_replayed == 1
    kept = live.drop_replayed([out("s", [5, 6])], abort=lambda ids: None)
    assert kept == []  # all already sent
    for o in kept:
        live.record(o, now=101.0)
    kept = live.drop_replayed([out("s", [7, 9])], abort=lambda ids: None)
    assert [o.new_token_ids for o in kept] == [[9]]


def test_a_replay_that_differs_ends_the_request_with_an_error_and_silences_its_abort():
    live = books_with(RequestSpec("s", [1, 2], SAMPLED), [5, 6])
    live.restart("s", eos_token_id=None)
    aborted = []
    kept = live.drop_replayed([out("s", [5, 4])], abort=aborted.extend)
    assert aborted == ["s"]
    assert len(kept) == 1 and kept[0].finish_reason == "error" and "replayed tokens differ" in kept[0].error
    assert "output position 0" in kept[0].error
    live.record(kept[0], now=101.0)  # published: the request leaves the books
    assert "s" not in live
    # The engine's echo of that abort is not sent as a second end of the stream.
    assert live.drop_replayed([out("s", [], finished=True)], abort=aborted.extend) == []


def test_clear_forgets_every_request():
    live = books_with(RequestSpec("a", [1], GREEDY), [])
    live.add(RequestSpec("b", [1], GREEDY), now=0.0)
    assert sorted(live.clear()) == ["a", "b"] and len(live) == 0
