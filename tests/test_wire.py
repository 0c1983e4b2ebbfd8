"""kvcore/wire.py, the one codec of the control plane: every message type survives every carrier (the
positional tuple, pickle, Ray's cloudpickle, deepcopy, the shm transport's marshal form) for any values its
annotations allow (hypothesis builds them from the dataclasses' own type hints), values marshal would write
unfaithfully (numpy) take the pickle path whole, and a field added to a message travels with no edit to the
codec."""

from __future__ import annotations

import copy
import dataclasses
import marshal
import math
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ray import cloudpickle

from actors.messages import PollResult, RequestSpec
from kvcore import wire
from kvcore.logprob_rows import Logprobs, LogprobsBatch
from kvcore.messages import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    RequestTiming,
    SchedulerOutput,
)
from kvcore.request import SamplingParams

MESSAGES = [
    NewRequestData,
    CachedRequestData,
    SchedulerOutput,
    ModelRunnerOutput,
    RequestTiming,
    EngineCoreOutput,
    RequestSpec,
    PollResult,
]


# ---- strategies: the classes' own hints, plus the few types hypothesis cannot build alone -------------
@st.composite
def logprobs_batches(draw: st.DrawFn) -> LogprobsBatch:
    rows, width = draw(st.integers(0, 4)), draw(st.integers(1, 3))
    ids = draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=rows, max_size=rows))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    return LogprobsBatch(
        rng.integers(0, 100, (rows, width), dtype=np.int32),
        rng.standard_normal((rows, width)).astype(np.float32),
        rng.integers(1, 9, rows, dtype=np.int32),
        sorted(ids) if draw(st.booleans()) else None,
        rng.integers(-1, width, rows, dtype=np.int32) if draw(st.booleans()) else None,
    )


@st.composite
def logprob_windows(draw: st.DrawFn) -> Logprobs:
    batch = draw(logprobs_batches())
    start = draw(st.integers(0, len(batch)))
    stop = draw(st.integers(start, len(batch)))
    return Logprobs.window(batch, start, stop, draw(st.integers(1, int(batch.token_ids.shape[1]))))


sampling_params = st.builds(
    SamplingParams,
    temperature=st.floats(0.0, 2.0),
    top_k=st.integers(-1, 50),
    max_tokens=st.integers(1, 100),
    seed=st.none() | st.integers(0, 2**63 - 1),
    stop_token_ids=st.lists(st.integers(0, 1000), max_size=3),
    stop=st.none() | st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=2),
    logprobs=st.none() | st.integers(0, 5),
)


# Project types only: registering them for the whole test session is harmless.
st.register_type_strategy(SamplingParams, sampling_params)
st.register_type_strategy(LogprobsBatch, logprobs_batches())
st.register_type_strategy(Logprobs, logprob_windows())


# ---- comparison: arrays by value, floats with NaN equal to NaN, exact types ----------------------------
def same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, LogprobsBatch):
        return all(same(getattr(a, n), getattr(b, n)) for n in ("token_ids", "logprobs", "ranks", "req_ids", "ks"))
    if isinstance(a, Logprobs):
        return same(a.batch, b.batch) and (a.start, a.stop, a.width) == (b.start, b.stop, b.width)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


CARRIERS: dict[str, Callable[[Any], Any]] = {
    "tuple": lambda m: wire.decode(type(m), wire.encode(m)),
    "pickle5": lambda m: pickle.loads(pickle.dumps(m, protocol=5)),
    "cloudpickle": lambda m: cloudpickle.loads(cloudpickle.dumps(m)),
    "deepcopy": copy.deepcopy,
    "marshal": lambda m: wire.loads(type(m), wire.dumps(m)),
}


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("carrier", sorted(CARRIERS))
def test_every_message_survives_every_carrier(cls: type, carrier: str) -> None:
    roundtrip = CARRIERS[carrier]

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.from_type(cls))
    def check(msg: Any) -> None:
        back = roundtrip(msg)
        assert back is not msg and same(back, msg), (msg, back)

    check()


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_the_positional_form_is_the_fields_in_order(cls: type) -> None:
    @settings(max_examples=10, deadline=None)
    @given(st.from_type(cls))
    def check(msg: Any) -> None:
        t = wire.encode(msg)
        assert type(t) is tuple and len(t) == len(dataclasses.fields(cls))
        for f, v in zip(dataclasses.fields(cls), t, strict=True):
            value = getattr(msg, f.name)
            if not dataclasses.is_dataclass(value) and not isinstance(value, list):
                assert v is value  # plain values travel as they are, no copy

    check()


def test_marshal_carries_plain_messages_and_pickles_the_rest_beside() -> None:
    step = SchedulerOutput([], CachedRequestData(["r0"], [False], [None], [None], [5]), {"r0": 1}, 1, step_id=2)
    form = marshal.loads(wire.dumps(step))
    assert form[0] == wire.FIELDS and form[2] is None  # all plain: nothing pickled
    batch = LogprobsBatch(np.zeros((2, 2), np.int32), np.zeros((2, 2), np.float32), np.ones(2, np.int32), ["r0", "r0"])
    out = ModelRunnerOutput(["r0"], [[1, 2]], 2, batch, {"r0": Logprobs.window(batch, 0, 1, 2)})
    data = wire.dumps(out)
    form = marshal.loads(data)
    assert form[0] == wire.FIELDS and form[1][:3] == (["r0"], [[1, 2]], 2)  # the plain fields stay in marshal
    back = wire.loads(ModelRunnerOutput, data)
    assert back.prompt_logprobs["r0"].batch is back.logprobs  # one pickle beside: shared objects stay shared


