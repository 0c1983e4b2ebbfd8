"""The streaming path's pure parts, without Ray: the SSE chunk encoding (the same JSON as json.dumps),
a request's inbox, serve.stream_interval's grouping of tokens into chunks, and serve.single_event_loop's
settings for Serve's processes."""

import asyncio
import json
import os
import selectors
from types import SimpleNamespace

import pytest

from cluster.config import load_config
from cluster.serve import generation
from cluster.serve.app import PROXY_ONE_LOOP, REPLICA_ONE_LOOP, deployment_options, proxy_env
from cluster.serve.engine_client import Inbox
from cluster.serve.generation import ChoiceDelta, Generation
from cluster.serve.responses import ChunkWriter, to_json
from kvcore.messages import EngineCoreOutput
from kvcore.request import SamplingParams


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        'a"b\\\n\t\u2028é\ud800 ☃',
        0,
        -7,
        True,
        False,
        [],
        [1, 2, 3],
        [1, "x"],
        1.5,
        float("-inf"),
        {"a": [1, {"b": None}], "c": -0.25, "d": True},
        {"top": {"x": -1.0}},
    ],
)
def test_to_json_writes_what_json_dumps_writes(value):
    assert to_json(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@pytest.mark.parametrize("chat", [False, True])
def test_a_chunk_is_the_openai_chunk_object(chat):
    w = ChunkWriter("cmpl-1", 'm"1', chat, 2, include_usage=True, return_token_ids=True)
    chunk = w.deltas([ChoiceDelta(0, "hé", [5, 6], None), ChoiceDelta(1, "", [], None, "length")])
    assert chunk.startswith("data: ") and chunk.endswith("\n\n")
    obj = json.loads(chunk[6:])
    head = {
        "id": "cmpl-1",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": w.created,
        "model": 'm"1',
        "usage": None,
    }
    assert {k: v for k, v in obj.items() if k != "choices"} == head
    first, second = obj["choices"]
    if chat:
        assert first["delta"] == {"role": "assistant", "content": "hé"} and second["finish_reason"] == "length"
    else:
        assert first["text"] == "hé" and first["stop_reason"] is None and second["finish_reason"] == "length"
    assert first["token_ids"] == [5, 6] and first["logprobs"] is None
    assert json.loads(w.usage(3, 4)[6:])["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_the_inbox_hands_over_everything_in_order_and_waits_when_empty():
    async def run():
        box = Inbox()
        box.put_nowait(EngineCoreOutput("a", [1]))
        box.put_nowait(EngineCoreOutput("a", [2]))
        first = await box.take_all()
        waiting = asyncio.ensure_future(box.take_all())
        await asyncio.sleep(0)
        assert not waiting.done()
        box.put_nowait(EngineCoreOutput("a", [3]))
        return first, await asyncio.wait_for(waiting, 5)

    first, second = asyncio.run(run())
    assert [o.new_token_ids for o in first] == [[1], [2]] and [o.new_token_ids for o in second] == [[3]]


class FakeClient:
    def __init__(self):
        self.aborted, self.closed = [], []

    async def submit(self, specs, queue):
        return 0, {}

    def abort(self, ids):
        self.aborted += ids

    def close(self, ids):
        self.closed += ids


def stream_chunks(interval: int, num_tokens: int, n: int = 1) -> list[list[ChoiceDelta]]:
    """The deltas a stream yields when the engine sends one token a step (every choice each step)."""

    async def run():
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=num_tokens, n=n, seed=1)
        gen = Generation(FakeClient(), None, "cmpl-x", None, [1, 2, 3], sp, stream_interval=interval)
        await gen.start()
        got = []

        async def read():
            async for deltas in gen.deltas():
                got.append(deltas)

        reader = asyncio.ensure_future(read())
        for step in range(num_tokens):
            last = step == num_tokens - 1
            for spec in gen.specs:
                gen.queue.put_nowait(
                    EngineCoreOutput(
                        spec.request_id, [100 + step], finished=last, finish_reason="length" if last else None
                    )
                )
            await asyncio.sleep(0)  # the reader takes each step's outputs alone
        await asyncio.wait_for(reader, 5)
        return got

    return asyncio.run(run())


def test_stream_interval_one_sends_every_step():
    chunks = stream_chunks(1, 6)
    assert [[t for d in c for t in d.token_ids] for c in chunks] == [[100 + k] for k in range(6)]
    assert chunks[-1][0].finish_reason == "length"


@pytest.mark.parametrize("n", [1, 2])
def test_stream_interval_groups_tokens_first_and_last_at_once(n):
    chunks = stream_chunks(4, 10, n)
    per_choice = [[d.token_ids for c in chunks for d in c if d.index == k] for k in range(n)]
    for tokens in per_choice:
        assert tokens == [[100], [101, 102, 103, 104], [105, 106, 107, 108], [109]]  # nothing lost or repeated
    assert all(d.finish_reason == "length" for d in chunks[-1])


def test_single_event_loop_sets_serves_switches_and_leaves_the_environment_as_it_was():
    off = load_config("configs/local.yaml")  # the default: Serve's own threads
    on = off.replace(single_event_loop=True)
    assert deployment_options(on)["ray_actor_options"]["runtime_env"] == {"env_vars": REPLICA_ONE_LOOP}
    assert "runtime_env" not in deployment_options(off)["ray_actor_options"]
    before = dict(os.environ)
    with proxy_env(on):
        assert all(os.environ.get(k) == v for k, v in PROXY_ONE_LOOP.items())
    with proxy_env(off):
        assert all(k not in os.environ for k in PROXY_ONE_LOOP) or all(k in before for k in PROXY_ONE_LOOP)
    assert dict(os.environ) == before


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when every task waits, then straight to the next timer: the
    stream-batching tests see the same windows whatever the machine's load (they flaked on wall time)."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self.now


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self.loop = loop

    def select(self, timeout=None):
        events = super().select(0)
        if not events and timeout:  # nothing to do before the next timer: jump to it
            self.loop.now += timeout
        return events


def run_virtual(make_coro):
    """make_coro(loop)'s result, on a VirtualTimeLoop that is also the streams' time.monotonic."""
    loop = VirtualTimeLoop()
    real_time = generation.time
    generation.time = SimpleNamespace(monotonic=loop.time)  # type: ignore[assignment]
    try:
        return loop.run_until_complete(make_coro(loop))
    finally:
        generation.time = real_time
        loop.close()


def batched_stream(
    window_s: float, num_tokens: int, step_s: float, wakeups: list[int] | None = None
) -> list[tuple[float, list[int], str | None]]:
    """(time since start, tokens, finish_reason) of each chunk when the engine sends a token every step_s
    (virtual time); `wakeups` gets the number of times the stream took outputs from its inbox."""

    async def run(loop):
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=num_tokens, seed=1)
        gen = Generation(FakeClient(), None, "cmpl-b", None, [1, 2, 3], sp, stream_batching_s=window_s)
        await gen.start()
        take_all, calls = gen.queue.take_all, [0]

        async def counted(*a, **k):
            calls[0] += 1
            return await take_all(*a, **k)

        gen.queue.take_all = counted  # type: ignore[method-assign]
        t0, got = loop.time(), []

        async def read():
            async for deltas in gen.deltas():
                got.append((loop.time() - t0, deltas[0].token_ids, deltas[0].finish_reason))

        reader = asyncio.ensure_future(read())
        for step in range(num_tokens):
            last = step == num_tokens - 1
            gen.queue.put_nowait(
                EngineCoreOutput(
                    gen.specs[0].request_id, [100 + step], finished=last, finish_reason="length" if last else None
                )
            )
            await asyncio.sleep(step_s)
        await asyncio.wait_for(reader, 5)
        if wakeups is not None:
            wakeups.append(calls[0])
        return got

    return run_virtual(run)


