"""What the engine loop needs from whatever runs the workers: in-process, processes, or Ray actors.

Every method fans out to all ranks (pipeline_parallel_size x tensor_parallel_size of them); `execute_model`
returns the answering rank's output: the first TP rank of the last pipeline stage, the one that samples
(rank 0 without pipeline parallelism).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from kvcore.messages import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:  # torch-free at run time: the driver process imports this module
    from kvcore.spec import KVCacheConfig, KVCacheSpec


def pipeline_depth(config: Any) -> int:
    """Steps the engine keeps in flight: one without pipeline stages (async scheduling overlaps inside
    the workers instead), else one per stage and one more. With exactly one per stage the first stage
    idles for the driver's round trip each cycle (collect the oldest step, apply it, schedule and send
    the next); the extra step is queued at the first stage when it finishes, which hides that round trip
    (benchmarks/host/bench_pipeline.py --executor local, PP=4 of 20 ms stages on the loaded 2-core CPU
    host: 3.02x -> 3.17x the one-stage steps/s, measured one after the other, not side by side)."""
    pp = int(config.parallel.pipeline_parallel_size)
    return 1 if pp == 1 else pp + 1


class Executor(abc.ABC):
    # Seconds each set-up phase took (probe, worker start, model load), for the engine's stats.
    startup_s: Mapping[str, float] = MappingProxyType({})
    # The engine's EngineConfig, set by every executor (typed loosely: this module stays torch-free).
    config: Any = None

    @abc.abstractmethod
    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `Worker.<method>(*args, **kwargs)` on every rank; the answers in rank order."""

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Send one step to every rank; rank 0's output (with async scheduling the previous step's, None
        when none was in flight)."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    def submit_step(self, scheduler_output: SchedulerOutput) -> Any:
        """Send one step without waiting for its output (pipeline parallelism keeps several in flight);
        collect_step(handle) returns it. Steps are collected in the order they were submitted. This
        default runs the step at once (an executor that cannot overlap steps)."""
        return self.execute_model(scheduler_output)

    def collect_step(self, handle: Any) -> ModelRunnerOutput | None:
        out: ModelRunnerOutput | None = handle
        return out

    # Set-up steps, the same for every executor.
    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        """Every attention layer's spec: each pipeline stage answers for its own layers."""
        specs: dict[str, KVCacheSpec] = {}
        for answer in self.collective_rpc("get_kv_cache_specs"):
            specs.update(answer)
        return specs

    def determine_num_blocks(self) -> int:
        """The smallest block count any rank can hold. With pipeline stages each rank sizes the blocks of
        its own layers as the engine's groups (of every stage's layers) lay them out."""
        if self.pipeline_parallel_size > 1:
            return min(self.collective_rpc("determine_num_blocks", self.get_kv_cache_specs()))
        return min(self.collective_rpc("determine_num_blocks"))

    @property
    def pipeline_parallel_size(self) -> int:
        return 1 if self.config is None else int(self.config.parallel.pipeline_parallel_size)

    @property
    def answer_rank(self) -> int:
        """The rank whose output a step returns: the first TP rank of the last stage, which samples."""
        if self.config is None:
            return 0
        p = self.config.parallel
        return int((p.pipeline_parallel_size - 1) * p.tensor_parallel_size)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.collective_rpc("initialize_kv_cache", kv_cache_config)

    def open_step_path(self) -> None:
        """Called once the set-up calls are done: build whatever carries the steps now, so that the
        first request does not wait for it. A hook, not a duty: by default it does nothing, for an
        executor whose step path exists from its start (the in-process and local-process ones); the Ray
        executor overrides it to compile its graph."""
        return None
