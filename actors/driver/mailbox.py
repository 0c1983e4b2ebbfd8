"""The driver's mailbox: where client calls and the step loop meet, under one condition variable.

Client calls (add_requests, abort, get_outputs, stats) run on Ray's actor threads and never wait for a
step: new requests and aborts wait in the inbox until the loop drains it before a step, and outputs wait
in an outbox until the client polls.

A driver may have several clients (the ingress replicas of `kvray serve` share the engine replicas; `kvray
run` and LLM are one client, DEFAULT_CLIENT). Each has its own outbox, made when it first submits or
polls: a request's outputs, timing and "returned" notice go only to the client that submitted it (its
RequestSpec.client_id), while the prefix cache's events go to every client. Each client's pending events
are bounded by MAX_PENDING_CACHE_EVENTS: past it (a client that stopped polling), or for a client new to
this driver, the next step hands it the whole cache instead (a reset), so that its index is whole.

The mailbox also keeps the books on every unfinished request (actors/driver/live_requests.py) and the
replica's state as the clients see it: up, waiting for resources to rebuild on (it refuses requests and
gives its live ones back), or down for good.

Thread-safe: every method takes the lock. The recovery (actors/driver/recovery.py) and the poison hunt
(actors/driver/poison.py) change the books through these methods only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from actors.driver.live_requests import LiveRequests
from actors.messages import DEFAULT_CLIENT, PollResult, RequestSpec, error_output
from kvcore.kv_cache.block_pool import CacheEvents
from kvcore.messages import EngineCoreOutput, RequestTiming
from kvcore.request import Request

MAX_PENDING_CACHE_EVENTS = 256  # steps' worth of cache events kept for a client that does not poll


@dataclass
class ClientOutbox:
    """What waits for one client's next poll."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    returned: list[str] = field(default_factory=list)  # its requests given back (see Mailbox.hand_back)
    cache_events: list[CacheEvents] = field(default_factory=list)
    # Its next events start with the whole cache: it is new here, or it fell too far behind.
    needs_snapshot: bool = True

    @property
    def has_news(self) -> bool:
        return bool(self.outputs or self.returned)


