"""The control-plane messages pickle as (class, fields in order) (kvcore/wire.py's `@message`): every field
survives a round trip through pickle, Ray's cloudpickle and deepcopy, with the defaults and with every field
set, a field outside __init__ travels too, and a class the codec cannot rebuild is refused by name."""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass, field

import pytest
from ray import cloudpickle

from kvcore.messages import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from kvcore.request import SamplingParams
from kvcore.wire import message


def messages() -> list[object]:
    new = NewRequestData("r0", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.5, seed=3), ([4, 5], [6]), 2)
    cached = CachedRequestData()
    cached.add("r1", ([9],), 17)
    cached.add("r2", None, 40, resumed_token_ids=[1, 2, 3])
    full = SchedulerOutput([new], cached, {"r0": 1, "r1": 1, "r2": 3}, 5, {"gone"}, {"out"}, step_id=11)
    bare = SchedulerOutput([], CachedRequestData(), {}, 0)
    out = ModelRunnerOutput(["r0", "r1"], [[7], []], step_id=11, cudagraph=True)
    return [new, cached, full, bare, out, ModelRunnerOutput([], [])]


@pytest.mark.parametrize(
    "roundtrip",
    [
        lambda m: pickle.loads(pickle.dumps(m, protocol=5)),
        lambda m: cloudpickle.loads(cloudpickle.dumps(m)),
        copy.deepcopy,
    ],
    ids=["pickle5", "cloudpickle", "deepcopy"],
)
def test_every_field_survives_a_round_trip(roundtrip):
    for m in messages():
        back = roundtrip(m)
        assert type(back) is type(m) and back == m and back is not m


def test_a_shared_request_id_is_pickled_once():
    so = messages()[2]
    back = pickle.loads(pickle.dumps(so, protocol=5))
    # The memo keeps one object for a req_id that appears in several fields, as before.
    assert back.scheduled_cached_reqs.req_ids[0] is next(k for k in back.num_scheduled_tokens if k == "r1")


@message
@dataclass(slots=True)
class WithDerived:
    a: int
    b: list[int] = field(default_factory=list, init=False)


def test_a_field_outside_init_travels():
    m = WithDerived(3)
    m.b.append(4)
    for back in (pickle.loads(pickle.dumps(m, protocol=5)), cloudpickle.loads(cloudpickle.dumps(m))):
        assert (back.a, back.b) == (3, [4])


def test_a_class_the_codec_cannot_rebuild_is_refused():
    with pytest.raises(TypeError, match="@message Plain must be a dataclass"):

        @message
        class Plain:
            pass

    with pytest.raises(TypeError, match="@message Frozen must not be frozen"):

        @message
        @dataclass(frozen=True)
        class Frozen:
            a: int
