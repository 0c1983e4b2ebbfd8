"""Continuous-batching scheduler (vLLM V1 semantics).

Every step it walks the running requests first, in order, then the waiting ones, under a token
budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`). Prefill is chunked to the
budget (and to `long_prefill_token_threshold`). When the KV-cache pool runs dry for a running
request, the last running request is preempted by recompute and goes back to the head of the
waiting queue. The output of a step is a `SchedulerOutput` holding only block-id deltas for
requests the workers already know. The scheduler never touches a tensor.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, Iterable

from kvcore.messages import (BlockIds, CachedRequestData, EngineCoreOutput, ModelRunnerOutput,
                             NewRequestData, SchedulerOutput)
from kvcore.request import Request, RequestStatus

# Per live request, what update_from_output needs to check stops in one lookup:
# (request, token count that ends it (prompt + max_tokens, capped by max_model_len),
#  the EOS id unless ignore_eos (else None), stop_token_ids as a frozenset (None when empty),
#  every token that stops it (EOS and stop ids; maybe empty): one set test per sampled token).
_StopRule = tuple[Request, int, "int | None", "frozenset[int] | None", "frozenset[int]"]

# _apply_sampled builds the EngineCoreOutput of an unfinished request by filling a bare instance (one
# per running request per step, so the __init__ call is worth skipping); it sets exactly these fields.
_UNFINISHED_FIELDS = ("request_id", "new_token_ids", "finished", "finish_reason", "stop_reason", "error",
                      "num_cached_tokens")
if tuple(f.name for f in dataclasses.fields(EngineCoreOutput)) != _UNFINISHED_FIELDS:
    raise RuntimeError(f"kvcore.scheduler: EngineCoreOutput fields changed; update _apply_sampled, which "
                       f"fills {_UNFINISHED_FIELDS} by hand")

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_positive_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"Scheduler.{name}={value!r}: must be an integer >= {minimum}")


class Scheduler:
    """Decides, each step, which requests run how many tokens, and with which KV-cache blocks."""

    def __init__(self, kv_cache_manager: Any, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, long_prefill_token_threshold: int = 0,
                 admission_min_batch: int = 1, admission_max_wait_steps: int = 16,
                 debug_invariants: bool = False) -> None:
        _check_positive_int("max_num_seqs", max_num_seqs, 1)
        _check_positive_int("admission_min_batch", admission_min_batch, 1)
        _check_positive_int("admission_max_wait_steps", admission_max_wait_steps, 0)
        _check_positive_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        _check_positive_int("max_model_len", max_model_len, 1)
        _check_positive_int("long_prefill_token_threshold", long_prefill_token_threshold, 0)
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.admission_min_batch = admission_min_batch
        self.admission_max_wait_steps = admission_max_wait_steps
        self._admission_deferrals = 0  # consecutive steps that kept waiting requests out
        self.debug_invariants = debug_invariants

        self.requests: dict[str, Request] = {}  # live: waiting or running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished/aborted since the previous schedule(): the workers drop their state.
        self._finished_req_ids: set[str] = set()
        # Outputs of requests finished outside update_from_output (rejected, aborted).
        self._pending_outputs: list[EngineCoreOutput] = []
        self._pending_ids: set[str] = set()
        self._stop_rules: dict[str, _StopRule] = {}
        self._step_id = 0
        self._num_preemptions = 0

        self._init_geometry()

    # ------------------------------------------------------------------ pool geometry

    def _init_geometry(self) -> None:
        cfg = self.kv_cache_manager.kv_cache_config
        specs = [g.kv_cache_spec for g in cfg.kv_cache_groups]
        self._block_sizes = [s.block_size for s in specs]
        self._windows = [getattr(s, "sliding_window", None) for s in specs]
        self._num_pool_blocks = self.kv_cache_manager.block_pool.num_blocks
        # Fast path of _schedule_running: allocate_slots is a no-op when the new tokens land in the
        # request's last block (already allocated: it holds position c - 1) without filling it (no
        # block to register in the prefix cache). That holds for full-attention groups of one block
        # size; a sliding window also frees blocks as decode advances, so it always asks the manager.
        uniform = len(set(self._block_sizes)) == 1 and all(w is None for w in self._windows)
        # 1 disables the fast path without a branch in the loop: c % 1 is never non-zero.
        self._fast_block_size = self._block_sizes[0] if uniform else 1

    def _max_blocks_needed(self, num_tokens: int) -> int:
        """Blocks one request can hold at once with `num_tokens` tokens, over all groups (one pool)."""
        max_chunk = self.max_num_batched_tokens
        if self.long_prefill_token_threshold:
            max_chunk = min(max_chunk, self.long_prefill_token_threshold)
        total = 0
        for bs, window in zip(self._block_sizes, self._windows):
            need = _cdiv(num_tokens, bs)
            if window is not None:
                # Live blocks cover the window behind the computed tokens plus one chunk.
                need = min(need, _cdiv(window - 1 + max_chunk, bs) + 1)
            total += need
        return total

    def _reject_reason(self, request: Request) -> str | None:
        rid = request.request_id
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            return f"request {rid!r}: prompt_token_ids is empty; a request needs at least one prompt token"
        total = num_prompt + request.max_tokens
        if total > self.max_model_len:
            return (f"request {rid!r}: prompt ({num_prompt} tokens) + max_tokens ({request.max_tokens}) = "
                    f"{total} tokens exceeds max_model_len={self.max_model_len}")
        need = self._max_blocks_needed(total)
        usable = self._num_pool_blocks - 1
        if need > usable:
            return (f"request {rid!r}: prompt + max_tokens = {total} tokens needs {need} KV-cache blocks "
                    f"(block sizes {self._block_sizes}) but the pool holds only {usable} usable blocks "
                    f"(num_blocks={self._num_pool_blocks}, block 0 is the null block)")
        return None

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests or rid in self._pending_ids:
            raise ValueError(f"add_request: request_id {rid!r} is already in use by an unfinished request")
        reason = self._reject_reason(request)
        if reason is not None:
            # Finished at once, never queued: it could never be scheduled.
            request.status = RequestStatus.FINISHED_ERROR
            request.error = reason
            self._emit_finished(request)
            return
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        params = request.sampling_params
        eos = None if params.ignore_eos else request.eos_token_id
        stop_ids = frozenset(params.stop_token_ids) if params.stop_token_ids else None
        self._stop_rules[rid] = (
            request, min(request.num_prompt_tokens + params.max_tokens, self.max_model_len), eos, stop_ids,
            frozenset(params.stop_token_ids if eos is None else [*params.stop_token_ids, eos]))
        self.waiting.append(request)

    def abort(self, req_ids: Iterable[str]) -> None:
        """Abort waiting or running requests; unknown or already finished ids are ignored."""
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        aborted: set[str] = set()
        for rid in req_ids:
            request = self.requests.get(rid)
            if request is None or rid in aborted:
                continue
            aborted.add(rid)
            if request.status == _RUNNING:
                self.kv_cache_manager.free(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._retire(request)
            self._emit_finished(request)
        if aborted:
            self.running = [r for r in self.running if r.request_id not in aborted]
            self.waiting = deque(r for r in self.waiting if r.request_id not in aborted)

    def _retire(self, request: Request) -> None:
        del self.requests[request.request_id]
        del self._stop_rules[request.request_id]
        self._finished_req_ids.add(request.request_id)

    def _emit_finished(self, request: Request) -> None:
        self._pending_ids.add(request.request_id)
        self._pending_outputs.append(EngineCoreOutput(
            request.request_id, [], True, request.get_finished_reason(), request.stop_reason,
            request.error, max(request.num_cached_tokens, 0)))

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
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            # Both loops take exactly what they schedule out of the budget: no need to sum the dict.
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=self._finished_req_ids, preempted_req_ids=preempted,
            step_id=self._step_id)
        self._finished_req_ids = set()
        if self.debug_invariants:
            self._check_invariants()
        return out

    def _schedule_running(self, budget: int, num_scheduled: dict[str, int], cached: CachedRequestData,
                          preempted: set[str]) -> int:
        # The hot loop of a decode-heavy step: kept flat on purpose (locals, no per-request calls
        # unless blocks may change).
        running = self.running
        threshold = self.long_prefill_token_threshold
        last_pos = self.max_model_len - 1  # the final token's KV is never needed
        fast_bs = self._fast_block_size
        add_computed = cached.num_computed_tokens.append
        allocate = self.kv_cache_manager.allocate_slots
        # Most steps give few requests new blocks: record (row, ids) for those, fill the rest with None.
        deltas: list[tuple[int, BlockIds]] = []
        # Iterating while preemption pops from the tail is safe: the iterator never reaches a victim.
        for request in running:
            if budget <= 0:
                break
            c = request.num_computed_tokens
            n = len(request.all_token_ids) - c
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
            if not r or r + n >= fast_bs:
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
        self._fill_running_rows(num_scheduled, cached, deltas)
        return budget

    @staticmethod
    def _fill_running_rows(num_scheduled: dict[str, int], cached: CachedRequestData,
                           deltas: list[tuple[int, BlockIds]]) -> None:
        """The per-row lists of the running requests just scheduled (num_computed_tokens is already
        filled): only they are in num_scheduled so far, in scheduling order."""
        cached.req_ids.extend(num_scheduled)
        k = len(num_scheduled)
        new_block_ids = cached.new_block_ids
        new_block_ids.extend([None] * k)
        for row, ids in deltas:
            new_block_ids[row] = ids
        cached.resumed_from_preemption.extend([False] * k)
        cached.resumed_token_ids.extend([None] * k)

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

    def _admission_deferred(self) -> bool:
        """Whether this step keeps the waiting requests out to admit them later, together.

        A step that starts new prompts mixes their prefill into the running decodes, and such a step
        cannot replay a decode CUDA graph: it launches every kernel from the host. When requests finish
        one or two at a time, admitting each at once makes nearly every step mixed. With
        admission_min_batch > 1 they are admitted once that many rows are free (or every waiting
        request fits, or nothing runs, or they have waited admission_max_wait_steps steps), so most
        steps stay pure decode (TGI batches its prefills for the same reason)."""
        free = self.max_num_seqs - len(self.running)
        if free <= 0:
            return True  # no row to admit into: not a deferral
        if (not self.running or free >= min(self.admission_min_batch, len(self.waiting))
                or self._admission_deferrals >= self.admission_max_wait_steps):
            self._admission_deferrals = 0
            return False
        self._admission_deferrals += 1
        return True

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int], cached: CachedRequestData,
                          new_reqs: list[NewRequestData]) -> int:
        if self.admission_min_batch > 1 and self.waiting and self._admission_deferred():
            return budget
        manager = self.kv_cache_manager
        threshold = self.long_prefill_token_threshold
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_computed_tokens == 0:
                hit_blocks, num_hit = manager.get_computed_blocks(request)
            else:
                hit_blocks, num_hit = None, 0
            c = request.num_computed_tokens + num_hit
            n = request.num_tokens - c
            if n <= 0:
                raise RuntimeError(
                    f"KV-cache manager reported {num_hit} cached tokens for request {request.request_id!r} "
                    f"with {request.num_tokens} tokens; at least the last token must be computed")
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
                new_reqs.append(NewRequestData(rid, list(request.prompt_token_ids), request.sampling_params,
                                               block_ids, c))
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = _RUNNING
            request.num_computed_tokens = c + n
            num_scheduled[rid] = n
            budget -= n
        return budget

    # ------------------------------------------------------------------ update

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput | None) -> list[EngineCoreOutput]:
        if model_runner_output is None and scheduler_output.total_num_scheduled_tokens:
            # Requests whose prefill completed would wait forever for a token that never comes.
            raise ValueError(f"update_from_output: step {scheduler_output.step_id} scheduled "
                             f"{scheduler_output.total_num_scheduled_tokens} tokens but model_runner_output "
                             f"is None; only an empty step may have no runner output")
        outputs = self._pending_outputs
        self._pending_outputs = []
        self._pending_ids.clear()
        if model_runner_output is not None and scheduler_output.total_num_scheduled_tokens:
            stopped = self._apply_sampled(scheduler_output, model_runner_output, outputs)
            if stopped:
                self.running = [r for r in self.running if r.request_id not in stopped]
        if self.debug_invariants:
            self._check_invariants()
        return outputs

    def _apply_sampled(self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput,
                       outputs: list[EngineCoreOutput]) -> set[str]:
        rules = self._stop_rules
        scheduled = scheduler_output.num_scheduled_tokens
        emit = outputs.append
        new_output = EngineCoreOutput
        new_bare = object.__new__
        stopped: set[str] = set()
        for rid, token_ids in zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids):
            if not token_ids:
                continue  # a partial prefill chunk samples nothing
            rule = rules.get(rid)
            # Aborted mid-step, or not part of this step: nothing to append.
            if rule is None or rid not in scheduled:
                continue
            request, token_limit, eos, stop_ids, stops = rule
            all_ids = request.all_token_ids
            num_tokens = len(all_ids)
            if request.num_computed_tokens < num_tokens:
                continue  # still prefilling: a token here would be a runner bug, not output
            if len(token_ids) == 1:  # the common case, inlined
                tok = token_ids[0]
                request.output_token_ids.append(tok)
                all_ids.append(tok)
                if num_tokens + 1 < token_limit and tok not in stops:
                    # = EngineCoreOutput(rid, token_ids, False, None, None, None, num_cached_tokens),
                    # filled in place: half the cost of the dataclass __init__ call (see _UNFINISHED_FIELDS).
                    o = new_bare(EngineCoreOutput)
                    o.request_id, o.new_token_ids, o.finished, o.finish_reason = rid, token_ids, False, None
                    o.stop_reason = o.error = None
                    o.num_cached_tokens = request.num_cached_tokens
                    emit(o)
                    continue
            else:
                token_ids = self._append_until_stop(rule, token_ids)
                tok = token_ids[-1]
                if len(all_ids) < token_limit and tok not in stops:
                    emit(new_output(rid, token_ids, False, None, None, None, request.num_cached_tokens))
                    continue
            _set_finished_status(request, tok, eos, stop_ids)
            self.kv_cache_manager.free(request)
            self._retire(request)
            stopped.add(rid)
            emit(EngineCoreOutput(rid, token_ids, True, request.get_finished_reason(), request.stop_reason,
                                  None, request.num_cached_tokens))
        return stopped

    @staticmethod
    def _append_until_stop(rule: _StopRule, token_ids: list[int]) -> list[int]:
        """Append tokens one at a time; those after the first stop are dropped. Returns the kept ones."""
        request, token_limit, _, _, stops = rule
        for k, tok in enumerate(token_ids):
            request.append_output_token_ids(tok)
            if request.num_tokens >= token_limit or tok in stops:
                return token_ids[:k + 1]
        return token_ids

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
        queries, hits = _prefix_counts(self.kv_cache_manager.prefix_cache_stats)
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_cache_usage": self.kv_cache_manager.usage,
            "num_preemptions": self._num_preemptions,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        }

    def _check_invariants(self) -> None:
        # Only running requests may hold blocks; a row of any other request is a leak.
        self.kv_cache_manager.check_invariants(self.running)


def _set_finished_status(request: Request, tok: int, eos: int | None,
                         stop_ids: frozenset[int] | None) -> None:
    """Which stop fired on `tok`, the last token kept: a stop the model chose (EOS, stop token)
    beats a length cap, so a stop token that also reaches the limit reports "stop"."""
    if tok == eos:
        request.status = _STOPPED
    elif stop_ids is not None and tok in stop_ids:
        request.status = _STOPPED
        request.stop_reason = tok
    else:
        request.status = _LENGTH


def _prefix_counts(stats: Any) -> tuple[int, int]:
    """(queried tokens, hit tokens) from the manager's prefix-cache stats (object or dict)."""
    if isinstance(stats, dict):
        return int(stats.get("queries", 0)), int(stats.get("hits", 0))
    return int(getattr(stats, "queries", 0)), int(getattr(stats, "hits", 0))
