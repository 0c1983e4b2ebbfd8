"""The ingress's gathered submissions (cluster/serve/submissions.py), without Ray: one call carries
every request taken while the previous one was out, answers split back per request, withdrawal."""

from __future__ import annotations

import asyncio

from actors.messages import RequestSpec
from cluster.serve.submissions import SubmitBatcher
from kvcore.request import SamplingParams


def _specs(*ids: str) -> list[RequestSpec]:
    return [RequestSpec(i, [1, 2, 3], SamplingParams(max_tokens=1)) for i in ids]


class FakeDriver:
    """add_requests: refuses ids starting with 'bad'; each call waits until released."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.gate = asyncio.Event()

    async def send(self, specs: list[RequestSpec]) -> list[str | None]:
        self.calls.append([s.request_id for s in specs])
        await self.gate.wait()
        return [f"refused {s.request_id}" if s.request_id.startswith("bad") else None for s in specs]


def test_requests_gather_while_a_call_is_out_and_answers_split_back():
    async def run() -> tuple[list[list[str]], list[list[str | None]]]:
        d = FakeDriver()
        b = SubmitBatcher(d.send)
        first = b.add(_specs("a"))
        await asyncio.sleep(0)  # the first leaves alone on the next tick
        rest = [b.add(_specs("b", "bad-c")), b.add(_specs("d")), b.add(_specs("bad-e"))]
        await asyncio.sleep(0.01)
        assert d.calls == [["a"]]  # the rest wait for the call in flight
        d.gate.set()
        answers = [await first] + [await f for f in rest]
        return d.calls, answers

    calls, answers = asyncio.run(run())
    assert calls == [["a"], ["b", "bad-c", "d", "bad-e"]]
    assert answers == [[None], [None, "refused bad-c"], [None], ["refused bad-e"]]


def test_a_request_withdrawn_before_its_batch_left_never_reaches_the_driver():
    async def run() -> tuple[list[list[str]], bool, bool]:
        d = FakeDriver()
        b = SubmitBatcher(d.send)
        first = b.add(_specs("a"))
        await asyncio.sleep(0)
        gone, kept = b.add(_specs("gone")), b.add(_specs("kept"))
        took_back = b.withdraw(gone)
        gone.cancel()
        d.gate.set()
        await first, await kept
        return d.calls, took_back, b.withdraw(first)

    calls, took_back, sent_back = asyncio.run(run())
    assert calls == [["a"], ["kept"]]
    assert took_back and not sent_back  # a request already sent cannot be withdrawn


def test_without_gathering_every_request_is_its_own_call():
    async def run() -> list[list[str]]:
        d = FakeDriver()
        d.gate.set()
        b = SubmitBatcher(d.send, gather=False)
        await asyncio.gather(*(b.add(_specs(i)) for i in ("a", "b", "c")))
        return d.calls

    assert asyncio.run(run()) == [["a"], ["b"], ["c"]]


def test_a_failed_call_fails_every_request_of_its_batch():
    async def run() -> list[str]:
        async def send(specs: list[RequestSpec]) -> list[str | None]:
            raise RuntimeError("driver gone")

        b = SubmitBatcher(send)
        futs = [b.add(_specs(i)) for i in ("a", "b")]
        out = []
        for f in futs:
            try:
                await f
            except RuntimeError as e:
                out.append(str(e))
        return out

    assert asyncio.run(run()) == ["driver gone", "driver gone"]
