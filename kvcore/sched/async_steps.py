"""Overlapped (async) scheduling: step N+1 is scheduled while the workers still run step N.

The engine submits step N+1 before it reads step N's output, so the workers always have the next step
queued and the GPU does not wait for the driver's bookkeeping. The scheduler therefore plans with
tokens it has not seen yet:

- Pending tokens. A request that samples in a step gets one output placeholder until that step's
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

The synchronous Scheduler does all of this already once `Request.num_output_placeholders` is counted:
its running loop plans with known + pending tokens and skips a request whose pending tokens reach its
limit, its admission waits for a preempted request's token, and its stop check frees a request that
stopped from the waiting queue. This class only counts placeholders, through two hooks.
"""

from __future__ import annotations

from typing import Any

from kvcore.messages import ModelRunnerOutput, SchedulerOutput
from kvcore.request import Request
from kvcore.sched.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    """Scheduler whose steps may be scheduled before the previous step's output is applied."""

    def __init__(self, kv_cache_manager: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_manager, **kwargs)
        # step_id -> (the step, the request of each of its rows that samples in it, else None)
        self._samplers: dict[int, tuple[SchedulerOutput, list[Request | None]]] = {}

    # Which rows sample is decided when the step is scheduled (the rows list); nothing to check later.
    _checks_computed = False

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        # A request samples in this step when the step computes all its known + pending tokens.
        scheduled = scheduler_output.num_scheduled_tokens
        running = self.running
        # Every scheduled request is running; when every running one is scheduled they are the running
        # list itself, in the same order (the steady decode step): no lookup by id.
        reqs = running if len(scheduled) == len(running) else list(map(self.requests.__getitem__, scheduled))
        rows: list[Request | None] = []
        add = rows.append
        for request in reqs:
            p = request.num_output_placeholders
            if request.num_computed_tokens == len(request.all_token_ids) + p:
                request.num_output_placeholders = p + 1
                add(request)
            else:
                add(None)
        self._samplers[scheduler_output.step_id] = (scheduler_output, rows)

    def _step_rows(self, scheduler_output: SchedulerOutput) -> tuple[list[Request | None] | None, Any]:
        record = self._samplers.pop(scheduler_output.step_id, None)
        if record is None:
            return None, None  # not a step of this scheduler: nobody takes a token from it
        step, rows = record
        for request in rows:
            # Still live (in the book): its placeholder becomes a token now.
            if request is not None and request.stop_rule is not None:
                request.num_output_placeholders -= 1
        return rows, step.num_scheduled_tokens

    def _rows_by_id(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput, rows: Any, keys: Any
    ) -> list[Request | None]:
        # A token is taken only by the same live request object the step expected it from (a finished
        # request's id may be reused by a new one before the old step's output arrives).
        expected: dict[str, Request | None] = {} if rows is None else dict(zip(keys, rows, strict=True))
        rules = self._stop_rules
        out: list[Request | None] = []
        for rid in model_runner_output.req_ids:
            rule = rules.get(rid)
            out.append(rule[0] if rule is not None and expected.get(rid) is rule[0] else None)
        return out

    @property
    def num_pending_tokens(self) -> int:
        """Output tokens scheduled but not yet received, over all live requests."""
        return sum(r.num_output_placeholders for r in self.requests.values())
