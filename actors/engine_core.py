"""The engine loop: scheduler + KV-cache manager on one side, an executor (the TP workers) on the other.

The driver actor wraps it for Ray; tests drive it in process with a LocalExecutor. One step:
schedule -> the workers run it -> the scheduler applies the sampled tokens -> outputs for the client.

With scheduler.async_scheduling the steps overlap: step() schedules and submits step N+1, then waits
for step N's output and applies it, so one step is always queued at the workers while the driver does
its bookkeeping (see kvcore/async_scheduler.py). Executors that can submit without waiting provide
`execute_model_async(so) -> handle with .result()`; others run the step at submission, which keeps the
scheduling semantics (and so the tests) the same without the overlap.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, Iterable

from actors.executor_base import Executor
from cluster.config import EngineConfig
from kvcore.async_scheduler import AsyncScheduler
from kvcore.kv_cache_manager import KVCacheManager
from kvcore.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from kvcore.request import Request
from kvcore.scheduler import Scheduler
from kvcore.spec import KVCacheConfig, make_kv_cache_config

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        specs = executor.get_kv_cache_specs()
        # The executor's answer is already the minimum over ranks; an explicit override wins.
        num_blocks = config.cache.num_gpu_blocks or executor.determine_num_blocks()
        self.kv_cache_config: KVCacheConfig = make_kv_cache_config(specs, num_blocks=num_blocks)
        executor.initialize_kv_cache(self.kv_cache_config)
        self.max_model_len = self._resolve_max_model_len()
        self.kv_cache_manager = KVCacheManager(self.kv_cache_config, self.max_model_len,
                                               enable_caching=config.cache.enable_prefix_caching)
        sc = config.scheduler
        self.async_scheduling = sc.async_scheduling
        scheduler_cls = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(self.kv_cache_manager, max_num_seqs=sc.max_num_seqs,
                                   max_num_batched_tokens=sc.max_num_batched_tokens,
                                   max_model_len=self.max_model_len,
                                   long_prefill_token_threshold=sc.long_prefill_token_threshold,
                                   debug_invariants=sc.debug_invariants)
        self._num_steps = 0
        self._num_tokens_scheduled = 0
        self._num_partial_prefills = 0  # scheduled chunks that ended before the prompt did
        self._inflight: deque[tuple[SchedulerOutput, Any]] = deque()  # async: submitted, not applied
        logger.info("EngineCore: %d KV blocks in %d group(s), max_model_len=%d", num_blocks,
                    len(self.kv_cache_config.kv_cache_groups), self.max_model_len)

    def _resolve_max_model_len(self) -> int:
        # The workers resolved it from the model's config (they hold it); all ranks agree.
        return int(self.executor.collective_rpc("get_max_model_len")[0])

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, req_ids: Iterable[str]) -> None:
        self.scheduler.abort(req_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._inflight)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        if self.async_scheduling:
            return self._step_async()
        so = self.scheduler.schedule()
        out = self._count(so, self.executor.execute_model(so)) if self._needs_run(so) else _empty(so)
        return self.scheduler.update_from_output(so, out)

    def _step_async(self) -> list[EngineCoreOutput]:
        """Submit step N+1, then apply step N: one step stays queued at the workers between calls."""
        so = self.scheduler.schedule()
        outputs: list[EngineCoreOutput] = []
        if self._needs_run(so):
            self._inflight.append((so, self._submit(so)))
            if len(self._inflight) > 1:
                outputs = self._complete_oldest()
            return outputs
        # Nothing to run: apply what is in flight, then this empty step, in step order.
        while self._inflight:
            outputs += self._complete_oldest()
        return outputs + self.scheduler.update_from_output(so, _empty(so))

    def _submit(self, so: SchedulerOutput) -> Any:
        submit = getattr(self.executor, "execute_model_async", None)
        if submit is not None:
            return submit(so)
        return _Done(self.executor.execute_model(so))

    def _complete_oldest(self) -> list[EngineCoreOutput]:
        so, handle = self._inflight.popleft()
        out = self._count(so, handle.result())
        return self.scheduler.update_from_output(so, out)

    @staticmethod
    def _needs_run(so: SchedulerOutput) -> bool:
        # A step with nothing to run still goes out when it tells workers to drop state.
        return not so.is_empty or bool(so.finished_req_ids) or bool(so.preempted_req_ids)

    def _count(self, so: SchedulerOutput, out: ModelRunnerOutput) -> ModelRunnerOutput:
        self._num_steps += 1
        self._num_tokens_scheduled += so.total_num_scheduled_tokens
        self._num_partial_prefills += sum(1 for t in out.sampled_token_ids if not t)
        return out

    def stats(self) -> dict[str, Any]:
        stats = dict(self.scheduler.stats())
        stats.update(num_steps=self._num_steps, num_tokens_scheduled=self._num_tokens_scheduled,
                     num_partial_prefills=self._num_partial_prefills,
                     num_blocks=self.kv_cache_config.num_blocks,
                     num_kv_cache_groups=len(self.kv_cache_config.kv_cache_groups))
        return stats

    def shutdown(self) -> None:
        self._inflight.clear()  # their outputs are lost with the workers; the driver re-queues requests
        self.executor.shutdown()


class _Done:
    """The handle of a step that already ran (executors without asynchronous submission)."""

    def __init__(self, out: ModelRunnerOutput) -> None:
        self._out = out

    def result(self) -> ModelRunnerOutput:
        return self._out


def _empty(so: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput([], [], step_id=so.step_id)
