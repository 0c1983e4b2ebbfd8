"""The server's asyncio side of the engine replicas: EngineGroup's driver actors, driven without blocking.

EngineGroup (cluster/replicas/engine_group.py) starts and stops the replicas, as for `kvray run`; this class talks
to its drivers from the ingress's event loop. One poll task per replica awaits `get_outputs` (the
driver answers as soon as a step produced something, so tokens stream step by step) and hands each
output to the queue of the request that owns it. Submission picks a replica with the router, within
each replica's bound (scheduler.max_num_seqs + serve.max_queued_requests outstanding engine requests);
when none has room it raises Overloaded (503). An output that finishes a request frees its slot, so
the count is what the engine still holds, aborts included (their echo is the finished output).

A replica whose driver died, or that reports itself down (past its worker-restart budget), ends every
request it held with an error output and takes no new ones.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayActorError

from actors.messages import PollResult, RequestSpec, error_output
from cluster.config import DEFAULT_WORKER_CLS, EngineConfig
from cluster.replicas.engine_group import EngineGroup
from cluster.serve.router import PrefixAffinityRouter
from cluster.serve.submissions import SubmitBatcher
from kvcore.messages import EngineCoreOutput

logger = logging.getLogger(__name__)

POLL_TIMEOUT_S = 1.0


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
    outstanding: int = 0
    down: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finished: int = 0
    owned: set[str] = field(default_factory=set)


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, worker_cls: str = DEFAULT_WORKER_CLS) -> None:
        self.group = EngineGroup(config, worker_cls=worker_cls)
        self.config = self.group.config
        n = len(self.group.drivers)
        self.capacity = config.scheduler.max_num_seqs + config.serve.max_queued_requests
        self.books = [ReplicaBooks() for _ in range(n)]
        info = self.group.info
        self.router = PrefixAffinityRouter(
            n,
            config.cache.block_size,
            int(info.get("num_blocks") or 1),
            config.serve.imbalance_threshold,
            config.serve.prefix_affinity,
        )
        self.queues: dict[str, Inbox] = {}
        self.owner: dict[str, int] = {}
        self.prompt_len: dict[str, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        gather = config.serve.batch_submissions
        self.batchers = [SubmitBatcher(functools.partial(self._send_batch, r), gather) for r in range(n)]

    @property
    def info(self) -> dict[str, Any]:
        return self.group.info

    def _ensure_polling(self) -> None:
        # Started from a request handler: the tasks must live on the loop the handlers run on.
        if not self._tasks and not self._closed:
            self._tasks = [asyncio.get_running_loop().create_task(self._poll(r)) for r in range(len(self.books))]

    # ---- requests ---------------------------------------------------------------------------
    async def submit(self, specs: list[RequestSpec], queue: Inbox) -> tuple[int, dict[str, str]]:
        """Send one prompt's engine requests (its n samples) to one replica, chosen by the router; their
        outputs go to `queue`. -> (the replica, {request_id: why it was refused}); raises Overloaded /
        Unavailable."""
        self._ensure_polling()
        if all(b.down for b in self.books):
            raise Unavailable("every engine replica is down: " + "; ".join(str(b.down) for b in self.books))
        need = len(specs)
        eligible = [b.down is None and b.outstanding + need <= self.capacity for b in self.books]
        r = self.router.choose(specs[0].prompt_token_ids, [b.outstanding for b in self.books], eligible)
        if r is None:
            raise Overloaded(
                f"every engine replica holds its limit of {self.capacity} requests "
                f"(scheduler.max_num_seqs={self.config.scheduler.max_num_seqs} + "
                f"serve.max_queued_requests={self.config.serve.max_queued_requests})"
            )
        books = self.books[r]
        for spec in specs:
            self.queues[spec.request_id] = queue
            self.owner[spec.request_id] = r
            self.prompt_len[spec.request_id] = len(spec.prompt_token_ids)
            books.owned.add(spec.request_id)
        books.outstanding += need
        self.router.record(r, specs[0].prompt_token_ids)
        future = self.batchers[r].add(specs)
        try:
            errs = await future
        except asyncio.CancelledError:
            # The client left before its batch went out: it never reaches the driver.
            if self.batchers[r].withdraw(future):
                for spec in specs:
                    self._release(spec.request_id)
            raise
        return r, {s.request_id: e for s, e in zip(specs, errs) if e is not None}

    async def _send_batch(self, r: int, specs: list[RequestSpec]) -> list[str | None]:
        """One add_requests call for every request gathered for replica r; refused ones are released
        here, whether or not their caller still waits."""
        if self.books[r].down is not None:
            errs: list[str | None] = [self.books[r].down] * len(specs)
        else:
            try:
                errs = await self.group.drivers[r].add_requests.remote(specs)
            except RayActorError as e:
                self._replica_down(r, f"the driver actor of engine replica {r} died: {str(e).splitlines()[0]}")
                errs = [self.books[r].down] * len(specs)
        for spec, err in zip(specs, errs):
            if err is not None:
                self._release(spec.request_id)
        return errs

    def abort(self, request_ids: list[str]) -> None:
        """Ask each owner to abort (fire and forget: the driver drains aborts before its next step)."""
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            r = self.owner.get(rid)
            if r is not None and self.books[r].down is None:
                by_replica.setdefault(r, []).append(rid)
        for r, ids in by_replica.items():
            self.group.drivers[r].abort.remote(ids)

    def close(self, request_ids: list[str]) -> None:
        """The caller stopped reading these requests: outputs still to come are dropped."""
        for rid in request_ids:
            self.queues.pop(rid, None)

    def _release(self, rid: str) -> None:
        r = self.owner.pop(rid, None)
        self.prompt_len.pop(rid, None)
        if r is not None:
            self.books[r].outstanding -= 1
            self.books[r].owned.discard(rid)

    # ---- outputs ----------------------------------------------------------------------------
    async def _poll(self, r: int) -> None:
        driver = self.group.drivers[r]
        while not self._closed and self.books[r].down is None:
            try:
                res: PollResult = await driver.get_outputs.remote(POLL_TIMEOUT_S)
            except RayActorError as e:
                self._replica_down(r, f"the driver actor of engine replica {r} died: {str(e).splitlines()[0]}")
                return
            except asyncio.CancelledError:
                return
            except Exception as e:  # noqa: BLE001 - never let the poll loop die silently
                logger.exception("engine replica %d: get_outputs failed", r)
                self._replica_down(r, f"engine replica {r}: get_outputs failed: {type(e).__name__}: {e}")
                return
            for o in res.outputs:
                self._deliver(r, o)
            if res.fatal is not None:
                self._replica_down(r, res.fatal)

    def _deliver(self, r: int, o: EngineCoreOutput) -> None:
        rid = o.request_id
        if o.finished:
            books = self.books[r]
            books.finished += 1
            books.cached_tokens += o.num_cached_tokens
            books.prompt_tokens += self.prompt_len.get(rid, 0)
            self._release(rid)
        q = self.queues.get(rid)
        if q is not None:
            q.put_nowait(o)

    def _replica_down(self, r: int, why: str) -> None:
        books = self.books[r]
        if books.down is not None:
            return
        logger.error("engine replica %d is down: %s", r, why)
        books.down = why
        self.router.forget(r)
        for rid in list(books.owned):
            self._deliver(r, error_output(rid, why))

    # ---- introspection and teardown ---------------------------------------------------------
    async def engine_stats(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for r, d in enumerate(self.group.drivers):
            if self.books[r].down is not None:
                out.append({"replica": r, "fatal": self.books[r].down})
                continue
            try:
                out.append(await asyncio.wait_for(d.stats.remote(), timeout=10.0))
            except Exception as e:  # noqa: BLE001 - a stats call must not fail /metrics
                out.append({"replica": r, "error": f"{type(e).__name__}: {e}"})
        return out

    def healthy(self) -> bool:
        return any(b.down is None for b in self.books)

    def shutdown(self) -> None:
        self._closed = True
        for t in self._tasks:
            t.cancel()
        self.group.shutdown()
