"""The scheduler of a pipeline-parallel engine: several steps (batches) in flight at once, one request in
at most one of them.

With PP stages and one step in flight, every stage but one idles: stage 2 waits for stage 1's step, and
stage 1 for the driver's next one. The engine (actors/driver/engine_core.py) therefore keeps up to PP
steps in flight, vLLM's batch queue: while the last stage runs batch k, the first runs batch k+1. A
request's next step needs the token its previous step samples, so a request in an in-flight batch is
not scheduled again until that batch's output is applied (vLLM's rule too), and each batch takes at
most its share (1/depth) of the live requests, so the running requests split into `depth` groups that take
turns (one batch of all of them would leave the next batches empty). With async scheduling the engine asks
for one share more than it keeps steps in flight: a step's output then arrives one answer later.

Everything else is the synchronous Scheduler's: while `schedule()` runs, the busy requests are set
aside from the running list, with those past the batch's share (so they are neither scheduled nor
preempted, and their rows still count against max_num_seqs), and put back after it, in their places.
Because the first stage never sampled the tokens it must embed, each step carries the scheduled tokens
past each request's prompt (`SchedulerOutput.pipeline_token_ids`).
"""

from __future__ import annotations

from typing import Any

from kvcore.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from kvcore.sched.scheduler import Scheduler


class PipelineScheduler(Scheduler):
    def __init__(self, kv_cache_manager: Any, depth: int = 2, **kwargs: Any) -> None:
        super().__init__(kv_cache_manager, **kwargs)
        if depth < 1:
            raise ValueError(f"PipelineScheduler: depth={depth} must be >= 1 (the steps in flight at most)")
        self.depth = depth
        self._busy: dict[int, set[str]] = {}  # step_id -> the requests its batch runs (not yet applied)

    @property
    def busy_request_ids(self) -> set[str]:
        return set().union(*self._busy.values()) if self._busy else set()

    def schedule(self) -> SchedulerOutput:
        busy = self.busy_request_ids
        running = self.running
        limit = self.max_num_seqs
        # A batch takes its share of the live requests, so that the next ones have requests to run too
        # (one batch of every request would leave the others empty, and the stages idle).
        share = max(1, -(-(len(running) + len(self.waiting)) // self.depth))
        free = [r for r in running if r.request_id not in busy]
        chosen = {id(r) for r in free[:share]}
        held = [(i, r) for i, r in enumerate(running) if id(r) not in chosen]
        check, self.debug_invariants = self.debug_invariants, False  # the book is split until they are back
        # Aside while this batch is decided: neither scheduled nor preempted, and their rows still count
        # against max_num_seqs; new requests join up to the batch's share.
        self.running = [r for r in running if id(r) in chosen]
        self.max_num_seqs = min(share, len(self.running) + max(0, limit - len(running)))
        try:
            out = super().schedule()
        finally:
            self.debug_invariants = check
            self.max_num_seqs = limit
            if held:
                merged = self.running
                for i, r in held:  # back in their places (preemption takes victims from the tail)
                    merged.insert(min(i, len(merged)), r)
                self.running = merged
        if check:
            self._check_invariants()
        if out.num_scheduled_tokens:
            self._busy[out.step_id] = set(out.num_scheduled_tokens)
        out.pipeline_token_ids = self._tokens_to_embed(out)
        return out

    def _tokens_to_embed(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """The scheduled tokens past each running request's prompt (new requests and resumed ones
        carry their full token lists already)."""
        tokens: dict[str, list[int]] = {}
        cached = out.scheduled_cached_reqs
        scheduled = out.num_scheduled_tokens
        for rid, c, resumed in zip(
            cached.req_ids, cached.num_computed_tokens, cached.resumed_from_preemption, strict=True
        ):
            if resumed:
                continue
            request = self.requests[rid]
            start = max(c, len(request.prompt_token_ids))
            end = c + scheduled[rid]
            if end > start:
                tokens[rid] = list(request.all_token_ids[start:end])
        return tokens

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput | None
    ) -> list[EngineCoreOutput]:
        self._busy.pop(scheduler_output.step_id, None)
        return super().update_from_output(scheduler_output, model_runner_output)

    def has_busy_steps(self) -> bool:
        return bool(self._busy)
