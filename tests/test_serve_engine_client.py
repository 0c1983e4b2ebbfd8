"""The serve engine client over stand-in drivers (no Ray): what happens to in-flight requests when a
replica cannot go on. They move to another replica as continuations (the prompt as sent, the tokens
delivered so far as outputs) and their inbox goes on; with no replica left they end at once with an
error output (issue 38, item 2: requests handed back never hang); a settled request (aborted) is only
released; a poll call cancelled from outside does not take a healthy replica down."""

import asyncio
from typing import Any

import pytest
from ray.exceptions import RayActorError, TaskCancelledError

from actors.messages import PollResult, RequestSpec, error_output
from cluster.config import load_config
from cluster.serve.engine_client import AsyncEngineClient, Inbox, Overloaded
from kvcore.messages import EngineCoreOutput
from kvcore.request import SamplingParams


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeDriver:
    """add_requests accepts all; get_outputs hands out what the test queued (a PollResult or an error)."""

    def __init__(self) -> None:
        self.added: list[RequestSpec] = []
        self.aborted: list[str] = []
        self.polls: asyncio.Queue = asyncio.Queue()
        self.add_requests = _Method(self._add)
        self.get_outputs = _Method(self._get)
        self.abort = _Method(self.aborted.extend)
        self.released: list[str] = []
        self.release_client = _Method(self.released.append)

    async def _add(self, specs: list[RequestSpec]) -> list[str | None]:
        self.added.extend(specs)
        return [None] * len(specs)

    async def _get(self, timeout_s: float, client_id: str = "") -> PollResult:
        item = await self.polls.get()
        if isinstance(item, BaseException):
            raise item
        return item


class FakeGroup:
    def __init__(self, config: Any, n: int) -> None:
        self.config = config
        self.drivers = [FakeDriver() for _ in range(n)]
        self.info = {"num_blocks": 64, "max_model_len": 256}

    def shutdown(self) -> None:
        pass


def _client(n: int) -> tuple[AsyncEngineClient, FakeGroup]:
    config = load_config("configs/local.yaml", {"parallel.data_parallel_size": n, "serve.prefix_affinity": False})
    group = FakeGroup(config, n)
    return AsyncEngineClient(config, group.info, group.drivers), group


def out(rid: str, toks: list[int], finished: bool = False) -> EngineCoreOutput:
    return EngineCoreOutput(rid, toks, finished=finished, finish_reason="length" if finished else None)


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


SEEDED = SamplingParams(temperature=0.8, seed=3, max_tokens=10, prompt_logprobs=1)


async def _start(client: AsyncEngineClient, rid: str, inbox: Inbox) -> int:
    r, refused = await client.submit([RequestSpec(rid, [1, 2, 3], SEEDED)], inbox)
    assert not refused
    return r


def test_requests_handed_back_move_on_with_what_was_delivered():
    async def run():
        client, group = _client(2)
        inbox = Inbox()
        r = await _start(client, "a", inbox)
        d, other = group.drivers[r], group.drivers[1 - r]
        d.polls.put_nowait(PollResult([out("a", [7]), out("a", [8, 9])]))
        await _settle()
        d.polls.put_nowait(PollResult([], returned=["a"], available=False))
        await _settle()
        # The continuation: same id and prompt, the delivered tokens as outputs, no second prompt logprobs.
        (moved,) = other.added
        assert (moved.request_id, moved.prompt_token_ids, moved.output_token_ids) == ("a", [1, 2, 3], [7, 8, 9])
        # Sent and moved under this ingress's client id: its outputs reach this ingress's outbox there.
        assert d.added[0].client_id == moved.client_id == client.client_id != ""
        assert moved.sampling_params.prompt_logprobs is None and moved.sampling_params.seed == 3
        assert moved.sampling_params.max_tokens == 10  # counted from the first output, which it has
        assert client.owner["a"] == 1 - r and client.num_migrations == 1
        assert not client.books[r].available  # a rebuilding replica takes no new request
        other.polls.put_nowait(PollResult([out("a", [4], finished=True)]))
        await _settle()
        got = await inbox.take_all(0)
        assert [o.new_token_ids for o in got] == [[7], [8, 9], [4]] and got[-1].finished and not got[-1].error
        assert "a" not in client.owner and len(client.flights) == 0
        client.shutdown()
        assert other.released == [client.client_id]  # it leaves the drivers: nothing piles up for it

    asyncio.run(run())


def test_requests_handed_back_with_no_replica_left_end_at_once_with_an_error():
    async def run():
        client, group = _client(1)
        inbox = Inbox()
        await _start(client, "a", inbox)
        group.drivers[0].polls.put_nowait(PollResult([out("a", [7])], returned=["a"], available=False))
        got = []
        while not any(o.finished for o in got):
            got += await asyncio.wait_for(inbox.take_all(), 10)
        assert got[-1].error and "handed its requests back" in got[-1].error
        assert client.books[0].outstanding == 0
        client.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize("how", ["fatal", "death"])
def test_a_replica_that_fails_for_good_hands_its_streams_on(how):
    async def run():
        client, group = _client(2)
        inbox = Inbox()
        r = await _start(client, "a", inbox)
        d, other = group.drivers[r], group.drivers[1 - r]
        d.polls.put_nowait(PollResult([out("a", [7])]))
        await _settle()
        if how == "fatal":  # past its restart budget: the driver's error outputs must not reach the stream
            why = f"engine replica {r} failed: WorkerFailure: gone"
            d.polls.put_nowait(PollResult([error_output("a", why)], fatal=why))
        else:
            d.polls.put_nowait(RayActorError())
        await _settle()
        (moved,) = other.added
        assert moved.output_token_ids == [7] and client.books[r].down is not None
        other.polls.put_nowait(PollResult([out("a", [5], finished=True)]))
        await _settle()
        got = await inbox.take_all(0)
        assert [o.new_token_ids for o in got] == [[7], [5]] and not any(o.error for o in got)
        assert client.books[r].migrated_away == 1
        client.shutdown()

    asyncio.run(run())


