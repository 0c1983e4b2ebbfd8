"""The worker: one rank of an engine (one TP rank of one pipeline stage). Picks its device, joins the
model-parallel groups (actors/parallel_state.py), owns a ModelRunner.

Usable in-process (tests, LocalExecutor) and as a Ray actor (the Ray executor wraps it with ray.remote);
ray is therefore only imported when the process already runs under Ray.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import asdict
from typing import Any

import torch

from actors import parallel_state
from actors.config.engine import EngineConfig
from actors.gc_heap import freeze_startup_heap

# First: the time of its import is when this module's import began (torch is most of it).
from actors.profiling import compile_log, start_timeline
from actors.profiling.step_profiler import StepProfiler
from actors.transport.shm_reader import ShmLoopMixin
from actors.verbose_logging import show_kvray_info_logs
from actors.worker.model_runner import ModelRunner
from kvcore.messages import ModelRunnerOutput, SchedulerOutput
from kvcore.spec import KVCacheConfig, KVCacheSpec

logger = logging.getLogger(__name__)
_IMPORTED = time.time()


def _ray_module() -> Any | None:
    """The ray module when this process runs under Ray (it is then already imported), else None."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray
    return None


def select_backend(config: EngineConfig) -> str:
    """nccl on whole GPUs; gloo on CPUs or GPUs shared by several ranks (NCCL refuses those). The config
    checked the names; what only this node can tell is whether device "auto" found a GPU for nccl."""
    backend = config.parallel.collective_backend
    if backend == "nccl" and config.parallel.resolved_device() != "cuda":
        raise ValueError("parallel.distributed_backend='nccl' needs parallel.device='cuda'")
    return backend


