"""The shm transport's wire (actors/transport/codec.py over kvcore/wire.py's marshal form): every field of a
step and of an answer survives encode -> decode, in the marshal form and in the pickle fallback (a value
marshal would write unfaithfully), with logprob rows (arrays, pickled beside the tuple) and for every kind of
answer (rank 0's output, another rank's None, a step error)."""

from __future__ import annotations

import marshal

import numpy as np

from actors.transport.codec import decode_answer, decode_step, encode_answer, encode_step
from kvcore import wire
from kvcore.logprob_rows import Logprobs, LogprobsBatch
from kvcore.messages import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from kvcore.request import SamplingParams


def steps() -> list[SchedulerOutput]:
    new = NewRequestData("r0", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.5, seed=3), ([4, 5], [6]), 2)
    cached = CachedRequestData()
    cached.add("r1", ([9], []), 17)
    cached.add("r2", None, 40, resumed_token_ids=[1, 2, 3])
    full = SchedulerOutput([new], cached, {"r0": 1, "r1": 1, "r2": 3}, 5, {"gone"}, {"out"}, step_id=11)
    decode = CachedRequestData()
    decode.add_running_rows({f"r{i}": 1 for i in range(32)}, [(3, ([77],))])
    decode.num_computed_tokens.extend(range(100, 132))
    steady = SchedulerOutput([], decode, {f"r{i}": 1 for i in range(32)}, 32, set(), set(), step_id=12)
    bare = SchedulerOutput([], CachedRequestData(), {}, 0)
    return [full, steady, bare]


def test_every_field_of_a_step_survives():
    for so in steps():
        data = encode_step(so)
        assert marshal.loads(data)[0] == wire.FIELDS  # the marshal form, not the fallback
        back = decode_step(data)
        assert type(back) is SchedulerOutput and back == so
        # Tuples stay tuples (a request's block ids per group), lists lists.
        assert [type(b) for b in back.scheduled_cached_reqs.new_block_ids] == [
            type(b) for b in so.scheduled_cached_reqs.new_block_ids
        ]
        assert decode_step(memoryview(data)) == so  # straight from a buffer too


def test_numpy_values_go_as_pickle_not_as_marshal_bytes():
    # marshal would write a numpy scalar as its raw bytes: such a message must take the pickle path.
    assert marshal.loads(marshal.dumps(np.int64(3))) == b"\x03" + bytes(7)
    for edit in (
        lambda so: so.scheduled_cached_reqs.num_computed_tokens.__setitem__(0, np.int64(100)),
        lambda so: so.num_scheduled_tokens.__setitem__("r0", np.int64(1)),
        lambda so: so.scheduled_cached_reqs.new_block_ids.__setitem__(3, (list(np.array([77])),)),
        lambda so: setattr(so, "step_id", np.int64(12)),
    ):
        so = steps()[1]
        edit(so)
        data = encode_step(so)
        assert marshal.loads(data)[0] == wire.PICKLED
        back = decode_step(data)
        assert back == so and type(back.step_id) is type(so.step_id)
    for out in (
        ModelRunnerOutput(["r0", "r1"], [[], list(np.array([5, 6]))], step_id=3),
        ModelRunnerOutput(["r0"], [[5]], step_id=3, cudagraph=np.bool_(True)),
        ModelRunnerOutput(list(np.array(["r0"])), [[5]], step_id=3),
    ):
        data = encode_answer(True, out)
        assert marshal.loads(data)[0] == wire.PICKLED
        ok, back = decode_answer(data)
        assert ok and back == out and type(back.sampled_token_ids[-1][0]) is type(out.sampled_token_ids[-1][0])


def test_every_kind_of_answer_survives():
    out = ModelRunnerOutput(["r0", "r1"], [[7], []], step_id=11, cudagraph=True)
    assert decode_answer(encode_answer(True, out)) == (True, out)
    assert decode_answer(encode_answer(True, ModelRunnerOutput([], []))) == (True, ModelRunnerOutput([], []))
    assert decode_answer(encode_answer(True, None)) == (True, None)
    assert decode_answer(encode_answer(False, ("ValueError('boom')", True))) == (False, ("ValueError('boom')", True))


def test_logprob_rows_travel_with_the_answer_and_keep_sharing_their_batch():
    rng = np.random.default_rng(0)
    batch = LogprobsBatch(
        rng.integers(0, 100, (3, 4), dtype=np.int32),
        rng.standard_normal((3, 4)).astype(np.float32),
        np.array([1, 2, 3], dtype=np.int32),
        ["r0", "r0", "r1"],
        np.array([3, 3, -1], dtype=np.int32),
    )
    prompt = {"r0": Logprobs.window(batch, 0, 2, 4)}
    out = ModelRunnerOutput(["r0", "r1"], [[1, 2], [3]], step_id=4, logprobs=batch, prompt_logprobs=prompt)
    ok, back = decode_answer(encode_answer(True, out))
    assert ok and back.req_ids == out.req_ids and back.sampled_token_ids == out.sampled_token_ids
    assert back.step_id == 4 and back.cudagraph is False
    for name in ("token_ids", "logprobs", "ranks", "ks"):
        np.testing.assert_array_equal(getattr(back.logprobs, name), getattr(batch, name))
    assert back.logprobs.req_ids == batch.req_ids
    window = back.prompt_logprobs["r0"]
    assert window.batch is back.logprobs  # one batch, as it was sent
    np.testing.assert_array_equal(window.token_ids, prompt["r0"].token_ids)
