"""Overlapped (async) scheduling: step N+1 is scheduled while the workers still run step N.

The engine submits step N+1 before it reads step N's output, so the workers always have the next step
queued and the GPU does not wait for the driver's bookkeeping. The scheduler therefore plans with
tokens it has not seen yet:

- Pending tokens. A request that samples in a step gets one pending output token until that step's
  output arrives. Its next decode is scheduled at once: the token to feed is the one the workers sampled
  themselves (each rank keeps its own sampled tokens; the scheduler never sends them), so the control
  plane is unchanged. Blocks are only registered in the prefix cache over known tokens (the manager
  caps caching at the request's known token count), so a pending token is never hashed.
- Late stops. A stop (EOS, stop token) is seen only when its step's output arrives, after the next
  step has been scheduled for the request. The request finishes then; the extra token the workers
  computed for it is discarded when that step's output arrives (the request is gone), and its blocks
  are freed at once: the workers run steps in order, so the in-flight step's writes land before any
  later step can reuse those blocks.
- Known lengths. A request whose known plus pending tokens already reach its length limit
  (max_tokens, max_model_len) is not scheduled again: it finishes when its tokens arrive. So no step
  ever computes a position at or beyond max_model_len.
- Preemption. A request preempted while its token is pending gets the token when the output arrives
  (it stays queued); it is resumed only once nothing of it is pending, so the full token list a resume
  carries is complete.

Each step remembers which request objects it expects a token from; a token is accepted only for that
same live request (a finished request's id may be reused by a new one before the old step's output
arrives).
"""
from __future__ import annotations

from itertools import islice
from typing import Any

from kvcore.messages import (BlockIds, CachedRequestData, EngineCoreOutput, ModelRunnerOutput,
                             SchedulerOutput)
from kvcore.request import Request, RequestStatus
from kvcore.scheduler import Scheduler
from kvcore.stopping import append_until_stop, set_finished_status

_PREEMPTED = RequestStatus.PREEMPTED


class AsyncScheduler(Scheduler):
    """Scheduler whose steps may be scheduled before the previous step's output is applied."""

    def __init__(self, kv_cache_manager: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_manager, **kwargs)
        self._num_pending: dict[str, int] = {}           # req_id -> output tokens not yet received
        self._samplers: dict[int, dict[str, Request]] = {}  # step_id -> requests that sample in it
        self._step_samplers: dict[str, Request] = {}
        self._num_running_scheduled = 0

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        self._step_samplers = samplers = {}
        so = super().schedule()
        # The running loop recorded its samplers; requests admitted from the queue (after the running
        # ones in num_scheduled_tokens) sample when their chunk reaches the end of their tokens.
        for rid in islice(so.num_scheduled_tokens, self._num_running_scheduled, None):
            request = self.requests[rid]
            if request.num_computed_tokens >= request.num_tokens:
                samplers[rid] = request
        pending = self._num_pending
        for rid in samplers:
            pending[rid] = pending.get(rid, 0) + 1
        self._samplers[so.step_id] = samplers
        return so

    def _schedule_running(self, budget: int, num_scheduled: dict[str, int], cached: CachedRequestData,
                          preempted: set[str]) -> int:
        # The base loop with pending tokens: a request's tokens are known + pending.
        running = self.running
        pending = self._num_pending
        rules = self._stop_rules
        samplers = self._step_samplers
        threshold = self.long_prefill_token_threshold
        last_pos = self.max_model_len - 1
        fast_bs = self._fast_block_size
        add_computed = cached.num_computed_tokens.append
        allocate = self.kv_cache_manager.allocate_slots
        deltas: list[tuple[int, BlockIds]] = []
        for request in running:
            if budget <= 0:
                break
            rid = request.request_id
            c = request.num_computed_tokens
            total = len(request.all_token_ids) + pending.get(rid, 0)
            if total >= rules[rid].token_limit:
                continue  # its pending tokens reach its length limit: it finishes when they arrive
            n = total - c
            if n != 1:
                if threshold and n > threshold:
                    n = threshold
                if n > budget:
                    n = budget
                if n > last_pos - c:
                    n = last_pos - c
                if n <= 0:
                    continue
            r = c % fast_bs
            if not r or r + n >= fast_bs:
                new_blocks = allocate(request, n)
                if new_blocks is None:
                    new_blocks = self._preempt_until_fits(request, n, preempted)
                    if new_blocks is None:
                        break
                if any(new_blocks.blocks):
                    deltas.append((len(num_scheduled), new_blocks.get_block_ids()))
            add_computed(c)
            num_scheduled[rid] = n
            request.num_computed_tokens = c + n
            budget -= n
            if c + n >= total:
                samplers[rid] = request
        cached.add_running_rows(num_scheduled, deltas)
        self._num_running_scheduled = len(num_scheduled)
        return budget

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int], cached: CachedRequestData,
                          new_reqs: list) -> int:
        # A request preempted while its token was pending waits for it: a resume carries the full
        # token list. (The step that preempts admits nobody, and the next one follows the output of
        # the victim's last step, so this only guards the invariant.)
        if self.waiting and self._num_pending.get(self.waiting[0].request_id):
            return budget
        return super()._schedule_waiting(budget, num_scheduled, cached, new_reqs)

    # ------------------------------------------------------------------ update

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput | None) -> list[EngineCoreOutput]:
        samplers = self._samplers.pop(scheduler_output.step_id, {})
        pending = self._num_pending
        requests = self.requests
        for rid, request in samplers.items():
            if requests.get(rid) is request:
                left = pending[rid] - 1
                if left:
                    pending[rid] = left
                else:
                    del pending[rid]
        self._step_samplers = samplers  # what _apply_sampled accepts tokens for
        return super().update_from_output(scheduler_output, model_runner_output)

    def _apply_sampled(self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput,
                       outputs: list[EngineCoreOutput]) -> set[str]:
        samplers = self._step_samplers
        rules = self._stop_rules
        stopped: set[str] = set()
        left_queue: set[str] = set()
        for rid, token_ids in zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids):
            if not token_ids:
                continue
            request = samplers.get(rid)
            rule = rules.get(rid)
            # Finished (a late stop, an abort) since the step was scheduled, or not expected to sample.
            if request is None or rule is None or rule.request is not request:
                continue
            _, token_limit, _, _, stops = rule
            if len(token_ids) == 1:  # the common case, inlined as in the base class
                tok = token_ids[0]
                request.output_token_ids.append(tok)
                request.all_token_ids.append(tok)
            else:
                token_ids = append_until_stop(rule, token_ids)
                tok = token_ids[-1]
            if request.num_tokens < token_limit and tok not in stops:
                outputs.append(EngineCoreOutput(rid, token_ids, False, None, None, None,
                                                request.num_cached_tokens))
                continue
            if request.status == _PREEMPTED:
                left_queue.add(rid)  # preempted with its token pending: queued, holding no blocks
            else:
                self.kv_cache_manager.free(request)
            set_finished_status(rule, tok)
            self._retire(request)
            stopped.add(rid)
            outputs.append(EngineCoreOutput(rid, token_ids, True, request.get_finished_reason(),
                                            request.stop_reason, None, request.num_cached_tokens))
        if left_queue:
            self.waiting = type(self.waiting)(r for r in self.waiting if r.request_id not in left_queue)
        return stopped

    def _retire(self, request: Request) -> None:
        super()._retire(request)
        self._num_pending.pop(request.request_id, None)

    # ------------------------------------------------------------------ introspection

    @property
    def num_pending_tokens(self) -> int:
        """Output tokens scheduled but not yet received, over all requests."""
        return sum(self._num_pending.values())
