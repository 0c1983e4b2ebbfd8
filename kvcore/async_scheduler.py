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

from kvcore.messages import SchedulerOutput
from kvcore.request import Request
from kvcore.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    """Scheduler whose steps may be scheduled before the previous step's output is applied."""

    def __init__(self, kv_cache_manager: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_manager, **kwargs)
        self._samplers: dict[int, dict[str, Request]] = {}  # step_id -> requests that sample in it

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        # A request samples in this step when the step computes all its known + pending tokens.
        requests = self.requests
        samplers: dict[str, Request] = {}
        for rid in scheduler_output.num_scheduled_tokens:
            request = requests[rid]
            if request.num_computed_tokens == len(request.all_token_ids) + request.num_output_placeholders:
                request.num_output_placeholders += 1
                samplers[rid] = request
        self._samplers[scheduler_output.step_id] = samplers

    def _expected_samplers(self, scheduler_output: SchedulerOutput) -> dict[str, Request]:
        samplers = self._samplers.pop(scheduler_output.step_id, {})
        requests = self.requests
        for rid, request in samplers.items():
            if requests.get(rid) is request:  # still live: its placeholder becomes a token now
                request.num_output_placeholders -= 1
        return samplers

    @property
    def num_pending_tokens(self) -> int:
        """Output tokens scheduled but not yet received, over all live requests."""
        return sum(r.num_output_placeholders for r in self.requests.values())
