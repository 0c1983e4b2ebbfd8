"""What the engine loop needs from whatever runs the workers: in-process, processes, or Ray actors.

Every method fans out to all tensor-parallel ranks; `execute_model` returns rank 0's answer.
"""
from __future__ import annotations

import abc
from typing import Any

from kvcore.messages import ModelRunnerOutput, SchedulerOutput
from kvcore.spec import KVCacheConfig, KVCacheSpec


class Executor(abc.ABC):
    @abc.abstractmethod
    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `Worker.<method>(*args, **kwargs)` on every rank; the answers in rank order."""

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Send one step to every rank; rank 0's output."""

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
