"""The client side of `data_parallel_size` engine replicas: start their driver actors, spread requests
by load (least outstanding), stream outputs back, shut everything down.

Used by the LLM API and the batch job. A replica whose TP group failed for good (or whose driver actor
died) sets `fatal`; outputs already finished elsewhere still come back first.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

import ray
from ray.exceptions import RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.driver.actor import driver_actor_class
from actors.messages import PollResult, RequestSpec
from actors.verbose_logging import verbose_runtime_env
from cluster.config import DEFAULT_WORKER_CLS, EngineConfig
from cluster.replicas.driver_names import driver_name
from cluster.replicas.failover import (
    DRIVER_CALL_GRACE_S,
    STARTING,
    FailoverLimits,
    ReplicaFailover,
    ReplicaLost,
)
from cluster.replicas.placement import connect, create_placement_group, remove, resolve_device
from kvcore.messages import EngineCoreOutput

logger = logging.getLogger(__name__)


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


def new_driver(config: EngineConfig, pg: Any, replica: int, name: str, worker_cls: str) -> Any:
    """A driver actor for one replica, in the placement group `pg` the caller owns."""
    return (
        driver_actor_class()
        .options(
            namespace=config.ray.namespace,
            scheduling_strategy=driver_placement(),
            name=name,
            runtime_env=verbose_runtime_env(),  # -v reaches a cluster's processes too (its workers inherit it)
        )
        .remote(config, pg, replica, worker_cls)
    )


def await_start(config: EngineConfig, refs: list[Any]) -> list[dict[str, Any]]:
    """Every driver's start, bounded: its workers' set-up calls are each bounded by
    max(600 s, parallel.step_timeout_s) (probe, process group, model load), so a start that takes
    longer than three of those will never end."""
    timeout_s = 3 * max(600.0, config.parallel.step_timeout_s) + DRIVER_CALL_GRACE_S
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        late = [i for i, ref in enumerate(refs) if ref in pending]
        raise EngineFailure(
            f"engine replica(s) {late} did not start within {timeout_s:g}s (starting the "
            "workers in the placement group, joining the TP group, loading the model)"
        )
    return ray.get(refs)


@dataclass
class StartedReplica:
    """One engine replica started on its own (a Serve engine replica, cluster/serve/engine_replica.py):
    its driver actor, the placement group its caller owns, and what the driver's start() returned."""

    replica: int
    driver: Any
    pg: Any
    info: dict[str, Any]


def start_replica(config: EngineConfig, replica: int, tag: str, worker_cls: str = DEFAULT_WORKER_CLS) -> StartedReplica:
    """Reserve one replica's placement group, start its driver (workers, model) and wait for it, as
    EngineGroup does for each of its replicas. `config` has its device resolved. Blocking."""
    pg = create_placement_group(config, name=f"kvray-{config.ray.namespace}-{tag}-r{replica}")
    driver = None
    try:
        driver = new_driver(config, pg, replica, driver_name(tag, replica), worker_cls)
        info = await_start(config, [driver.start.remote()])[0]
    except BaseException as e:
        if driver is not None:
            stop_driver(config, driver)
        remove(pg)
        if isinstance(e, RayTaskError):
            raise unwrap(e) from None
        raise
    return StartedReplica(replica, driver, pg, info)


def stop_driver(config: EngineConfig, driver: Any) -> None:
    """Stop one driver (its workers with it) and kill its actor; its placement group stays the caller's."""
    try:
        ray.wait([driver.shutdown.remote()], timeout=config.parallel.step_timeout_s + 30)
    except Exception as e:  # noqa: BLE001 - already gone
        logger.debug("driver shutdown: %s", e)
    try:
        ray.kill(driver, no_restart=True)
    except Exception as e:  # noqa: BLE001 - already gone
        logger.debug("ray.kill(driver): %s", e)


