"""The client side of `data_parallel_size` engine replicas: start their driver actors, spread requests
by load (least outstanding), stream outputs back, shut everything down.

Used by the LLM API and the batch job. A replica whose TP group failed for good (or whose driver actor
died) sets `fatal`; outputs already finished elsewhere still come back first.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.driver import driver_actor_class
from actors.messages import PollResult, RequestSpec, RequestTiming
from cluster.config import DEFAULT_WORKER_CLS, EngineConfig
from cluster.placement import connect, create_placement_group, remove, resolve_device
from kvcore.messages import EngineCoreOutput

logger = logging.getLogger(__name__)


DRIVER_NAME_PREFIX = "kvray-driver-"
DRIVER_CALL_GRACE_S = 30.0  # beyond parallel.step_timeout_s, for a call into a driver actor


class EngineFailure(RuntimeError):
    """An engine replica is down (a worker failed past its restart budget, or its driver died)."""


@dataclass
class EngineOutput:
    """One output of one request, as `EngineGroup.poll` returns it: new tokens, and on the last one
    (`finished`) the request's timing on the driver."""

    output: EngineCoreOutput
    timing: RequestTiming | None = None

    @property
    def request_id(self) -> str:
        return self.output.request_id

    @property
    def finished(self) -> bool:
        return self.output.finished


def driver_placement() -> NodeAffinitySchedulingStrategy:
    """Driver actors live on the client's node (the head, under `ray job submit`): they hold no
    resources, and a worker node that goes away must take only workers with it, never the scheduler
    that knows what they were doing. Soft, so a client on a node that cannot host actors still runs."""
    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=True)


def unwrap(e: BaseException) -> BaseException:
    """The original exception behind a Ray task error (PlacementError, WorkerFailure, ...)."""
    cause = getattr(e, "cause", None) if isinstance(e, RayTaskError) else None
    return cause if isinstance(cause, BaseException) else e


class EngineGroup:
    def __init__(self, config: EngineConfig, worker_cls: str = DEFAULT_WORKER_CLS) -> None:
        self.started_ray = connect(config)
        config = resolve_device(config)  # the drivers and workers see cpu or cuda, never auto
        self.config = config
        cls = driver_actor_class()
        n = config.parallel.data_parallel_size
        # Named, so an operator (or a failure test) can find a job's drivers: `ray list actors`,
        # ray.util.list_named_actors(); the suffix keeps concurrent jobs in one namespace apart.
        tag = uuid.uuid4().hex[:8]
        self.outstanding = [0] * n
        self.owner: dict[str, int] = {}
        self._polls: dict[Any, int] = {}
        self.fatal: str | None = None
        self.infos: list[dict[str, Any]] = []
        self.drivers: list[Any] = []
        # This process owns each replica's placement group, not its driver: a driver killed from outside
        # must not take its reservation with it, nor leave it behind.
        self.pgs: list[Any] = []
        try:
            for i in range(n):
                self.pgs.append(create_placement_group(config, name=f"kvray-{config.ray.namespace}-{tag}-r{i}"))
            self.drivers = [cls.options(namespace=config.ray.namespace, name=f"{DRIVER_NAME_PREFIX}{tag}-r{i}",
                                        scheduling_strategy=driver_placement())
                            .remote(config, pg, i, worker_cls) for i, pg in enumerate(self.pgs)]
            self.infos = ray.get([d.start.remote() for d in self.drivers])
        except Exception as e:
            self.shutdown()
            cause = unwrap(e)
            raise cause from None

    @property
    def info(self) -> dict[str, Any]:
        return self.infos[0]

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, specs: list[RequestSpec]) -> dict[str, str]:
        """Send requests to the least-loaded replicas; returns {request_id: error} for refused ones."""
        per_replica: dict[int, list[RequestSpec]] = {}
        for spec in specs:
            r = min(range(len(self.drivers)), key=lambda i: self.outstanding[i])
            self.outstanding[r] += 1
            self.owner[spec.request_id] = r
            per_replica.setdefault(r, []).append(spec)
        refs = {r: self.drivers[r].add_requests.remote(batch) for r, batch in per_replica.items()}
        errors: dict[str, str] = {}
        for r, ref in refs.items():
            for spec, err in zip(per_replica[r], self._get(ref, r)):
                if err is not None:
                    errors[spec.request_id] = err
                    self._finish_refused(spec.request_id, r, err)
        return errors

    def _finish_refused(self, rid: str, r: int, err: str) -> None:
        if self.owner.pop(rid, None) is not None:
            self.outstanding[r] -= 1
        # A replica that is down refuses everything: that is the replica's failure, not the request's.
        if err.startswith(f"engine replica {r} is down:") and self.fatal is None:
            self.fatal = err

    def abort(self, request_ids: Iterable[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            if rid in self.owner:
                by_replica.setdefault(self.owner[rid], []).append(rid)
        for r, ids in by_replica.items():
            self.drivers[r].abort.remote(ids)

    def poll(self, timeout_s: float = 1.0) -> list[EngineOutput]:
        """Outputs that arrived within timeout_s, streaming and finished ones alike."""
        for r in range(len(self.drivers)):
            if r not in self._polls.values():
                self._polls[self.drivers[r].get_outputs.remote(timeout_s)] = r
        ready, _ = ray.wait(list(self._polls), num_returns=1, timeout=timeout_s + 5.0)
        items: list[EngineOutput] = []
        for ref in ready:
            r = self._polls.pop(ref)
            res: PollResult = self._get(ref, r)
            for o in res.outputs:
                if res.fatal is not None and o.finish_reason == "error" and o.error == res.fatal:
                    continue  # in-flight casualties of the failure: reported once, as `fatal`
                items.append(self._finish(o, r, res) if o.finished else EngineOutput(o))
            if res.fatal is not None and self.fatal is None:
                self.fatal = res.fatal
        return items

    def _finish(self, o: EngineCoreOutput, r: int, res: PollResult) -> EngineOutput:
        if self.owner.pop(o.request_id, None) is not None:
            self.outstanding[r] -= 1
        return EngineOutput(o, res.timings.get(o.request_id))

    def _get(self, ref: Any, replica: int) -> Any:
        # The driver answers these calls between steps (its step loop never holds their lock long): a
        # driver silent for this long is hung, and the caller must hear it rather than wait forever.
        timeout_s = self.config.parallel.step_timeout_s + DRIVER_CALL_GRACE_S
        try:
            return ray.get(ref, timeout=timeout_s)
        except RayActorError as e:
            self.fatal = f"the driver actor of engine replica {replica} died: {str(e).splitlines()[0]}"
            raise EngineFailure(self.fatal) from None
        except GetTimeoutError:
            self.fatal = f"the driver actor of engine replica {replica} did not answer within {timeout_s:g}s"
            raise EngineFailure(self.fatal) from None

    def stats(self) -> list[dict[str, Any]]:
        return [self._get(d.stats.remote(), r) for r, d in enumerate(self.drivers)]

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
