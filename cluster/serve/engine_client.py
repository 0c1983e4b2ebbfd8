"""The server's asyncio side of the engine replicas: their driver actors, driven without blocking.

The engine replicas are shared by every ingress replica and live beyond any of them
(cluster/serve/engine_replica.py); the fleet (cluster/serve/fleet.py) publishes which are up and which
drain, and a watch task keeps this client in step with it: a replica that joins gets a poll task and takes
requests, one that drains takes none and its requests that have no token yet move now (`drain`), one
that left is gone. This client is one of each driver's clients: its own outbox there (`client_id`),
which only its poll task reads. One poll task per replica awaits `get_outputs` (the driver answers as
soon as a step produced something, so tokens stream step by step) and hands each output to the queue of
the request that owns it. Submission picks a replica with the router, within each replica's bound
(scheduler.max_num_seqs + serve.max_queued_requests engine requests: this ingress's outstanding ones plus
the other ingresses', as the driver's last poll counted them); when
none has room it raises Overloaded (503). An output that finishes a request frees its slot, so the count
is what the engine still holds, aborts included (their echo is the finished output).

The poll tasks and the submission calls belong to the ingress, not to the request that happened to
start them: they run detached from its context, so a client that leaves (Ray then cancels the actor
calls its request task made) cannot cancel another replica's poll or another request's submission.

A replica that cannot go on (its driver died, it reports itself down past its worker-restart budget,
or it hands its requests back while it waits for resources or as it is removed) loses its requests to
the other replicas: each moves, its stream unbroken (cluster/serve/migration.py). Only when no replica
is left does a request end with an error output. A replica down takes no new requests; one rebuilding
takes none until it reports itself available again.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from ray.exceptions import RayActorError, TaskCancelledError

from actors.messages import PollResult, RequestSpec, error_output
from cluster.config import EngineConfig
from cluster.serve.fleet import DRAINING, FleetView
from cluster.serve.migration import FlightBook
from cluster.serve.router import KVAwareRouter
from cluster.serve.submissions import SubmitBatcher
from kvcore.messages import EngineCoreOutput

logger = logging.getLogger(__name__)

POLL_TIMEOUT_S = 1.0
FLEET_WATCH_S = 5.0  # one long poll of the fleet's live set
NEVER_STARTED = "never joined the fleet (it failed to start, or left before this ingress saw it)"


class Overloaded(RuntimeError):
    """No replica has room for the request now (back-pressure): answer 503 with Retry-After."""


class Unavailable(RuntimeError):
    """Every replica is down."""


class Inbox:
    """One OpenAI request's engine outputs, in arrival order: the poll task appends, the request's
    handler takes everything at once. (An asyncio.Queue costs a get and a wake-up per output.)"""

    def __init__(self) -> None:
        self._items: list[EngineCoreOutput] = []
        self._waiter: asyncio.Future[None] | None = None
        self._ends_only = False

    def put_nowait(self, o: EngineCoreOutput) -> None:
        self._items.append(o)
        w = self._waiter
        if w is not None and not w.done() and (o.finished or not self._ends_only):
            w.set_result(None)

    async def take_all(self, timeout_s: float | None = None, ends_only: bool = False) -> list[EngineCoreOutput]:
        """Every output so far; waits for the first when there is none, at most timeout_s (then it may
        return nothing). ends_only (stream batching): waits out timeout_s, unless an output that ends
        its request is there or arrives: one wake-up a window instead of one a step."""
        if ends_only:
            wait = not any(o.finished for o in self._items)
        else:
            wait = not self._items
        if wait and (timeout_s is None or timeout_s > 0):
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            self._ends_only = ends_only
            timer = None if timeout_s is None else loop.call_later(timeout_s, _wake, waiter)
            try:
                await waiter
            finally:
                self._waiter, self._ends_only = None, False
                if timer is not None:
                    timer.cancel()
        items, self._items = self._items, []
        return items


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass
class ReplicaBooks:
    outstanding: int = 0  # this ingress's engine requests there
    others: int = 0  # the other ingress replicas' there, as of the last poll
    down: str | None = None
    available: bool = True  # False while it waits for resources to rebuild on (it refuses requests)
    draining: bool = False  # being removed: it takes no new request (AsyncEngineClient.drain)
    migrated_away: int = 0  # engine requests it could not go on with, moved to another replica
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finished: int = 0
    owned: set[str] = field(default_factory=set)

    @property
    def load(self) -> int:
        return self.outstanding + self.others

    @property
    def takes_requests(self) -> bool:
        return self.down is None and self.available and not self.draining


class AsyncEngineClient:
    def __init__(
        self, config: EngineConfig, info: dict[str, Any], drivers: Sequence[Any] = (), fleet: Any = None
    ) -> None:
        """`info`: what a driver's start() returned (the model's limits); `drivers`: replicas 0.. known now
        (tests drive the client over stand-in drivers); `fleet`: the fleet's handle, watched for changes."""
        self.config = config
        self.info = info
        self.fleet = fleet
        self.capacity = config.scheduler.max_num_seqs + config.serve.max_queued_requests
        self.drivers: list[Any] = []  # by the fleet's replica id; None: an id this client never saw up
        self.books: list[ReplicaBooks] = []
        self.router = KVAwareRouter(
            0,
            config.cache.block_size,
            int(info.get("num_blocks") or 1),
            config.serve.imbalance_threshold,
            config.serve.prefix_affinity,
        )
        self.queues: dict[str, Inbox] = {}
        self.owner: dict[str, int] = {}
        self.prompt_len: dict[str, int] = {}
        self.flights = FlightBook()
        # This ingress replica's outbox in every driver: several ingress replicas share the drivers.
        self.client_id = f"ingress-{uuid.uuid4().hex[:12]}"
        self._polls: dict[int, asyncio.Task[None]] = {}
        self._watch: asyncio.Task[None] | None = None
        self._polling = False
        self.fleet_version = -1
        self.fleet_tag = ""
        self._seen_under: dict[int, str] = {}  # replica -> the fleet tag it was last a member under
        self._moves: set[asyncio.Task[None]] = set()  # strong references: the loop keeps weak ones
        self._closed = False
        self.batchers: list[SubmitBatcher] = []
        for r, d in enumerate(drivers):
            self.add_replica(r, d)

    # ---- the live set -----------------------------------------------------------------------
    def add_replica(self, r: int, driver: Any) -> None:
        """Replica r joined: it takes requests (and gets a poll task once polling started)."""
        while len(self.books) <= r:
            k = self.router.add_replica()
            self.drivers.append(None)
            self.books.append(ReplicaBooks(down=f"engine replica {k} {NEVER_STARTED}"))
            self.batchers.append(
                SubmitBatcher(functools.partial(self._send_batch, k), self.config.serve.batch_submissions)
            )
        if self.drivers[r] is not None:
            return
        self.drivers[r] = driver
        self.books[r] = ReplicaBooks()
        if self._polling and not self._closed:
            self._polls[r] = _detached(self._poll(r))

    def sync(self, view: FleetView) -> None:
        """Follow the fleet's live set: new replicas join, draining ones drain, those gone are down."""
        if view.tag != self.fleet_tag:  # a restarted fleet counts its versions afresh
            self.fleet_tag, self.fleet_version = view.tag, -1
        self.fleet_version = max(self.fleet_version, view.version)
        present = set()
        for m in view.members:
            present.add(m.replica)
            self._seen_under[m.replica] = view.tag
            self.add_replica(m.replica, m.driver)
            if m.state == DRAINING and not self.books[m.replica].draining:
                moved = self.drain(m.replica)
                logger.info("engine replica %d drains: %d waiting request(s) moved", m.replica, moved)
        for r, books in enumerate(self.books):
            # Absent from the fleet it was seen in: it left. (A restarted fleet learns them again.)
            if r not in present and books.down is None and self._seen_under.get(r) == view.tag:
                self.replica_down(r, f"engine replica {r} left the fleet")

    async def _watch_fleet(self) -> None:
        while not self._closed:
            try:
                view: FleetView = await self.fleet.view.remote(self.fleet_version, FLEET_WATCH_S)
            except asyncio.CancelledError:
                return
            except Exception as e:  # noqa: BLE001 - the fleet restarting, or the app going away
                logger.warning("the engine fleet's view failed (%s: %s); retrying", type(e).__name__, e)
                await asyncio.sleep(1.0)
                continue
            self.sync(view)

    def start_polling(self) -> None:
        """Start the poll tasks and the fleet watch (idempotent). They must live on the loop the handlers
        run on, so the first route that reads the live set (a request, /health, /metrics) starts them,
        but in a context of their own: nothing of that route's task reaches them."""
        if self._polling or self._closed:
            return
        self._polling = True
        for r, d in enumerate(self.drivers):
            if d is not None and self.books[r].down is None:
                self._polls[r] = _detached(self._poll(r))
        if self.fleet is not None:
            self._watch = _detached(self._watch_fleet())

    @property
    def num_live(self) -> int:
        """Replicas up (draining ones included)."""
        return sum(1 for b in self.books if b.down is None)

    @property
    def num_migrations(self) -> int:
        return sum(b.migrated_away for b in self.books)

    # ---- requests ---------------------------------------------------------------------------
    async def submit(self, specs: list[RequestSpec], queue: Inbox) -> tuple[int, dict[str, str]]:
        """Send one prompt's engine requests (its n samples) to one replica, chosen by the router; their
        outputs go to `queue`. -> (the replica, {request_id: why it was refused}); raises Overloaded /
        Unavailable."""
        self.start_polling()
        if all(b.down for b in self.books):
            if not self.books:
                raise Unavailable("no engine replica has joined yet")
            raise Unavailable("every engine replica is down: " + "; ".join(str(b.down) for b in self.books))
        need = len(specs)
        eligible = [b.takes_requests and b.load + need <= self.capacity for b in self.books]
        r = self.router.choose(specs[0].prompt_token_ids, [b.load for b in self.books], eligible)
        if r is None:
            raise Overloaded(
                f"every engine replica holds its limit of {self.capacity} requests "
                f"(scheduler.max_num_seqs={self.config.scheduler.max_num_seqs} + "
                f"serve.max_queued_requests={self.config.serve.max_queued_requests})"
            )
        books = self.books[r]
        for spec in specs:
            spec.client_id = self.client_id
            self.queues[spec.request_id] = queue
            self.owner[spec.request_id] = r
            self.prompt_len[spec.request_id] = len(spec.prompt_token_ids)
            self.flights.add(spec)
            books.owned.add(spec.request_id)
        books.outstanding += need
        future = self.batchers[r].add(specs)
        try:
            errs = await future
        except asyncio.CancelledError:
            # The client left before its batch went out: it never reaches the driver.
            if self.batchers[r].withdraw(future):
                for spec in specs:
                    self._release(spec.request_id)
            raise
        return r, {s.request_id: e for s, e in zip(specs, errs, strict=True) if e is not None}

    async def _send_batch(self, r: int, specs: list[RequestSpec]) -> list[str | None]:
        """One add_requests call for every request gathered for replica r; refused ones are released
        here, whether or not their caller still waits."""
        down = self.books[r].down
        if down is not None:
            # Those the replica's failure moved on already are accepted (elsewhere); the rest refused.
            errs: list[str | None] = [down if self.owner.get(s.request_id) == r else None for s in specs]
        else:
            # A request moved off r while its batch waited (r began draining) has gone elsewhere already.
            mine = [k for k, s in enumerate(specs) if self.owner.get(s.request_id) == r]
            errs = [None] * len(specs)
            try:
                sent = await self.drivers[r].add_requests.remote([specs[k] for k in mine]) if mine else []
            except RayActorError as e:
                # These requests are the replica's like the rest: they move on (or end) with them.
                self.replica_down(r, f"the driver actor of engine replica {r} died: {str(e).splitlines()[0]}")
                return [None] * len(specs)
            for k, err in zip(mine, sent, strict=True):
                errs[k] = err
        for spec, err in zip(specs, errs, strict=True):
            if err is not None:
                self._release(spec.request_id)
        return errs

    def abort(self, request_ids: list[str]) -> None:
        """Ask each owner to abort (fire and forget: the driver drains aborts before its next step)."""
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            self.flights.settle(rid)
            r = self.owner.get(rid)
            if r is not None and self.books[r].down is None:
                by_replica.setdefault(r, []).append(rid)
        for r, ids in by_replica.items():
            self.drivers[r].abort.remote(ids)

    def close(self, request_ids: list[str]) -> None:
        """The caller stopped reading these requests: outputs still to come are dropped."""
        for rid in request_ids:
            self.flights.settle(rid)
            self.queues.pop(rid, None)

    def _release(self, rid: str) -> None:
        self._unown(rid)
        self.prompt_len.pop(rid, None)
        self.flights.pop(rid)

    def _unown(self, rid: str) -> None:
        r = self.owner.pop(rid, None)
        if r is not None:
            self.books[r].outstanding -= 1
            self.books[r].owned.discard(rid)

    def _own(self, rid: str, r: int) -> None:
        self.owner[rid] = r
        self.books[r].outstanding += 1
        self.books[r].owned.add(rid)

    # ---- outputs ----------------------------------------------------------------------------
    async def _poll(self, r: int) -> None:
        driver = self.drivers[r]
        while not self._closed and self.books[r].down is None:
            try:
                res: PollResult = await driver.get_outputs.remote(POLL_TIMEOUT_S, self.client_id)
            except RayActorError as e:
                self.replica_down(r, f"the driver actor of engine replica {r} died: {str(e).splitlines()[0]}")
                return
            except TaskCancelledError:
                # Not ours to end (only shutdown cancels this task, and not through Ray): the driver is
                # fine and its outputs wait in its outbox, so poll again.
                if self._closed:
                    return
                logger.warning("engine replica %d: a get_outputs call was cancelled from outside; polling on", r)
                continue
            except asyncio.CancelledError:
                return
            except Exception as e:  # never let the poll loop die silently
                logger.exception("engine replica %d: get_outputs failed", r)
                self.replica_down(r, f"engine replica {r}: get_outputs failed: {type(e).__name__}: {e}")
                return
            owner = self.owner
            for o in res.outputs:
                if res.fatal is not None and o.error == res.fatal:
                    continue  # the replica failed under it: it moves below, with the rest
                if owner.get(o.request_id) == r:  # else it moved away already
                    self._deliver(r, o)
            self.books[r].available = res.available
            # The driver's live requests are every ingress's: the others' share bounds and steers ours.
            self.books[r].others = max(0, res.num_live - self.books[r].outstanding)
            if res.cache_events:
                self.router.apply(r, res.cache_events)
            if res.returned:
                why = f"engine replica {r} handed its requests back " + (
                    "(it is being removed)"
                    if self.books[r].draining
                    else "(its placement could not be rebuilt in time)"
                )
                self._move_away(r, [rid for rid in res.returned if owner.get(rid) == r], why)
            if res.fatal is not None:
                self.replica_down(r, res.fatal)

    def _deliver(self, r: int, o: EngineCoreOutput) -> None:
        rid = o.request_id
        if o.finished:
            books = self.books[r]
            books.finished += 1
            books.cached_tokens += o.num_cached_tokens
            books.prompt_tokens += self.prompt_len.get(rid, 0)
            self._release(rid)
        else:
            self.flights.record(o)
        q = self.queues.get(rid)
        if q is not None:
            q.put_nowait(o)

    def replica_down(self, r: int, why: str) -> None:
        books = self.books[r]
        if books.down is not None:
            return
        logger.error("engine replica %d is down: %s", r, why)
        books.down = why
        self.router.forget(r)
        self._move_away(r, list(books.owned), why)

    def _move_away(self, r: int, rids: list[str], why: str) -> None:
        """Replica r cannot go on with these requests: each continues on the least-loaded replica that
        can take it (beyond the admission bound: it was admitted already), or, with none left, ends
        with an error output. A settled request (aborted, or its client left) is only released."""
        targets = [t for t, b in enumerate(self.books) if t != r and b.takes_requests]
        moved: dict[int, list[RequestSpec]] = {}
        for rid in rids:
            if self.flights.settled(rid):
                self._release(rid)
                continue
            if not targets:
                self._deliver(r, error_output(rid, why))
                continue
            t = min(targets, key=lambda k: (self.books[k].load, k))
            spec = self.flights.continuation(rid)
            self._unown(rid)
            self._own(rid, t)
            self.books[r].migrated_away += 1
            moved.setdefault(t, []).append(spec)
        for t, specs in moved.items():
            logger.warning("engine replica %d: %d request(s) move to replica %d (%s)", r, len(specs), t, why)
            task = _detached(self._send_moved(t, specs, why))
            self._moves.add(task)
            task.add_done_callback(self._moves.discard)

    def drain(self, r: int, move_running: bool = False) -> int:
        """Replica r is being removed (scale-down): it takes no new request, and its requests that have
        not produced a token yet move to the other replicas now; with move_running, the running ones too
        (token-exact continuations; r aborts them, and what it still sends for them is dropped). The
        rest finish where they are; nothing is dropped. With no other replica to take them, all stay.
        -> how many moved. `drained(r)` says when it holds nothing."""
        books = self.books[r]
        books.draining = True
        if not any(t != r and b.takes_requests for t, b in enumerate(self.books)):
            return 0
        rids = [rid for rid in books.owned if move_running or not self.flights.answered(rid)]
        live = [rid for rid in rids if not self.flights.settled(rid)]
        self._move_away(r, rids, f"engine replica {r} is draining")
        if live and books.down is None:
            self.drivers[r].abort.remote(live)
        return len(live)

    def drained(self, r: int) -> bool:
        """Replica r is draining and holds no request: it can go."""
        return self.books[r].draining and not self.books[r].owned

    async def _send_moved(self, t: int, specs: list[RequestSpec], why: str) -> None:
        try:
            errs = await self.batchers[t].add(specs)
        except Exception as e:  # noqa: BLE001 - the engine client closed under it
            errs = [f"{type(e).__name__}: {e}"] * len(specs)
        for spec, err in zip(specs, errs, strict=True):
            if err is not None:  # _send_batch released it: its stream still needs its end
                q = self.queues.get(spec.request_id)
                if q is not None:
                    q.put_nowait(error_output(spec.request_id, f"{why}; moving it to replica {t} failed: {err}"))

    # ---- introspection and teardown ---------------------------------------------------------
    async def engine_stats(self) -> list[dict[str, Any]]:
        self.start_polling()  # a scrape before any request must still see replicas that joined since
        out: list[dict[str, Any]] = []
        for r, d in enumerate(self.drivers):
            if d is None:
                continue  # never up here
            if self.books[r].down is not None:
                out.append({"replica": r, "fatal": self.books[r].down})
                continue
            try:
                out.append(await asyncio.wait_for(d.stats.remote(), timeout=10.0))
            except Exception as e:  # noqa: BLE001 - a stats call must not fail /metrics
                out.append({"replica": r, "error": f"{type(e).__name__}: {e}"})
        return out

    def healthy(self) -> bool:
        """Called on the handlers' loop: like engine_stats, it starts following the fleet and the
        replicas, so that a health probe before any request sees a replica that died or joined."""
        self.start_polling()
        return any(b.down is None for b in self.books)

    def shutdown(self) -> None:
        """Stop this client's tasks and leave every driver (its requests there are aborted, its outbox
        goes). The engine replicas are the fleet's: they stay."""
        self._closed = True
        for r, d in enumerate(self.drivers):
            if d is not None and self.books[r].down is None:
                d.release_client.remote(self.client_id)
        tasks = [*self._polls.values(), *self._moves] + ([self._watch] if self._watch is not None else [])
        for t in tasks:
            t.cancel()


def _detached(coro: Any) -> asyncio.Task[None]:
    """A task on the running loop in a fresh context: it carries nothing of the request task that made
    it (Ray's record of the calling task among them), so cancelling that request cannot reach it."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