class Mailbox:
    def __init__(self) -> None:
        # Condition's default lock is re-entrant: a method may call another under it.
        self._cv = threading.Condition()
        self._inbox: list[RequestSpec] = []
        self._abort_inbox: list[str] = []
        self._clients: dict[str, ClientOutbox] = {}
        self._client_of: dict[str, str] = {}  # request id -> the client that submitted it, until it ends
        self._timings: dict[str, RequestTiming] = {}
        self._live = LiveRequests()
        self._fatal: str | None = None
        self._unavailable: str | None = None  # why, while it waits for resources to rebuild on
        self._stop = False
        self.peak_kv_usage = 0.0
        self.num_output_tokens = 0

    # ---- the client's side -------------------------------------------------------------------
    def submit(self, specs: list[RequestSpec], check: Callable[[RequestSpec], str | None]) -> list[str | None]:
        """Queue every spec that `check` passes (None); -> its refusal message or None, per spec. The
        check runs under the lock, so that two requests with one id cannot both pass."""
        errors: list[str | None] = []
        with self._cv:
            for spec in specs:
                err = check(spec)
                if err is None:
                    self._live.add(spec, time.monotonic())
                    self._inbox.append(spec)
                    self._client_of[spec.request_id] = spec.client_id
                    self._box(spec.client_id)
                errors.append(err)
            self._cv.notify_all()
        return errors

    def abort(self, request_ids: Iterable[str]) -> None:
        with self._cv:
            self._abort_inbox.extend(request_ids)
            self._cv.notify_all()

    def poll(self, timeout_s: float, client_id: str = DEFAULT_CLIENT) -> PollResult:
        """This client's outputs since its last poll; waits up to timeout_s for the first one (another
        client's outputs do not end the wait)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            box = self._box(client_id)
            while not box.has_news and self._fatal is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            out, box.outputs = box.outputs, []
            returned, box.returned = box.returned, []
            events, box.cache_events = box.cache_events, []
            for o in out:
                if o.finished and o.request_id in self._timings:
                    o.timing = self._timings.pop(o.request_id)
            return PollResult(out, self._fatal, returned, self._unavailable is None, events, len(self._live))

    @property
    def num_undelivered(self) -> int:
        """Outputs and "returned" notices that wait for a client's poll, every client's."""
        with self._cv:
            return sum(len(b.outputs) + len(b.returned) for b in self._clients.values())

    def forget_client(self, client_id: str) -> list[str]:
        """The client went away (an ingress replica stopped): its outbox goes, and what it still waits for
        is dropped from now on. -> its unfinished requests, for the caller to abort."""
        with self._cv:
            self._clients.pop(client_id, None)
            return [rid for rid, c in self._client_of.items() if c == client_id]

    @property
    def clients(self) -> list[str]:
        with self._cv:
            return list(self._clients)

    @property
    def fatal(self) -> str | None:
        """Why the replica is down for good; None while it is up."""
        with self._cv:
            return self._fatal

    @property
    def unavailable(self) -> str | None:
        """Why the replica refuses requests for now (it waits for resources); None while it takes them."""
        with self._cv:
            return self._unavailable

    def __contains__(self, rid: object) -> bool:
        """Whether the driver still answers for `rid` (accepted and not yet finished)."""
        with self._cv:
            return rid in self._live

    def __len__(self) -> int:
        with self._cv:
            return len(self._live)

    @property
    def num_replayed(self) -> int:
        with self._cv:
            return self._live.num_replayed

    # ---- the step loop's side ----------------------------------------------------------------
    def next_work(self, has_unfinished: Callable[[], bool]) -> tuple[list[RequestSpec], list[str]] | None:
        """Wait until there is something to do: new requests, aborts, or unfinished work in the engine
        (`has_unfinished`). -> (new requests, aborts), or None once `stop` was called."""
        with self._cv:
            while not self._stop and not self._inbox and not self._abort_inbox and not has_unfinished():
                self._cv.wait(0.5)
            if self._stop:
                return None
            new, self._inbox = self._inbox, []
            aborts, self._abort_inbox = self._abort_inbox, []
            return new, aborts

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    @property
    def stopping(self) -> bool:
        with self._cv:
            return self._stop

    def publish(
        self,
        outputs: list[EngineCoreOutput],
        kv_cache_usage: float,
        cache_events: CacheEvents | None = None,
        cached_keys: Callable[[], list[int]] | None = None,
    ) -> int:
        """One step's outputs to their clients' outboxes, their timings to the books, the prefix cache's
        changes to every client's events; -> the tokens they carry. `cached_keys` gives the whole cache,
        which replaces a client's pending events when it is new here or has not polled for
        MAX_PENDING_CACHE_EVENTS steps."""
        now = time.monotonic()
        new_tokens = 0
        with self._cv:
            self._add_cache_events(cache_events, cached_keys)
            for o in outputs:
                new_tokens += len(o.new_token_ids)
                self._book_timing(o.request_id, self._live.record(o, now))
                self._deliver(o)
            self.num_output_tokens += new_tokens
            self.peak_kv_usage = max(self.peak_kv_usage, kv_cache_usage)
            if outputs:
                self._cv.notify_all()
        return new_tokens

    def drop_replayed(
        self, outputs: list[EngineCoreOutput], abort: Callable[[list[str]], None]
    ) -> list[EngineCoreOutput]:
        """See LiveRequests.drop_replayed: tokens a restarted request regenerates are not published twice."""
        with self._cv:
            return self._live.drop_replayed(outputs, abort)

    def end(self, rid: str, output: EngineCoreOutput) -> None:
        """End one request here (the engine does not hold it, or no longer runs it) with `output`."""
        with self._cv:
            self._book_timing(rid, self._live.retire(rid, time.monotonic()))
            self._deliver(output)
            self._cv.notify_all()

    def finish_with_error(self, rid: str, message: str) -> None:
        self.end(rid, error_output(rid, message))

    def requeue(self, rid: str, add_request: Callable[[Request], None], eos_token_id: int | None) -> None:
        """Hand a live request to the engine again, by recompute (after a restart or a poison reset). One
        request that cannot be re-queued fails alone; the others go on."""
        try:
            with self._cv:
                request = self._live.restart(rid, eos_token_id)
            add_request(request)
        except Exception as e:  # noqa: BLE001 - its error output says why
            self.finish_with_error(rid, f"request {rid!r}: could not be re-queued after a worker restart: {e}")

    def waiting_in_engine(self) -> list[str]:
        """The live requests the engine holds or held: every live one not still in the inbox."""
        with self._cv:
            pending = {s.request_id for s in self._inbox}
            return [rid for rid in self._live.ids() if rid not in pending]

    def fail_all(self, message: str) -> None:
        """The replica is down for good: every live request ends with `message`, new ones are refused."""
        with self._cv:
            self._fatal = message
            for rid in self._live.clear():
                self._deliver(error_output(rid, message))
            self._inbox.clear()
            self._cv.notify_all()

    def hand_back(self, why: str) -> None:
        """The replica cannot run for now: every live request goes back to the client (which sends it to
        another replica), and new ones are refused with `why` until `resume`."""
        with self._cv:
            self._unavailable = why
            for rid in self._live.clear():
                box = self._clients.get(self._client_of.pop(rid, DEFAULT_CLIENT))
                if box is not None:
                    box.returned.append(rid)
            self._inbox.clear()
            self._cv.notify_all()

    def resume(self) -> bool:
        """The replica takes requests again; -> whether it had refused them."""
        with self._cv:
            was, self._unavailable = self._unavailable is not None, None
            return was

    def _book_timing(self, rid: str, timing: RequestTiming | None) -> None:
        if timing is not None:
            self._timings[rid] = timing

    # ---- the clients' outboxes (under the lock) ----------------------------------------------
    def _box(self, client_id: str) -> ClientOutbox:
        box = self._clients.get(client_id)
        if box is None:
            box = self._clients[client_id] = ClientOutbox()
        return box

    def _deliver(self, o: EngineCoreOutput) -> None:
        """To the outbox of the client that submitted the request. An output no client waits for (its
        request was given back, or its client is unknown here) is dropped, with its timing."""
        rid = o.request_id
        client = self._client_of.pop(rid, DEFAULT_CLIENT) if o.finished else self._client_of.get(rid, DEFAULT_CLIENT)
        box = self._clients.get(client)
        if box is None:
            self._timings.pop(rid, None)
            return
        box.outputs.append(o)

    def _add_cache_events(self, cache_events: CacheEvents | None, cached_keys: Callable[[], list[int]] | None) -> None:
        snapshot: CacheEvents | None = None
        for box in self._clients.values():
            if cached_keys is not None and (box.needs_snapshot or len(box.cache_events) >= MAX_PENDING_CACHE_EVENTS):
                if snapshot is None:  # one walk of the cache for every client that needs it
                    snapshot = CacheEvents(stored=cached_keys(), reset=True)
                box.cache_events = [snapshot]  # the whole cache after this step: this step's events included
                box.needs_snapshot = False
            elif cache_events is not None:
                box.cache_events.append(cache_events)