class Worker(ShmLoopMixin):
    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        world_size: int,
        dist_init_method: str | None,
        device_index: int | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"Worker: rank={rank} must be in [0, world_size={world_size})")
        show_kvray_info_logs()  # kvray -v: this rank's INFO lines (model load, KV cache, graphs) reach the console
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.dist_init_method = dist_init_method
        self.device_index = device_index
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None
        self.profiler = StepProfiler(rank)
        # KVRAY_LOG_COMPILES=1: record every Triton compile (benchmarks/e2e/bench_startup.py reads it).
        self.compile_log = compile_log.install() if os.environ.get("KVRAY_LOG_COMPILES") == "1" else None
        self._marks = {"imported": _IMPORTED, "constructed": time.time()}

    # ---- set-up -----------------------------------------------------------------------------
    def _cuda_index(self) -> int:
        if self.device_index is not None:
            return self.device_index
        ray = _ray_module()
        if ray is not None and ray.get_gpu_ids():
            # Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPUs; find ours among the visible ones.
            gpu_id = str(ray.get_gpu_ids()[0])
            visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
            return visible.index(gpu_id) if gpu_id in visible else 0
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        return local_rank % max(torch.cuda.device_count(), 1)

    def open_rendezvous(self) -> int:
        """Rank 0, before init_device: host the model-parallel groups' store on a port bound at once and
        return it (parallel_state.open_rendezvous says why)."""
        return parallel_state.open_rendezvous(self.world_size, self.config.parallel.step_timeout_s)

    def init_device(self, dist_init_method: str | None = None) -> None:
        """Picks the device, joins the TP group and builds the ModelRunner. The group's address may come
        only now: rank 0 opens it (open_rendezvous) once the worker processes have started."""
        if dist_init_method is not None:
            self.dist_init_method = dist_init_method
        if self.world_size > 1 and not self.dist_init_method:
            raise ValueError("Worker: dist_init_method is required when world_size > 1")
        device_kind = self.config.parallel.resolved_device()
        if device_kind == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("parallel.device='cuda' but CUDA is not available on this node")
            index = self._cuda_index()
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
        else:  # resolved_device() is cpu or cuda; the config rejected any other name
            self.device = torch.device("cpu")
        self._marks["device"] = time.time()
        p = self.config.parallel
        if self.world_size != p.ranks_per_engine:
            raise ValueError(
                f"Worker: world_size={self.world_size} must be pipeline_parallel_size x tensor_parallel_size "
                f"= {p.ranks_per_engine}"
            )
        parallel_state.init_model_parallel(
            self.rank,
            p.tensor_parallel_size,
            p.pipeline_parallel_size,
            self.dist_init_method,
            select_backend(self.config),
            timeout_s=self.config.parallel.step_timeout_s,
            collective_timeout_s=self.config.parallel.resolved_collective_timeout_s,
        )
        self._marks["tp_group"] = time.time()
        torch.manual_seed(self.config.model.seed)
        self.model_runner = ModelRunner(self.config, self.device, self.rank)
        self._marks["runner"] = time.time()

    def start_phases(self, requested: float) -> dict[str, float]:
        """Where this worker's start went since the executor asked for it (engine stats, bench_startup)."""
        return start_timeline.worker_phases(requested, self._marks)

    def _runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError(f"worker rank {self.rank}: init_device() must run first")
        return self.model_runner

    def load_model(self) -> None:
        self._runner().load_model()

    def get_max_model_len(self) -> int:
        return self._runner().max_model_len

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return self._runner().get_kv_cache_specs()

    def determine_num_blocks(self, layer_specs: dict[str, KVCacheSpec] | None = None) -> int:
        """This rank's answer, reduced to the smallest over its TP group (a collective: all ranks call it).
        `layer_specs`: every stage's layers (pipeline parallelism), as the engine will group them."""
        return parallel_state.all_reduce_min(self._runner().determine_num_blocks(layer_specs))

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self._runner().initialize_kv_cache(kv_cache_config)
        if _ray_module() is not None:  # a process of its own; in-process (tests, LocalExecutor) it is the user's
            logger.info("worker rank %d: %d start-up objects frozen", self.rank, freeze_startup_heap())

    # ---- the step ---------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self.profiler.before_step()
        try:
            # A named range per step, so a trace's steps can be told apart.
            with torch.profiler.record_function("execute_model"):
                out = self._runner().execute_model(scheduler_output)
        finally:
            self.profiler.after_step()
        return out

    def reset_requests(self) -> None:
        self._runner().reset_requests()

    # ---- profiling --------------------------------------------------------------------------
    def start_profile(self, trace_dir: str, num_steps: int = 5, skip_steps: int = 0) -> None:
        """Trace the next `num_steps` steps (0 = until stop_profile) after `skip_steps`, into trace_dir
        on this worker's node (a Chrome trace JSON per rank)."""
        self.profiler.request(trace_dir, num_steps, skip_steps)

    def stop_profile(self) -> list[str]:
        """End a running trace; the paths of the traces written since the last call."""
        return self.profiler.stop()

    def start_step_timing(self) -> bool:
        """Record CUDA events around every step's GPU work (benchmarks/e2e/bench_decode_idle.py); False on
        a CPU worker, which has no device timeline to measure."""
        from actors.profiling.step_profiler import StepTimer

        runner = self._runner()
        if runner.device.type != "cuda":
            return False
        runner.step_timer = StepTimer()
        return True

    def collect_step_timing(self) -> list[dict]:
        """The timed steps since start_step_timing (see StepTimer.collect), and timing stops."""
        runner = self._runner()
        timer, runner.step_timer = runner.step_timer, None
        return [] if timer is None else timer.collect()

    def collect_host_phases(self) -> list[dict]:
        """Host-side phases of the timed execute_model calls (StepTimer.host_phases); call before
        collect_step_timing, which ends the timing."""
        timer = self._runner().step_timer
        return [] if timer is None else timer.host_phases()

    def compile_events(self, since: int = 0) -> list[dict]:
        """The Triton compiles after the first `since` (KVRAY_LOG_COMPILES=1; else none)."""
        return [] if self.compile_log is None else self.compile_log.since(since)

    def compiled_ahead(self) -> list[dict]:
        """This rank's dry passes of start-up (actors/worker/compile_ahead.py): variants and wall time each."""
        return [asdict(c) for c in self._runner().compiled_ahead]

    # ---- housekeeping -----------------------------------------------------------------------
    def ping(self) -> int:
        return self.rank

    def shutdown(self) -> None:
        self.stop_shm_loop()
        self.model_runner = None
        parallel_state.destroy_tensor_parallel()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()
