"""PollResult's wire form (kvcore/wire.py, derived from its fields): every field survives Ray's serializer, and
a step's outputs travel as plain tuples (one reducer_override call for the message, not one per output)."""

from __future__ import annotations

import io
import pickle

import ray.cloudpickle as cloudpickle

from actors.messages import PollResult, error_output
from kvcore.kv_cache.block_pool import CacheEvents
from kvcore.messages import EngineCoreOutput, RequestTiming


def sample() -> PollResult:
    outputs = [EngineCoreOutput(f"cmpl-{i}-0", [i, i + 1]) for i in range(256)]
    outputs.append(EngineCoreOutput("done", [7], True, "stop", 7, None, 32, timing=RequestTiming(0.25, 1.5, 40, 12)))
    bad = error_output("bad", "request 'bad' rejected: top_k must be >= -1")
    bad.timing = RequestTiming(None, 0.01, 3, 0)
    outputs.append(bad)
    # Every field distinct (stand-ins for the logprobs objects): a field rebuilt into another's slot shows.
    timing = RequestTiming(0.5, 2.0, 4, 1)
    outputs.append(EngineCoreOutput("all", [3], True, "length", 9, "e", 16, "step-rows", "prompt-rows", timing))
    events = [CacheEvents([11, 12], [13]), CacheEvents([14], [], reset=True)]
    return PollResult(
        outputs, fatal="engine replica 0 is down: gone", returned=["r9"], available=False, cache_events=events
    )


def test_every_field_survives_rays_serializer() -> None:
    pr = sample()
    back = pickle.loads(cloudpickle.dumps(pr))
    assert back == pr
    assert all(type(o) is EngineCoreOutput for o in back.outputs)
    assert back.outputs[-3].finish_reason == "stop" and back.outputs[-3].num_cached_tokens == 32
    last = back.outputs[-1]
    assert (last.stop_reason, last.error, last.step_logprobs, last.prompt_logprobs, last.timing) == (
        9,
        "e",
        "step-rows",
        "prompt-rows",
        RequestTiming(0.5, 2.0, 4, 1),
    )
    assert back.outputs[-2].timing.ttft_s is None and back.returned == ["r9"] and back.available is False
    assert all(o.timing is None for o in back.outputs[:-3])
    assert back.cache_events == [CacheEvents([11, 12], [13]), CacheEvents([14], [], reset=True)]


def test_defaults_and_protocol_5() -> None:
    pr = PollResult([EngineCoreOutput("a", [1])])
    back = pickle.loads(pickle.dumps(pr, protocol=5))
    assert back == pr and back.outputs[0].timing is None and back.fatal is None and back.available is True


class CountingPickler(cloudpickle.Pickler):
    calls = 0

    def reducer_override(self, obj: object) -> object:
        CountingPickler.calls += 1
        return super().reducer_override(obj)


def test_outputs_travel_as_plain_tuples() -> None:
    # cloudpickle's reducer_override is Python, called for every object that is not a plain built-in:
    # a step's few hundred dataclass instances each paid it before.
    CountingPickler.calls = 0
    buf = io.BytesIO()
    CountingPickler(buf, protocol=5).dump(sample())
    assert CountingPickler.calls < 10
    assert pickle.loads(buf.getvalue()) == sample()
