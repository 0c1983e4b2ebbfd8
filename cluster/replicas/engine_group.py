"""The client side of `data_parallel_size` engine replicas: start their driver actors, spread requests
by load (least outstanding), stream outputs back, shut everything down.

Used by the LLM API and the batch job. A replica whose TP group failed for good (or whose driver actor
died) sets `fatal`; outputs already finished elsewhere still come back first.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Iterable

import ray
from ray.exceptions import RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.driver.actor import driver_actor_class
from actors.messages import DOWN, PollResult, RequestSpec, error_output
from cluster.config import DEFAULT_WORKER_CLS, EngineConfig
from cluster.replicas.failover import (
    DOWN_STATE,
    DRIVER_CALL_GRACE_S,
    REBUILDING_STATE,
    STARTING,
    UP,
    ReplicaFailover,
    ReplicaLost,
)
from cluster.replicas.placement import connect, create_placement_group, remove, resolve_device
from kvcore.messages import EngineCoreOutput

logger = logging.getLogger(__name__)


DRIVER_NAME_PREFIX = "kvray-driver-"


class EngineFailure(RuntimeError):
    """An engine replica is down (a worker failed past its restart budget, or its driver died)."""


def driver_placement() -> NodeAffinitySchedulingStrategy:
    """Driver actors live on the client's node (the head, under `ray job submit`): they hold no
    resources, and a worker node that goes away must take only workers with it, never the scheduler
    that knows what they were doing. Hard affinity: a soft one lets Ray place them elsewhere even when
    the client's node could host them (seen with a head of 0 CPUs); a process connected to Ray always
    has a raylet on its node, which can start a 0-CPU actor."""
    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def unwrap(e: BaseException) -> BaseException:
    """The original exception behind a Ray task error (PlacementError, WorkerFailure, ...)."""
    cause = getattr(e, "cause", None) if isinstance(e, RayTaskError) else None
    return cause if isinstance(cause, BaseException) else e


class EngineGroup(ReplicaFailover):
    def __init__(self, config: EngineConfig, worker_cls: str = DEFAULT_WORKER_CLS) -> None:
        t0 = time.perf_counter()
        self.started_ray = connect(config)
        t_connected = time.perf_counter()
        self.startup_s = {"ray_connect_s": round(t_connected - t0, 2)}
        config = resolve_device(config)  # the drivers and workers see cpu or cuda, never auto
        self.config = config
        self.worker_cls = worker_cls
        n = config.parallel.data_parallel_size
        # Named, so an operator (or a failure test) can find a job's drivers: `ray list actors`,
        # ray.util.list_named_actors(); the suffix keeps concurrent jobs in one namespace apart.
        self.tag = uuid.uuid4().hex[:8]
        self.outstanding = [0] * n
        self.owner: dict[str, int] = {}
        self._polls: dict[Any, int] = {}
        self.fatal: str | None = None
        self.infos: list[dict[str, Any]] = []
        self.drivers: list[Any] = []
        self._init_failover(n)
        # This process owns each replica's placement group, not its driver: a driver killed from outside
        # must not take its reservation with it, nor leave it behind.
        self.pgs: list[Any] = []
        try:
            for i in range(n):
                self.pgs.append(create_placement_group(config, name=f"kvray-{config.ray.namespace}-{self.tag}-r{i}"))
            t1 = time.perf_counter()
            self.drivers = [self._new_driver(i) for i in range(n)]
            self.infos = self._await_start([d.start.remote() for d in self.drivers])
            self.startup_s.update(
                placement_s=round(t1 - t_connected, 2), drivers_start_s=round(time.perf_counter() - t1, 2)
            )
        except RayTaskError as e:
            self.shutdown()
            raise unwrap(e) from None  # the driver's own error (PlacementError, WorkerFailure, ...)
        except Exception:
            self.shutdown()
            raise

    def _await_start(self, refs: list[Any]) -> list[dict[str, Any]]:
        """Every driver's start, bounded: its workers' set-up calls are each bounded by
        max(600 s, parallel.step_timeout_s) (probe, process group, model load), so a start that takes
        longer than three of those will never end."""
        timeout_s = 3 * max(600.0, self.config.parallel.step_timeout_s) + DRIVER_CALL_GRACE_S
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            late = [i for i, ref in enumerate(refs) if ref in pending]
            raise EngineFailure(
                f"engine replica(s) {late} did not start within {timeout_s:g}s (starting the "
                "workers in the placement group, joining the TP group, loading the model)"
            )
        return ray.get(refs)

    def _new_driver(self, replica: int) -> Any:
        gen = self.driver_restarts[replica]
        return (
            driver_actor_class()
            .options(
                namespace=self.config.ray.namespace,
                scheduling_strategy=driver_placement(),
                name=f"{DRIVER_NAME_PREFIX}{self.tag}-r{replica}" + (f"-{gen}" if gen else ""),
            )
            .remote(self.config, self.pgs[replica], replica, self.worker_cls)
        )

    @property
    def info(self) -> dict[str, Any]:
        return self.infos[0]

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, specs: list[RequestSpec]) -> dict[str, str]:
        """Send requests to the least-loaded replicas; returns {request_id: error} for refused ones.
        While no replica is up they wait (see cluster/replicas/failover.py); once the group is down for good,
        each is refused with the reason."""
        errors: dict[str, str] = {}
        rids = []
        now = time.monotonic()
        for spec in specs:
            if self.fatal is not None:
                errors[spec.request_id] = f"every engine replica {DOWN}: {self.fatal}"
            elif spec.request_id in self.live:
                errors[spec.request_id] = (
                    f"request {spec.request_id!r}: request_id is already in use by an unfinished request"
                )
            else:
                self.live.add(spec, now)
                rids.append(spec.request_id)
        errors.update(self._dispatch(rids))
        self._check_fatal()
        return errors

    def abort(self, request_ids: Iterable[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            if rid in self.owner:
                by_replica.setdefault(self.owner[rid], []).append(rid)
            if rid in self.pending:
                self.pending.remove(rid)
            # Out of the books now: were its replica lost before the abort lands, it must not move.
            self.live.retire(rid, time.monotonic())
        for r, ids in by_replica.items():
            self.drivers[r].abort.remote(ids)

    def poll(self, timeout_s: float = 1.0) -> list[EngineCoreOutput]:
        """Outputs that arrived within timeout_s, streaming and finished ones alike (a request's last one,
        `finished`, carries its timing on the driver)."""
        self._check_starting()
        self._dispatch_pending()
        items = [error_output(rid, err) for rid, err in self._refused_late.items()]
        self._refused_late.clear()
        for r, s in enumerate(self.state):
            if s in (UP, REBUILDING_STATE) and r not in self._polls.values():
                self._polls[self.drivers[r].get_outputs.remote(timeout_s)] = r
        wait_on = list(self._polls) + list(self._starting)
        ready = ray.wait(wait_on, num_returns=1, timeout=timeout_s + 5.0)[0] if wait_on else []
        for ref in ready:
            if ref in self._polls:
                items += self._take(self._polls.pop(ref), ref)
        self._check_starting()
        self._dispatch_pending()
        self._check_fatal()
        return items

    def _take(self, r: int, ref: Any) -> list[EngineCoreOutput]:
        try:
            res: PollResult = self._get(ref, r)
        except ReplicaLost as e:
            self.pending += self._lose(r, str(e))
            return []
        items: list[EngineCoreOutput] = []
        # Outputs of requests moved away from r since are stale; unknown ids (aborted) pass through.
        kept = self.live.drop_replayed(
            [o for o in res.outputs if self.owner.get(o.request_id) == r or o.request_id not in self.live],
            lambda ids: self.drivers[r].abort.remote(ids),
        )
        for o in kept:
            if res.fatal is not None and o.finish_reason == "error" and o.error == res.fatal:
                continue  # in-flight casualties of the replica's failure: they move, below
            self.live.record(o, time.monotonic())
            if o.finished:
                self._unown(o.request_id)
            items.append(o)
        if res.returned:
            self.pending += self._orphans(r, res.returned)
        if res.fatal is not None:
            self._set_state(r, DOWN_STATE, res.fatal)
            self.pending += self._orphans(r)
        elif not res.available:
            self._set_state(r, REBUILDING_STATE, self.why[r] or "waiting for resources to rebuild on")
        elif self.state[r] == REBUILDING_STATE:
            self._set_state(r, UP, None)
        return items

    def stats(self) -> list[dict[str, Any]]:
        out = []
        for r, d in enumerate(self.drivers):
            try:
                s = self._get(d.stats.remote(), r) if self.state[r] != STARTING else {"replica": r}
            except ReplicaLost as e:
                s = {"replica": r, "fatal": str(e)}
            s.update(
                driver_restarts=self.driver_restarts[r], requests_moved_away=self.moved_away[r], state=self.state[r]
            )
            out.append(s)
        return out

    # ---- teardown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every replica: workers killed, placement groups removed, driver actors killed."""
        refs = [d.shutdown.remote() for d in self.drivers]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=self.config.parallel.step_timeout_s + 30)
        for d in self.drivers:
            try:
                ray.kill(d, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already gone
                logger.debug("ray.kill(driver): %s", e)
        self.drivers = []
        for pg in self.pgs:
            remove(pg)
        self.pgs = []
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
            self.started_ray = False
