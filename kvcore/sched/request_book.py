"""The scheduler's book of live requests (kvcore/sched/scheduler.py decides each step on it): the waiting
queue and the running list, each request's stop rule, and the ways a request leaves the book: refused
at once, finished from outside (an abort, a client-side stop string) or by its own tokens. A leaving
request gives its blocks back, its finished output waits for the next update_from_output, and its id
goes to the workers with the next step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from kvcore.messages import EngineCoreOutput
from kvcore.request import Request, RequestStatus
from kvcore.sched.admission import RequestFit
from kvcore.sched.stopping import StopRule, make_stop_rule

_RUNNING = RequestStatus.RUNNING


class RequestBook:
    """The live requests of one scheduler, and how they enter and leave."""

    def __init__(self, kv_cache_manager: Any, max_model_len: int, fit: RequestFit) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}  # live: waiting or running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished/aborted since the previous schedule(): the workers drop their state.
        self._finished_req_ids: set[str] = set()
        # Outputs of requests finished outside update_from_output (rejected, aborted).
        self._pending_outputs: list[EngineCoreOutput] = []
        self._pending_ids: set[str] = set()
        self._stop_rules: dict[str, StopRule] = {}
        self._num_preemptions = 0
        self._fit = fit

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests or rid in self._pending_ids:
            raise ValueError(f"add_request: request_id {rid!r} is already in use by an unfinished request")
        reason = self._fit.reject_reason(request)
        if reason is not None:
            # Finished at once, never queued: it could never be scheduled.
            request.status = RequestStatus.FINISHED_ERROR
            request.error = reason
            self._emit_finished(request)
            return
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        rule = self._stop_rules[rid] = make_stop_rule(request, self.max_model_len)
        request.stop_rule = rule
        self.waiting.append(request)

    def abort(self, req_ids: Iterable[str]) -> None:
        """Abort waiting or running requests; unknown or already finished ids are ignored."""
        self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(
        self, req_ids: Iterable[str] | str, finished_status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Finish waiting or running requests from outside (the client aborted them, a client-side stop
        string matched); their blocks go back to the pool now and each gets one finished output.
        Unknown or already finished ids are ignored."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finish_requests: finished_status={finished_status!r} is not a finished status")
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        done: set[str] = set()
        for rid in req_ids:
            request = self.requests.get(rid)
            if request is None or rid in done:
                continue
            done.add(rid)
            self._release(request)
            request.status = finished_status
            self._retire(request)
            self._emit_finished(request)
        if done:
            self._drop_from_queues(done, from_waiting=True)

    def _release(self, request: Request) -> None:
        """Give back what a request about to finish holds: a running one its blocks (a waiting or
        preempted one holds none)."""
        if request.status == _RUNNING:
            self.kv_cache_manager.free(request)

    def _drop_from_queues(self, req_ids: set[str], from_waiting: bool) -> None:
        self.running = [r for r in self.running if r.request_id not in req_ids]
        if from_waiting:
            self.waiting = deque(r for r in self.waiting if r.request_id not in req_ids)

    def _retire(self, request: Request) -> None:
        del self.requests[request.request_id]
        del self._stop_rules[request.request_id]
        request.stop_rule = None  # out of the book: a step's output still in flight skips it
        self._finished_req_ids.add(request.request_id)

    def _emit_finished(self, request: Request) -> None:
        self._pending_ids.add(request.request_id)
        self._pending_outputs.append(
            EngineCoreOutput(
                request.request_id,
                [],
                True,
                request.get_finished_reason(),
                request.stop_reason,
                request.error,
                max(request.num_cached_tokens, 0),
            )
        )

    # ------------------------------------------------------------------ introspection

    def has_unfinished_requests(self) -> bool:
        """True while requests are queued or running, or outputs of finished ones are undelivered."""
        return bool(self.requests) or bool(self._pending_outputs)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    def stats(self) -> dict[str, Any]:
        prefix = self.kv_cache_manager.prefix_cache_stats
        queries, hits = prefix.queries, prefix.hits
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_cache_usage": self.kv_cache_manager.usage,
            "num_preemptions": self._num_preemptions,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        }
