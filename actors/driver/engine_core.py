"""The engine loop: scheduler + KV-cache manager on one side, an executor (the TP workers) on the other.

The driver actor wraps it for Ray; tests drive it in process with a LocalExecutor. One step:
schedule -> the workers run it -> the scheduler applies the sampled tokens -> outputs for the client.

With scheduler.async_scheduling the steps overlap: the workers answer each step with the output of
the step before it (they launch step N+1's GPU work before reading back step N's sampled tokens, and
feed step N's tokens into step N+1 on the device). So while the driver applies step N's output and
schedules step N+2, the GPU runs step N+1, and the workers' own per-step host work is hidden too (see
kvcore/sched/async_steps.py for how the scheduler plans with tokens it has not seen yet). When nothing
is left to schedule, an empty step collects the last output.

With pipeline parallelism up to `pipeline_parallel_size` + 1 steps are in flight instead (vLLM's batch
queue, one deeper: actors/executor/base.pipeline_depth): a step is submitted without waiting while the
queue has room and something could be scheduled, else the oldest step's output is collected and
applied. The PipelineScheduler never puts one request in two in-flight steps and gives each step its
share of the requests (kvcore/sched/pipeline_steps.py). Async scheduling composes with the queue: the
workers again answer each step with the previous one's output, so the last stage launches step N+1
before it waits for step N's tokens to reach the host; the driver keeps the queue as full as without
it and takes each output one answer later (the step that answered is then "lagging": run, its output
held by the workers). Its requests stay busy until that output arrives, so the scheduler splits the
running requests into one more share than the queue holds steps, and the stages never wait for a
share to come free. An empty step fetches the last held output when nothing else goes out.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Iterable

from actors.config.engine import EngineConfig
from actors.executor.base import Executor, pipeline_depth
from kvcore.kv_cache_manager import KVCacheManager
from kvcore.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from kvcore.request import Request, RequestStatus
from kvcore.sched.async_steps import AsyncScheduler
from kvcore.sched.pipeline_steps import PipelineScheduler
from kvcore.sched.scheduler import Scheduler
from kvcore.spec import KVCacheConfig, make_kv_cache_config, max_concurrency

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        t0 = time.perf_counter()
        specs = executor.get_kv_cache_specs()
        # The executor's answer is already the minimum over ranks; an explicit override wins.
        num_blocks = config.cache.num_gpu_blocks or executor.determine_num_blocks()
        self.kv_cache_config: KVCacheConfig = make_kv_cache_config(specs, num_blocks=num_blocks)
        t1 = time.perf_counter()
        executor.initialize_kv_cache(self.kv_cache_config)  # also captures the CUDA graphs (warm-up)
        self.startup_s = {
            **executor.startup_s,
            "kv_sizing_s": round(t1 - t0, 2),
            "kv_init_capture_s": round(time.perf_counter() - t1, 2),
        }
        logger.info(
            "EngineCore start-up: KV sizing (profile run) %.1f s, KV cache + graph capture + warm-up %.1f s",
            t1 - t0,
            time.perf_counter() - t1,
        )
        self.max_model_len = self._resolve_max_model_len()
        t2 = time.perf_counter()
        executor.open_step_path()
        self.startup_s["step_path_s"] = round(time.perf_counter() - t2, 2)
        self.async_scheduling = config.use_async_scheduling
        self.pipeline_depth = pipeline_depth(config)  # steps in flight at most
        self._new_scheduler()
        self._num_steps = 0
        self._num_tokens_scheduled = 0
        self._num_partial_prefills = 0  # scheduled chunks that ended before the prompt did
        self._num_graph_steps = 0  # steps whose forward replayed a CUDA graph
        self._num_forward_steps = 0  # steps that ran a forward (some tokens scheduled)
        self.max_concurrency = max_concurrency(
            self.kv_cache_config, self.max_model_len, config.scheduler.max_num_batched_tokens
        )
        logger.info(
            "EngineCore: %d KV blocks in %d group(s), max_model_len=%d, max concurrency %.2fx "
            "(requests of max_model_len tokens held at once)",
            num_blocks,
            len(self.kv_cache_config.kv_cache_groups),
            self.max_model_len,
            self.max_concurrency,
        )

    def _new_scheduler(self) -> None:
        self.kv_cache_manager = KVCacheManager(
            self.kv_cache_config, self.max_model_len, enable_caching=self.config.cache.enable_prefix_caching
        )
        sc = self.config.scheduler
        scheduler_cls: type[Scheduler] = (
            PipelineScheduler if self.pipeline_depth > 1 else AsyncScheduler if self.async_scheduling else Scheduler
        )
        # With async scheduling one more step's requests are busy: the lagging one's (see the module doc).
        shares = self.pipeline_depth + int(self.async_scheduling)
        extra: dict[str, Any] = {"depth": shares} if scheduler_cls is PipelineScheduler else {}
        self.scheduler = scheduler_cls(
            self.kv_cache_manager,
            **extra,
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=sc.long_prefill_token_threshold,
            admission_min_batch=self.config.admission()[0],
            admission_max_wait_steps=self.config.admission()[1],
            debug_invariants=sc.debug_invariants,
        )
        self._outstanding: SchedulerOutput | None = None  # async: run by the workers, output not yet back
        # Pipeline parallelism: the steps submitted and not yet collected, oldest first (with their handles).
        self._batches: deque[tuple[SchedulerOutput, Any]] = deque()
        # Pipeline parallelism with async scheduling: the step the workers ran last, whose output they hold
        # until they answer the next one.
        self._lagging: SchedulerOutput | None = None

    def reset_requests(self) -> None:
        """Forget every request, here and on the workers, keeping the workers, their weights and their
        KV cache: after a step raised with every worker alive (a StepError), the driver re-queues the
        requests it still answers for, which then run again by recompute."""
        while self._batches:  # the other in-flight steps' answers come first, whatever they are
            _, handle = self._batches.popleft()
            try:
                self.executor.collect_step(handle)
            except Exception as e:  # noqa: BLE001 - their requests are re-queued with the rest
                logger.info("a pipelined step in flight failed too: %s", e)
        self._new_scheduler()  # also forgets the lagging step: the workers drop what they hold
        self.executor.collective_rpc("reset_requests")

    def running_request_ids(self) -> list[str]:
        """The requests that hold KV blocks now: those the last step ran (or was about to)."""
        return [r.request_id for r in self.scheduler.running]

    def _resolve_max_model_len(self) -> int:
        # The workers resolved it from the model's config (they hold it); all ranks agree.
        return int(self.executor.collective_rpc("get_max_model_len")[0])

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, req_ids: Iterable[str]) -> None:
        self.scheduler.abort(req_ids)

    def finish_requests(
        self, req_ids: Iterable[str], finished_status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Finish requests from outside before the next step (the client's stop string matched, its
        stream went away): blocks go back to the pool now; with a step in flight its late token for
        them is dropped."""
        self.scheduler.finish_requests(req_ids, finished_status)

    @property
    def step_in_flight(self) -> bool:
        """Async scheduling: a step is running at the workers and its output is not back yet."""
        return self._outstanding is not None or bool(self._batches) or self._lagging is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.step_in_flight

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        if self.pipeline_depth > 1:
            return self._step_pipelined()
        if self.async_scheduling:
            return self._step_async()
        so = self.scheduler.schedule()
        if not self._needs_run(so):
            return self.scheduler.update_from_output(so, _empty(so))
        out = self.executor.execute_model(so)
        if out is None:
            raise RuntimeError(f"workers answered synchronous step {so.step_id} with no output")
        return self.scheduler.update_from_output(so, self._count(so, out))

    def _step_async(self) -> list[EngineCoreOutput]:
        """Run step N+1; the workers answer with step N's output, which is applied now."""
        so = self.scheduler.schedule()
        prev = self._outstanding
        if not self._needs_run(so) and prev is None:
            return self.scheduler.update_from_output(so, _empty(so))
        out = self.executor.execute_model(so)
        outputs: list[EngineCoreOutput] = []
        if prev is not None:
            if out is None or out.step_id != prev.step_id:
                got = None if out is None else out.step_id
                raise RuntimeError(
                    f"workers answered step {so.step_id} with the output of step {got}; "
                    f"expected the previous step {prev.step_id}"
                )
            outputs = self.scheduler.update_from_output(prev, self._count(prev, out))
        if so.is_empty:
            # Nothing was launched: the workers hold no step now, and this one has no tokens.
            self._outstanding = None
            return outputs + self.scheduler.update_from_output(so, _empty(so))
        self._outstanding = so
        return outputs

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        """Submit a step while the queue has room and something runs; else apply the oldest step's output."""
        outputs: list[EngineCoreOutput] = []
        # Async: with nothing else in flight, the lagging step's output comes back only with an answer.
        fetch = self._lagging is not None and not self._batches
        if len(self._batches) < self.pipeline_depth and (self.scheduler.has_unfinished_requests() or fetch):
            so = self.scheduler.schedule()
            if self._needs_run(so) or fetch:
                self._batches.append((so, self.executor.submit_step(so)))
                if not so.is_empty and len(self._batches) < self.pipeline_depth:
                    return outputs  # room for one more: schedule again before waiting for any
            else:
                outputs = self.scheduler.update_from_output(so, _empty(so))
        if not self._batches:
            return outputs
        so, handle = self._batches.popleft()
        out = self.executor.collect_step(handle)
        if not self.async_scheduling:
            if out is None:
                raise RuntimeError(f"workers answered pipelined step {so.step_id} with no output")
            if out.step_id != so.step_id:
                raise RuntimeError(f"workers answered step {so.step_id} with the output of step {out.step_id}")
            return outputs + self.scheduler.update_from_output(so, self._count(so, out))
        # The answer carries the lagging step's output; `so` lags now (an empty step launched nothing).
        prev, self._lagging = self._lagging, (None if so.is_empty else so)
        if prev is not None:
            if out is None or out.step_id != prev.step_id:
                got = None if out is None else out.step_id
                raise RuntimeError(
                    f"workers answered step {so.step_id} with the output of step {got}; expected the lagging "
                    f"step {prev.step_id}"
                )
            outputs += self.scheduler.update_from_output(prev, self._count(prev, out))
        elif out is not None:
            raise RuntimeError(f"workers answered step {so.step_id} with step {out.step_id}'s output; none was held")
        if so.is_empty:
            outputs += self.scheduler.update_from_output(so, _empty(so))
        return outputs

    @staticmethod
    def _needs_run(so: SchedulerOutput) -> bool:
        # A step with nothing to run still goes out when it tells workers to drop state.
        return not so.is_empty or bool(so.finished_req_ids) or bool(so.preempted_req_ids)

    def _count(self, so: SchedulerOutput, out: ModelRunnerOutput) -> ModelRunnerOutput:
        self._num_steps += 1
        self._num_tokens_scheduled += so.total_num_scheduled_tokens
        self._num_partial_prefills += sum(1 for t in out.sampled_token_ids if not t)
        self._num_graph_steps += bool(out.cudagraph)
        self._num_forward_steps += so.total_num_scheduled_tokens > 0
        return out

    def stats(self) -> dict[str, Any]:
        stats = dict(self.scheduler.stats())
        stats.update(
            num_steps=self._num_steps,
            num_tokens_scheduled=self._num_tokens_scheduled,
            num_partial_prefills=self._num_partial_prefills,
            num_graph_steps=self._num_graph_steps,
            **self.startup_s,
            num_forward_steps=self._num_forward_steps,
            graph_step_share=self._num_graph_steps / max(self._num_forward_steps, 1),
            num_blocks=self.kv_cache_config.num_blocks,
            num_kv_cache_groups=len(self.kv_cache_config.kv_cache_groups),
            max_concurrency=round(self.max_concurrency, 2),
        )
        return stats

    def shutdown(self) -> None:
        self._outstanding = None  # its output is lost with the workers; the driver re-queues requests
        self._batches.clear()
        self._lagging = None
        self.executor.shutdown()


def _empty(so: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput([], [], step_id=so.step_id)
