"""One engine replica's submissions, gathered: one `add_requests` actor call carries every request the
ingress took since the last call went out.

At saturation every HTTP request crossed ingress -> driver as its own actor call: a cloudpickle of its
specs and an actor-call round trip in the ingress (the busiest process of the serving path), and an
actor-call thread in the driver, whose GIL the step loop needs. Here a request joins the pending
batch; the batch leaves on the next event-loop tick if no call to the replica is in flight, else when
the call in flight returns (so under load one call carries many requests, and when idle a request
waits for no one). The driver's answer (a refusal per spec, or its death) is split back per request.

A request cancelled before its batch left (the client went away) is withdrawn: it never reaches the
driver, so there is nothing to abort.
"""

from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from actors.messages import RequestSpec

# Sends one batch to the replica -> one refusal (or None) per spec; it never raises (the engine client
# turns a dead driver into refusals).
SendBatch = Callable[[list[RequestSpec]], Awaitable[list[str | None]]]


@dataclass
class _Entry:
    specs: list[RequestSpec]
    future: asyncio.Future[list[str | None]]


@dataclass
class SubmitBatcher:
    send: SendBatch
    gather: bool = True  # False: every request is its own call at once (serve.batch_submissions off)
    _pending: list[_Entry] = field(default_factory=list)
    _in_flight: int = 0
    _scheduled: bool = False
    # The loop keeps only weak references to tasks: without these, a call in flight could be collected.
    _calls: set[asyncio.Task[None]] = field(default_factory=set)
    num_calls: int = 0

    def add(self, specs: list[RequestSpec]) -> asyncio.Future[list[str | None]]:
        """Queue one request's specs; the future gets their refusals once the driver answered."""
        loop = asyncio.get_running_loop()
        entry = _Entry(specs, loop.create_future())
        if not self.gather:
            self._start([entry])
            return entry.future
        self._pending.append(entry)
        self._schedule()
        return entry.future

    def withdraw(self, future: asyncio.Future[list[str | None]]) -> bool:
        """Take back a request whose batch has not left -> whether it was still pending."""
        for k, entry in enumerate(self._pending):
            if entry.future is future:
                del self._pending[k]
                return True
        return False

    def _schedule(self) -> None:
        if not self._scheduled and self._in_flight == 0 and self._pending:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        batch, self._pending = [e for e in self._pending if not e.future.done()], []
        if batch:
            self._start(batch)

    def _start(self, batch: list[_Entry]) -> None:
        self._in_flight += 1
        self.num_calls += 1
        # Detached from the request that happened to start it: the call carries other requests' specs too,
        # and Ray cancels the actor calls a cancelled request task made (a client that left).
        task = asyncio.get_running_loop().create_task(self._call(batch), context=contextvars.Context())
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _call(self, batch: list[_Entry]) -> None:
        try:
            errs = await self.send([s for e in batch for s in e.specs])
            k = 0
            for e in batch:
                n = len(e.specs)
                if not e.future.done():
                    e.future.set_result(errs[k : k + n])
                k += n
        except BaseException as exc:  # shutdown cancels it: every waiter must wake
            for e in batch:
                if not e.future.done():
                    e.future.set_exception(exc if isinstance(exc, Exception) else RuntimeError("engine client closed"))
            if not isinstance(exc, Exception):
                raise
        finally:
            self._in_flight -= 1
            self._schedule()