@pytest.mark.parametrize(
    "edit",
    [
        lambda so: setattr(so, "step_id", np.int64(3)),
        lambda so: so.scheduled_cached_reqs.num_computed_tokens.__setitem__(0, np.int32(5)),
        lambda so: so.num_scheduled_tokens.__setitem__("r0", np.int64(1)),
        lambda so: so.scheduled_new_reqs[0].sampling_params.__setattr__("seed", np.int64(7)),
        lambda so: so.scheduled_new_reqs[0].block_ids[0].__setitem__(0, np.int64(9)),
        lambda so: setattr(so.scheduled_new_reqs[0], "prompt_token_ids", np.array([1, 2])),
    ],
)
def test_numpy_values_send_the_message_as_pickle(edit: Callable[[SchedulerOutput], None]) -> None:
    # marshal writes a numpy scalar or array as its raw bytes: such a message must go whole as pickle.
    new = NewRequestData("n", [1, 2], SamplingParams(seed=1), ([4], [5]), 0)
    so = SchedulerOutput([new], CachedRequestData(["r0"], [False], [None], [None], [5]), {"r0": 1}, 1)
    edit(so)
    data = wire.dumps(so)
    assert marshal.loads(data)[0] == wire.PICKLED
    assert same(wire.loads(SchedulerOutput, data), so)


def test_a_value_marshal_refuses_sends_the_message_as_pickle() -> None:
    # The check reads the first item of a list; a later one marshal cannot write at all is caught by marshal.
    cached = CachedRequestData(["r0", "r1"], [False, False], [None, None], [None, None], [1, Exception])
    so = SchedulerOutput([], cached, {}, 0)
    data = wire.dumps(so)
    assert marshal.loads(data)[0] == wire.PICKLED
    assert wire.loads(SchedulerOutput, data).scheduled_cached_reqs.num_computed_tokens == [1, Exception]


# ---- a field added to a message travels with no edit to the codec -------------------------------------
@dataclass(slots=True)
class DraftTokens:
    """A message the codec has never seen before, nested in one."""

    req_id: str
    token_ids: list[int]


@wire.message
@dataclass(slots=True)
class SchedulerOutputWithDrafts(SchedulerOutput):
    """SchedulerOutput with fields added after its last: as a new field of the contract would be."""

    drafts: list[DraftTokens] = field(default_factory=list)
    spec_step: int | None = None


def test_a_new_field_travels_with_no_edit_to_the_codec() -> None:
    cached = CachedRequestData()
    cached.add("r1", ([9],), 17)
    msg = SchedulerOutputWithDrafts([], cached, {"r1": 1}, 1, step_id=4)
    msg.drafts.append(DraftTokens("r1", [5, 6]))
    msg.spec_step = 3
    assert wire.encode(msg)[-2:] == ([("r1", [5, 6])], 3)  # nested as a tuple, in declaration order
    for name, roundtrip in CARRIERS.items():
        back = roundtrip(msg)
        assert type(back) is SchedulerOutputWithDrafts and back == msg, name
    assert marshal.loads(wire.dumps(msg))[0] == wire.FIELDS


@dataclass
class Node:
    value: int
    child: Node | None = None


def test_a_message_that_holds_itself_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="Node holds itself"):
        wire.encode(Node(1))


def test_local_only_fields_stay_behind_and_read_their_default() -> None:
    def make() -> LogprobsBatch:
        return LogprobsBatch(np.zeros((2, 3), np.int32), np.ones((2, 3), np.float32), np.ones(2, np.int32), ["a", "b"])

    batch = make()
    assert batch.span("b") == (1, 2) and batch.own_logprobs() == [1.0, 1.0]  # fills its caches
    assert len(wire.encode(batch)) == 5 and pickle.dumps(batch) == pickle.dumps(make())  # the caches stay behind
    for name, roundtrip in CARRIERS.items():
        back = roundtrip(batch)
        assert back.span("b") == (1, 2) and back.own_logprobs() == [1.0, 1.0] and same(back, batch), name


@dataclass
class CacheWithoutDefault:
    a: int
    cache: dict[str, int] = field(init=False, metadata=wire.LOCAL_ONLY)


def test_a_local_only_field_without_a_default_is_refused_by_name() -> None:
    msg = CacheWithoutDefault.__new__(CacheWithoutDefault)
    msg.a, msg.cache = 1, {}
    with pytest.raises(TypeError, match="CacheWithoutDefault.cache is LOCAL_ONLY: it needs a default"):
        wire.encode(msg)


@dataclass
class _RacedInner:
    x: int = 0


@dataclass
class _Raced:
    inner: _RacedInner = field(default_factory=_RacedInner)
    items: list[_RacedInner] = field(default_factory=list)


def test_two_threads_building_one_codec_neither_calls_it_a_cycle(monkeypatch):
    """A driver serves several clients on as many threads: the first two polls encode the reply type at
    once. The second thread waited for the first's codec; it used to see the class "being generated"
    and refuse it as a message that holds itself."""
    import threading

    entered, release = threading.Event(), threading.Event()
    build = wire._Codec._build

    def slow_build(self: Any, cls: type) -> None:
        if cls is _Raced:
            entered.set()
            release.wait(1.0)  # the other thread arrives while this one is in the middle of it
        build(self, cls)

    monkeypatch.setattr(wire._Codec, "_build", slow_build)
    msg = _Raced(_RacedInner(3), [_RacedInner(4)])
    errors: list[BaseException] = []

    def encode() -> None:
        try:
            assert wire.decode(_Raced, wire.encode(msg)) == msg
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    first = threading.Thread(target=encode)
    first.start()
    assert entered.wait(30)
    second = threading.Thread(target=encode)
    second.start()
    second.join(30)
    release.set()
    first.join(30)
    assert not errors, errors
