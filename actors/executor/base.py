"""What the engine loop needs from whatever runs the workers: in-process, processes, or Ray actors.

Every method fans out to all tensor-parallel ranks; `execute_model` returns rank 0's answer.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from kvcore.messages import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:  # torch-free at run time: the driver process imports this module
    from kvcore.spec import KVCacheConfig, KVCacheSpec


class Executor(abc.ABC):
    # Seconds each set-up phase took (probe, worker start, model load), for the engine's stats.
    startup_s: Mapping[str, float] = MappingProxyType({})

    @abc.abstractmethod
    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `Worker.<method>(*args, **kwargs)` on every rank; the answers in rank order."""

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Send one step to every rank; rank 0's output (with async scheduling the previous step's, None
        when none was in flight)."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    # Set-up steps, the same for every executor.
    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return self.collective_rpc("get_kv_cache_specs")[0]

    def determine_num_blocks(self) -> int:
        """The smallest block count any rank can hold."""
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.collective_rpc("initialize_kv_cache", kv_cache_config)

    def open_step_path(self) -> None:
        """Called once the set-up calls are done: build whatever carries the steps now, so that the
        first request does not wait for it."""