def test_stream_batching_window_first_token_at_once_then_one_chunk_a_window():
    chunks = batched_stream(window_s=0.05, num_tokens=40, step_s=0.005)
    assert [t for _, toks, _ in chunks for t in toks] == [100 + k for k in range(40)]  # nothing lost or repeated
    assert chunks[0][1] == [100] and chunks[0][0] == 0.0  # the first token does not wait for a window
    assert chunks[-1][2] == "length"
    # 0.2 s of tokens in 50 ms windows: a chunk a window, not one a token (40).
    # Consecutive chunks up to the last (which ends the stream, off the window): a shifted, shorter side.
    gaps = [b[0] - a[0] for a, b in zip(chunks, chunks[1:-1], strict=False)]
    assert all(abs(g - 0.05) < 1e-9 for g in gaps), gaps
    assert len(chunks) <= 6, [len(t) for _, t, _ in chunks]


def test_stream_batching_sleeps_through_the_window_and_an_end_closes_it():
    wakeups: list[int] = []
    chunks = batched_stream(window_s=0.05, num_tokens=40, step_s=0.005, wakeups=wakeups)
    # One take for the first token, then about one a window (the end may take one more), never one a step:
    # the stream sleeps through the steps in between.
    assert len(chunks) <= 6 and wakeups[0] <= len(chunks) + 1, (wakeups, [len(t) for _, t, _ in chunks])
    # A 10 s window: the end goes out as soon as it is there, not when the window closes.
    chunks = batched_stream(window_s=10.0, num_tokens=5, step_s=0.005)
    assert [toks for _, toks, _ in chunks] == [[100], [101, 102, 103, 104]] and chunks[-1][2] == "length"
    assert chunks[-1][0] < 0.05, chunks


def test_stream_batching_zero_sends_every_step():
    chunks = batched_stream(window_s=0.0, num_tokens=6, step_s=0.002)
    assert [toks for _, toks, _ in chunks] == [[100 + k] for k in range(6)]


def test_stream_batching_ms_bounds():
    assert load_config("configs/local.yaml").serve.stream_batching_ms == 50.0
    for bad in (-1, 20_000):
        with pytest.raises(Exception, match="stream_batching_ms"):
            load_config("configs/local.yaml", {"serve.stream_batching_ms": bad})


def test_stream_interval_must_be_positive():
    with pytest.raises(Exception, match="stream_interval"):
        load_config("configs/local.yaml", {"serve.stream_interval": 0})
