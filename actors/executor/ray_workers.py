"""The Executor over Ray: one worker actor per rank (pipeline stages x tensor-parallel ranks), inside the
engine's placement group (a bundle per rank, or per stage with pipeline parallelism).

Set-up: a probe task on bundle 0 (rank 0's node) finds the node IP and reads the model's config.json
there; then the worker actors start (one bundle each), rank 0 opens the groups' rendezvous store on a
port it binds at once (`open_rendezvous`), every rank joins the groups (`init_device`, all at once) and
loads its shard. Steps go through the transport
(compiled graph or plain actor calls); set-up calls are plain actor calls.
"""

from __future__ import annotations

import importlib
import logging
import time
from typing import Any, Sequence

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.config.engine import DEFAULT_WORKER_CLS, EngineConfig
from actors.errors import WorkerFailure
from actors.executor.base import Executor, pipeline_depth
from actors.executor.node_probe import NodeProbe, probe_node
from actors.transport.broadcast import gather_ranks
from actors.transport.factory import make_transport
from kvcore.messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


def import_class(path: str) -> type[Any]:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class RayExecutor(Executor):
    def __init__(
        self,
        config: EngineConfig,
        placement_group: PlacementGroup,
        worker_cls: str | type = DEFAULT_WORKER_CLS,
        probe_model: bool = True,
        setup_timeout_s: float | None = None,
    ) -> None:
        self.config = config
        self.pg = placement_group
        self.world_size = config.parallel.ranks_per_engine
        # Loading a big checkpoint takes minutes; a dead rank is still reported at once (ray.wait).
        self.setup_timeout_s = setup_timeout_s or max(600.0, config.parallel.step_timeout_s)
        self.workers: list[Any] = []
        self.transport: Any = None
        self._closed = False
        t0 = time.perf_counter()
        try:
            # The worker processes boot (Python, Ray, torch: seconds) while the probe reads rank 0's node;
            # only init_device needs what it finds.
            probe_ref = self._probe_ref(probe_model)
            requested = time.time()
            self._start_workers(worker_cls)
            self.probe: NodeProbe = ray.get(probe_ref, timeout=self.setup_timeout_s)
            t1 = time.perf_counter()
            self.collective_rpc("init_device", self._init_method())
            t2 = time.perf_counter()
            phases = ray.get(self.workers[0].start_phases.remote(requested), timeout=self.setup_timeout_s)
            self.collective_rpc("load_model")
            # Where start-up time goes (the engine stats carry it; benchmarks/e2e/bench_startup.py prints it).
            # The probe runs inside the workers' start, so probe_s is part of workers_start_s.
            self.startup_s = {
                "probe_s": round(t1 - t0, 2),
                "workers_start_s": round(t2 - t0, 2),
                "load_model_s": round(time.perf_counter() - t2, 2),
                **phases,
            }
        except BaseException:
            self.shutdown()
            raise

    def _strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        bundle = self.config.parallel.bundle_of_rank(rank)
        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=bundle)

    def _probe_ref(self, probe_model: bool) -> Any:
        task = ray.remote(num_cpus=0)(probe_node).options(scheduling_strategy=self._strategy(0))
        return task.remote(self.config.model.model if probe_model else None)

    def _init_method(self) -> str | None:
        if self.world_size == 1:
            return None
        timeout_s = self.setup_timeout_s
        (port,) = gather_ranks(
            [self.workers[0].open_rendezvous.remote()],
            "open_rendezvous",
            timeout_s,
            on_timeout=lambda ranks: WorkerFailure(0, f"open_rendezvous did not finish within {timeout_s:g}s"),
        )
        return f"tcp://{self.probe.node_ip}:{port}"

    def _start_workers(self, worker_cls: str | type[Any]) -> None:
        cls = import_class(worker_cls) if isinstance(worker_cls, str) else worker_cls
        p = self.config.parallel
        if p.device == "cuda":
            opts = {"num_cpus": 0, "num_gpus": p.gpus_per_worker}
        else:
            opts = {"num_cpus": 1}
        remote_cls = ray.remote(cls)
        for rank in range(self.world_size):
            actor = remote_cls.options(
                **opts, scheduling_strategy=self._strategy(rank), name=None, max_restarts=0
            ).remote(self.config, rank, self.world_size, None)
            self.workers.append(actor)
        logger.info("RayExecutor: %d worker(s), backend %s", self.world_size, p.collective_backend)

    # ---- calls ------------------------------------------------------------------------------
    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        if self._closed:
            raise RuntimeError("RayExecutor is shut down")
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        timeout_s = self.setup_timeout_s
        return gather_ranks(
            refs,
            method,
            timeout_s,
            on_timeout=lambda ranks: WorkerFailure(
                ranks[0], f"{method} did not finish within {timeout_s:g}s on rank(s) {ranks}"
            ),
        )

    def open_step_path(self) -> None:
        # Compiled after the set-up calls (they must not compete with a live graph's channels) and before
        # the first request, which would otherwise wait for Ray to compile the graph.
        if self.transport is None:
            self.transport = make_transport(
                self.config.ray.transport,
                self.workers,
                self.config.parallel.step_timeout_s,
                answer_rank=self.answer_rank,
                max_in_flight=pipeline_depth(self.config),
            )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self.open_step_path()
        return self.transport.broadcast(scheduler_output)

    def submit_step(self, scheduler_output: SchedulerOutput) -> Any:
        self.open_step_path()
        return self.transport.submit(scheduler_output)

    def collect_step(self, handle: Any) -> ModelRunnerOutput | None:
        out: ModelRunnerOutput | None = self.transport.collect(handle)
        return out

    @property
    def failed(self) -> bool:
        return self.transport is not None and self.transport.failure is not None

    # ---- teardown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        broken = self.failed
        if self.transport is not None:
            if broken:
                # Survivors may sit in a collective forever: kill first, so teardown does not wait.
                _kill_all(self.workers)
            self.transport.close()
        if not broken:
            refs = [w.shutdown.remote() for w in self.workers]
            ray.wait(refs, num_returns=len(refs), timeout=10)
        _kill_all(self.workers)
        self.workers = []


def _kill_all(workers: Sequence[Any]) -> None:
    for w in workers:
        try:
            ray.kill(w, no_restart=True)
        except Exception as e:  # noqa: BLE001 - already dead
            logger.debug("ray.kill: %s", e)
