"""The engine loop: scheduler + KV-cache manager on one side, an executor (the TP workers) on the other.

The driver actor wraps it for Ray; tests drive it in process with a LocalExecutor. One step:
schedule -> the workers run it -> the scheduler applies the sampled tokens -> outputs for the client.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

from actors.executor_base import Executor
from cluster.config import EngineConfig
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
        self.scheduler = Scheduler(self.kv_cache_manager, max_num_seqs=sc.max_num_seqs,
                                   max_num_batched_tokens=sc.max_num_batched_tokens,
                                   max_model_len=self.max_model_len,
                                   long_prefill_token_threshold=sc.long_prefill_token_threshold,
                                   debug_invariants=sc.debug_invariants)
        self._num_steps = 0
        self._num_tokens_scheduled = 0
        self._num_partial_prefills = 0  # scheduled chunks that ended before the prompt did
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
        return self.scheduler.has_unfinished_requests()

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        so = self.scheduler.schedule()
        out = self._run(so)
        return self.scheduler.update_from_output(so, out)

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        # A step with nothing to run still goes out when it tells workers to drop state.
        if so.is_empty and not so.finished_req_ids and not so.preempted_req_ids:
            return ModelRunnerOutput([], [], step_id=so.step_id)
        out = self.executor.execute_model(so)
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
        self.executor.shutdown()