def test_a_settled_request_is_released_not_moved():
    async def run():
        client, group = _client(2)
        inbox = Inbox()
        r = await _start(client, "a", inbox)
        client.abort(["a"])  # a stop string ended it on the client side
        group.drivers[r].polls.put_nowait(RayActorError())
        await _settle()
        assert group.drivers[1 - r].added == [] and "a" not in client.owner
        assert client.books[r].outstanding == 0 and client.num_migrations == 0
        client.shutdown()

    asyncio.run(run())


def test_a_poll_cancelled_from_outside_keeps_polling():
    async def run():
        client, group = _client(1)
        inbox = Inbox()
        await _start(client, "a", inbox)
        d = group.drivers[0]
        d.polls.put_nowait(TaskCancelledError())
        d.polls.put_nowait(PollResult([out("a", [1], finished=True)]))
        got = await asyncio.wait_for(inbox.take_all(), 10)
        assert got[0].finished and not got[0].error and client.books[0].down is None
        client.shutdown()

    asyncio.run(run())


def test_a_request_whose_batch_waits_when_its_replica_fails_moves_with_the_rest():
    async def run():
        client, group = _client(2)
        inbox = Inbox()
        r = await _start(client, "a", inbox)
        other = group.drivers[1 - r]
        # "b" is routed to r; r's driver dies before b's batch leaves (the batcher has a call in flight).
        client.books[1 - r].available = False
        client.books[r].available = True
        pending = asyncio.ensure_future(client.submit([RequestSpec("b", [4, 5], SEEDED)], Inbox()))
        await asyncio.sleep(0)
        client.books[1 - r].available = True
        client.replica_down(r, f"the driver actor of engine replica {r} died")
        got_r, refused = await pending
        assert not refused  # moved on, not refused
        assert [s.request_id for s in group.drivers[r].added] == ["a"]  # b's batch found r down
        assert sorted(s.request_id for s in other.added) == ["a", "b"]
        assert client.owner == {"a": 1 - r, "b": 1 - r} and client.books[1 - r].outstanding == 2
        assert client.books[r].outstanding == 0
        client.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize("move_running", [False, True])
def test_a_draining_replica_takes_nothing_new_and_drops_nothing(move_running):
    async def run():
        client, group = _client(2)
        client.books[1].available = False  # both requests go to replica 0
        running, waiting = Inbox(), Inbox()
        assert await _start(client, "run", running) == 0
        assert await _start(client, "wait", waiting) == 0
        client.books[1].available = True
        d0, d1 = group.drivers
        d0.polls.put_nowait(PollResult([out("run", [7])]))
        await _settle()
        moved = client.drain(0, move_running=move_running)
        await _settle()
        expect = ["run", "wait"] if move_running else ["wait"]
        assert moved == len(expect) and sorted(s.request_id for s in d1.added) == expect
        assert sorted(d0.aborted) == expect  # replica 0 lets them go
        assert await _start(client, "new", Inbox()) == 1  # nothing new for a draining replica
        # What replica 0 still sends for a request that moved is dropped; its own finish normally.
        d0.polls.put_nowait(PollResult([out("run", [8], finished=not move_running), out("wait", [], True)]))
        d1.polls.put_nowait(PollResult([out("wait", [1], finished=True)]))
        if move_running:
            d1.polls.put_nowait(PollResult([out("run", [8], finished=True)]))
        await _settle()
        assert [o.new_token_ids for o in await running.take_all(0)] == [[7], [8]]
        assert [o.new_token_ids for o in await waiting.take_all(0)] == [[1]]
        assert client.drained(0) and not client.drained(1)
        client.shutdown()

    asyncio.run(run())


def test_a_request_moved_off_a_draining_replica_before_its_batch_left_is_not_sent_there():
    async def run():
        client, group = _client(2)
        client.books[1].available = False
        pending = asyncio.ensure_future(client.submit([RequestSpec("w", [4, 5], SEEDED)], Inbox()))
        await asyncio.sleep(0)  # routed to replica 0, its batch not gone yet
        client.books[1].available = True
        assert client.drain(0) == 1
        r, refused = await pending
        await _settle()
        assert r == 0 and not refused
        assert group.drivers[0].added == [] and [s.request_id for s in group.drivers[1].added] == ["w"]
        client.shutdown()

    asyncio.run(run())


def test_the_other_ingresses_load_on_a_replica_counts_against_its_bound():
    """Several ingress replicas share a driver: its poll says how many requests it holds in all, and
    the bound (max_num_seqs + max_queued_requests) counts the others' too."""

    async def run():
        client, group = _client(2)
        cap = client.capacity
        a = Inbox()
        r = await _start(client, "a", a)
        # Replica r is full with other ingresses' requests (its own "a" among those it counts).
        group.drivers[r].polls.put_nowait(PollResult([], num_live=cap))
        group.drivers[1 - r].polls.put_nowait(PollResult([], num_live=cap - 1))
        await _settle()
        assert client.books[r].load == cap and client.books[1 - r].load == cap - 1
        assert await _start(client, "b", Inbox()) == 1 - r  # the one place left
        with pytest.raises(Overloaded):
            await client.submit([RequestSpec("c", [1, 2, 3], SEEDED)], Inbox())
        client.shutdown()

    asyncio.run(run())
