"""Continuous-batching scheduler (vLLM V1 semantics).

Every step it walks the running requests first, in order, then the waiting ones, under a token
budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`). Prefill is chunked to the
budget (and to `long_prefill_token_threshold`). When the KV-cache pool runs dry for a running
request, the last running request is preempted by recompute and goes back to the head of the
waiting queue. The output of a step is a `SchedulerOutput` holding only block-id deltas for
requests the workers already know. The scheduler never touches a tensor.
"""

from __future__ import annotations

from typing import Any

from kvcore.messages import (
    BlockIds,
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvcore.request import Request, RequestStatus
from kvcore.sched.admission import AdmissionGate, RequestFit, check_positive_int
from kvcore.sched.logprob_outputs import attach_logprobs
from kvcore.sched.request_book import RequestBook
from kvcore.sched.stopping import append_until_stop, set_finished_status, stops_on

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED


class Scheduler(RequestBook):
    """Decides, each step, which requests run how many tokens, and with which KV-cache blocks."""

    def __init__(
        self,
        kv_cache_manager: Any,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        long_prefill_token_threshold: int = 0,
        admission_min_batch: int = 1,
        admission_max_wait_steps: int = 16,
        debug_invariants: bool = False,
    ) -> None:
        check_positive_int("max_num_seqs", max_num_seqs, 1)
        check_positive_int("admission_min_batch", admission_min_batch, 1)
        check_positive_int("admission_max_wait_steps", admission_max_wait_steps, 0)
        check_positive_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        check_positive_int("max_model_len", max_model_len, 1)
        check_positive_int("long_prefill_token_threshold", long_prefill_token_threshold, 0)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.admission_min_batch = admission_min_batch
        self._gate = AdmissionGate(max_num_seqs, admission_min_batch, admission_max_wait_steps)
        self.debug_invariants = debug_invariants
        super().__init__(
            kv_cache_manager,
            max_model_len,
            RequestFit(
                kv_cache_manager.kv_cache_config,
                kv_cache_manager.block_pool.num_blocks,
                max_model_len,
                min(max_num_batched_tokens, long_prefill_token_threshold or max_num_batched_tokens),
            ),
        )
        self._step_id = 0
        self._last_step: tuple[SchedulerOutput | None, list[Request | None] | None] = (None, None)
        # Tokens a running request may add without asking the manager for blocks: only when it crosses
        # a multiple of this. 1 asks the manager every step, as vLLM does (the simulation test compares).
        self.fast_block_size = self._fit.fast_block_size

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached = CachedRequestData()
        preempted: set[str] = set()

        budget = self._schedule_running(budget, num_scheduled, cached, preempted)
        new_reqs: list[NewRequestData] = []
        # As in vLLM: a step that had to preempt admits nobody, or the victim could bounce back.
        if not preempted:
            budget = self._schedule_waiting(budget, num_scheduled, cached, new_reqs)

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            # Both loops take exactly what they schedule out of the budget: no need to sum the dict.
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=preempted,
            step_id=self._step_id,
        )
        self._finished_req_ids = set()
        self._update_after_schedule(out)
        if self.debug_invariants:
            self._check_invariants()
        return out

    def _schedule_running(
        self, budget: int, num_scheduled: dict[str, int], cached: CachedRequestData, preempted: set[str]
    ) -> int:
        # The hot loop of a decode-heavy step: kept flat on purpose (locals, no per-request calls
        # unless blocks may change).
        running = self.running
        threshold = self.long_prefill_token_threshold
        last_pos = self.max_model_len - 1  # the final token's KV is never needed
        fast_bs = self.fast_block_size
        add_computed = cached.num_computed_tokens.append
        allocate = self.kv_cache_manager.allocate_slots
        num_cached = getattr(self.kv_cache_manager, "num_cached_blocks", None)  # a stand-in manager may lack it
        # Most steps give few requests new blocks: record (row, ids) for those, fill the rest with None.
        deltas: list[tuple[int, BlockIds]] = []
        # Iterating while preemption pops from the tail is safe: the iterator never reaches a victim.
        for request in running:
            if budget <= 0:
                break
            c = request.num_computed_tokens
            p = request.num_output_placeholders  # always 0 unless steps overlap
            n = len(request.all_token_ids) + p
            if p and n >= request.stop_rule[1]:  # StopRule.token_limit
                continue  # its pending tokens reach its length limit: it finishes when they arrive
            n -= c
            if n != 1:  # a decode (n == 1) always fits: budget >= 1 and c + 1 < max_model_len
                if threshold and n > threshold:
                    n = threshold
                if n > budget:
                    n = budget
                if n > last_pos - c:
                    n = last_pos - c
                if n <= 0:
                    continue
            r = c % fast_bs
            # The manager is asked when a block is needed or filled. Not when the step fills the last
            # block but some of its tokens are still in flight (async): then nothing is allocated, and
            # nothing registered either once every older known block is (the manager's count says so).
            if (not r or r + n >= fast_bs) and (
                not r
                or r + n != fast_bs
                or num_cached is None
                or len(request.all_token_ids) >= c + n
                or len(request.all_token_ids) // fast_bs > num_cached[request.request_id]
            ):
                new_blocks = allocate(request, n)
                if new_blocks is None:
                    new_blocks = self._preempt_until_fits(request, n, preempted)
                    if new_blocks is None:
                        break  # the request preempted itself: it was the last one
                if any(new_blocks.blocks):  # most calls only register a filled block
                    deltas.append((len(num_scheduled), new_blocks.get_block_ids()))
            add_computed(c)
            num_scheduled[request.request_id] = n
            request.num_computed_tokens = c + n
            budget -= n
        cached.add_running_rows(num_scheduled, deltas)
        return budget

    def _preempt_until_fits(self, request: Request, n: int, preempted: set[str]) -> Any:
        """After allocate_slots failed for a running request: preempt from the tail until it fits.

        Returns the new blocks, or None when `request` itself had to be preempted.
        """
        manager = self.kv_cache_manager
        while True:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return None
            new_blocks = manager.allocate_slots(request, n)
            if new_blocks is not None:
                return new_blocks

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = _PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(request)

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Hook: the step is decided. The synchronous scheduler applies its output before the next
        schedule(); it keeps the step's request objects, in row order, when they are the running list
        itself (every running request scheduled: the steady decode step), so update_from_output can
        take them by position instead of by id."""
        running = self.running
        rows: list[Request | None] | None = (
            list(running) if len(scheduler_output.num_scheduled_tokens) == len(running) else None
        )
        self._last_step = (scheduler_output, rows)

    def _schedule_waiting(
        self, budget: int, num_scheduled: dict[str, int], cached: CachedRequestData, new_reqs: list[NewRequestData]
    ) -> int:
        if self.admission_min_batch > 1 and self.waiting and self._gate.deferred(len(self.running), len(self.waiting)):
            return budget
        manager = self.kv_cache_manager
        threshold = self.long_prefill_token_threshold
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted with a token in flight: a resume carries the full token list
            if request.num_computed_tokens == 0:
                hit_blocks, num_hit = manager.get_computed_blocks(request)
            else:
                hit_blocks, num_hit = None, 0
            c = request.num_computed_tokens + num_hit
            n = request.num_tokens - c
            if n <= 0:
                raise RuntimeError(
                    f"KV-cache manager reported {num_hit} cached tokens for request {request.request_id!r} "
                    f"with {request.num_tokens} tokens; at least the last token must be computed"
                )
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                n = budget
            if manager.allocate_slots(request, n, num_hit, hit_blocks) is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.running.append(request)
            rid = request.request_id
            block_ids = tuple(list(g) for g in manager.get_block_ids(rid))
            if request.status == _PREEMPTED:
                cached.add(rid, block_ids, c, resumed_token_ids=list(request.all_token_ids))
            else:
                new_reqs.append(
                    NewRequestData(
                        rid,
                        list(request.prompt_token_ids),
                        request.sampling_params,
                        block_ids,
                        c,
                        list(request.output_token_ids) if request.output_token_ids else None,
                    )
                )
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = _RUNNING
            request.num_computed_tokens = c + n
            num_scheduled[rid] = n
            budget -= n
        return budget

    # ------------------------------------------------------------------ update

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput | None
    ) -> list[EngineCoreOutput]:
        if model_runner_output is None and scheduler_output.total_num_scheduled_tokens:
            # Requests whose prefill completed would wait forever for a token that never comes.
            raise ValueError(
                f"update_from_output: step {scheduler_output.step_id} scheduled "
                f"{scheduler_output.total_num_scheduled_tokens} tokens but model_runner_output "
                f"is None; only an empty step may have no runner output"
            )
        rows, keys = self._step_rows(scheduler_output)
        outputs = self._pending_outputs
        self._pending_outputs = []
        self._pending_ids.clear()
        if model_runner_output is not None and scheduler_output.total_num_scheduled_tokens:
            # The runner answers in its batch's row order; while that is the step's own order (no
            # request joined or left its batch out of turn), the rows' requests are taken by position.
            if rows is None or keys is None or model_runner_output.req_ids != list(keys):
                rows = self._rows_by_id(scheduler_output, model_runner_output, rows, keys)
            self._apply_sampled(model_runner_output, outputs, rows)
            if model_runner_output.logprobs or model_runner_output.prompt_logprobs:
                attach_logprobs(outputs, model_runner_output)
        if self.debug_invariants:
            self._check_invariants()
        return outputs

    def _step_rows(self, scheduler_output: SchedulerOutput) -> tuple[list[Request | None] | None, Any]:
        """Hook: (the request of each row of the step, in num_scheduled_tokens order, or None where
        the row may take no token; the num_scheduled_tokens those rows follow), or (None, ...) when
        the step did not keep them: the rows are then found by id."""
        step, rows = self._last_step
        return (rows, scheduler_output.num_scheduled_tokens) if step is scheduler_output else (None, None)

    def _rows_by_id(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput, rows: Any, keys: Any
    ) -> list[Request | None]:
        """Hook: the request that may take the tokens of each runner row, looked up by id: a live request
        the step scheduled (its prefill being complete is checked when its token arrives)."""
        rules = self._stop_rules
        scheduled = scheduler_output.num_scheduled_tokens
        out: list[Request | None] = []
        for rid in model_runner_output.req_ids:
            rule = rules.get(rid)
            out.append(rule[0] if rule is not None and rid in scheduled else None)
        return out

    # The synchronous step samples exactly the scheduled requests whose prompt is then computed.
    _checks_computed = True

    def _apply_sampled(
        self, model_runner_output: ModelRunnerOutput, outputs: list[EngineCoreOutput], rows: list[Request | None]
    ) -> None:
        check_computed = self._checks_computed
        emit = outputs.append
        new_output = EngineCoreOutput
        new_bare = object.__new__
        stopped: set[str] = set()
        from_waiting = False  # a request preempted while its token was in flight stops from the queue
        for request, token_ids in zip(rows, model_runner_output.sampled_token_ids, strict=True):
            if request is None or not token_ids:
                continue  # not expected to sample (or a partial prefill chunk, which samples nothing)
            rule = request.stop_rule
            if rule is None:
                continue  # finished (a late stop, an abort) since the step was scheduled
            all_ids = request.all_token_ids
            num_tokens = len(all_ids)
            if check_computed and request.num_computed_tokens < num_tokens:
                continue  # still prefilling: a token here would be a runner bug
            rid = request.request_id
            token_limit, stops = rule[1], rule[4]
            if len(token_ids) == 1:  # the common case, inlined
                tok = token_ids[0]
                request.output_token_ids.append(tok)
                all_ids.append(tok)
                if num_tokens + 1 < token_limit and (tok not in stops or num_tokens + 1 < rule[5]):
                    # = EngineCoreOutput(rid, token_ids, False, None, None, None, num_cached_tokens),
                    # filled in place: half the cost of the dataclass __init__ (see messages.ENGINE_CORE_OUTPUT_FIELDS).
                    o = new_bare(EngineCoreOutput)
                    o.request_id, o.new_token_ids, o.finished, o.finish_reason = rid, token_ids, False, None
                    o.stop_reason = o.error = o.step_logprobs = o.prompt_logprobs = o.timing = None
                    o.num_cached_tokens = request.num_cached_tokens
                    emit(o)
                    continue
            else:
                token_ids = append_until_stop(rule, token_ids)
                tok = token_ids[-1]
                if not stops_on(rule, tok, len(all_ids)):
                    emit(new_output(rid, token_ids, False, None, None, None, request.num_cached_tokens))
                    continue
            from_waiting |= request.status != _RUNNING
            self._release(request)
            set_finished_status(rule, tok)
            self._retire(request)
            stopped.add(rid)
            emit(
                new_output(
                    rid,
                    token_ids,
                    True,
                    request.get_finished_reason(),
                    request.stop_reason,
                    None,
                    request.num_cached_tokens,
                )
            )
        if stopped:
            self._drop_from_queues(stopped, from_waiting)

    def _check_invariants(self) -> None:
        # Only running requests may hold blocks; a row of any other request is a leak.
        self.kv_cache_manager.check_invariants(self.running)