class EngineGroup:
    """Owns the replicas' driver actors and placement groups; its `failover` keeps the request books."""

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
        self._polls: dict[Any, int] = {}
        self.infos: list[dict[str, Any]] = []
        self.drivers: list[Any] = []
        limits = FailoverLimits(
            max_driver_restarts=config.parallel.max_driver_restarts,
            placement_timeout_s=config.parallel.placement_timeout_s,
            driver_call_timeout_s=config.parallel.step_timeout_s + DRIVER_CALL_GRACE_S,
        )
        self.failover = ReplicaFailover(n, limits, drivers=self)
        # This process owns each replica's placement group, not its driver: a driver killed from outside
        # must not take its reservation with it, nor leave it behind.
        self.pgs: list[Any] = []
        try:
            for i in range(n):
                self.pgs.append(create_placement_group(config, name=f"kvray-{config.ray.namespace}-{self.tag}-r{i}"))
            t1 = time.perf_counter()
            self.drivers = [self._new_driver(i, 0) for i in range(n)]
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
        return await_start(self.config, refs)

    def _new_driver(self, replica: int, gen: int) -> Any:
        name = driver_name(self.tag, replica, gen)
        return new_driver(self.config, self.pgs[replica], replica, name, self.worker_cls)

    # ---- DriverControl: what failover may do to the driver actors ------------------------------
    def driver(self, replica: int) -> Any:
        return self.drivers[replica]

    def retire_driver(self, replica: int) -> None:
        self._polls = {ref: i for ref, i in self._polls.items() if i != replica}
        try:
            ray.kill(self.drivers[replica], no_restart=True)  # a hung one must not come back to life
        except Exception as e:  # noqa: BLE001 - already dead
            logger.debug("ray.kill(driver): %s", e)

    def start_driver(self, replica: int, generation: int) -> Any:
        self.drivers[replica] = self._new_driver(replica, generation)
        return self.drivers[replica].start.remote()

    def driver_started(self, replica: int, info: dict[str, Any]) -> None:
        self.infos[replica] = info

    @property
    def info(self) -> dict[str, Any]:
        return self.infos[0]

    @property
    def fatal(self) -> str | None:
        """Why the group is down for good; None while a replica is up or may come back."""
        return self.failover.fatal

    @property
    def state(self) -> list[str]:
        """Each replica's state (see cluster/replicas/failover.py)."""
        return self.failover.state

    @property
    def outstanding(self) -> list[int]:
        """Each replica's unfinished requests."""
        return self.failover.outstanding

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, specs: list[RequestSpec]) -> dict[str, str]:
        """Send requests to the least-loaded replicas; returns {request_id: error} for refused ones.
        While no replica is up they wait (see cluster/replicas/failover.py); once the group is down for good,
        each is refused with the reason."""
        return self.failover.submit(specs)

    def abort(self, request_ids: Iterable[str]) -> None:
        by_replica = self.failover.abort(request_ids)
        for r, ids in by_replica.items():
            self.drivers[r].abort.remote(ids)

    def poll(self, timeout_s: float = 1.0) -> list[EngineCoreOutput]:
        """Outputs that arrived within timeout_s, streaming and finished ones alike (a request's last one,
        `finished`, carries its timing on the driver)."""
        self.failover.check_starting()
        self.failover.dispatch_pending()
        items = self.failover.take_refused()
        for r in self.failover.polled_replicas():
            if r not in self._polls.values():
                self._polls[self.drivers[r].get_outputs.remote(timeout_s)] = r
        wait_on = list(self._polls) + self.failover.starting_refs()
        ready = ray.wait(wait_on, num_returns=1, timeout=timeout_s + 5.0)[0] if wait_on else []
        for ref in ready:
            if ref in self._polls:
                items += self._take(self._polls.pop(ref), ref)
        self.failover.check_starting()
        self.failover.dispatch_pending()
        self.failover.check_fatal()
        return items

    def _take(self, r: int, ref: Any) -> list[EngineCoreOutput]:
        try:
            res: PollResult = self.failover.call(ref, r)
        except ReplicaLost as e:
            self.failover.replica_lost(r, str(e))
            return []
        return self.failover.accept(r, res)

    def stats(self) -> list[dict[str, Any]]:
        out = []
        for r, d in enumerate(self.drivers):
            try:
                s = self.failover.call(d.stats.remote(), r) if self.state[r] != STARTING else {"replica": r}
            except ReplicaLost as e:
                s = {"replica": r, "fatal": str(e)}
            s.update(self.failover.replica_stats(r))
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
