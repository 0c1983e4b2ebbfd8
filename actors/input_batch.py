"""The persistent batch: one row per request the worker is running this step.

Rows are reused across steps so that the per-row arrays (token ids, sampling parameters, block table)
are updated in place from the scheduler's deltas instead of being rebuilt. Rows move (condense, swap);
the stable identity of a request is its req_id.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, cast

import numpy as np
import torch

from kvcore.block_table import MultiGroupBlockTable
from kvcore.messages import BlockIds, NewRequestData, SchedulerOutput
from kvcore.request import SamplingParams


@dataclass
class CachedRequestState:
    """What the worker remembers about a request, in the batch or not (unscheduled, preempted)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # the Philox key of its draws (actors/sampler.request_seed); unused when greedy
    block_ids: BlockIds
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    penalty_slot: int = -1  # its row in the runner's PenaltyState, -1 without penalties
    min_tokens_ban: list[int] = field(default_factory=list)  # ids masked until min_tokens outputs
    logit_slot: int = -1  # its row in the runner's LogitRows (logit_bias, allowed_token_ids), -1 without

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device,
        pin_memory: bool,
        block_sizes: list[int],
    ) -> None:
        if max_num_reqs < 1 or max_model_len < 1:
            raise ValueError(f"InputBatch: max_num_reqs={max_num_reqs} and max_model_len={max_model_len} must be >= 1")
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device

        self.req_id_to_index: dict[str, int] = {}
        self.index_to_req_id: list[str | None] = [None] * max_num_reqs
        # Rows below `_num_rows` that are empty: a min-heap so the lowest hole is reused first.
        self._holes: list[int] = []
        self._num_rows = 0  # one past the highest occupied row

        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)

        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int32)  # 0 = disabled
        self.greedy = np.ones(max_num_reqs, dtype=bool)
        self.seed = np.zeros(max_num_reqs, dtype=np.int64)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.penalty_slot = np.full(max_num_reqs, -1, dtype=np.int64)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)  # -1: no logprobs
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)
        self.min_tokens_ban: dict[int, list[int]] = {}  # row -> ids banned until min_tokens (sparse)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)  # 0 = off (and for greedy rows)
        self.logit_slot = np.full(max_num_reqs, -1, dtype=np.int64)
        # Rows using min_p or a logit row: while none does, the sampler's inputs skip both.
        self.num_logit_extras = 0
        self.bad_words: dict[int, list[list[int]]] = {}  # row -> bad words of 2+ tokens (sparse)
        self._row_dicts: tuple[dict[int, Any], ...] = (self.min_tokens_ban, self.bad_words)
        # The per-row scalars that move with a request (condense, swap); token ids and the sparse
        # ban lists are moved by hand.
        self._row_scalars = (
            self.num_tokens,
            self.num_prompt_tokens,
            self.num_computed_tokens,
            self.temperature,
            self.top_p,
            self.top_k,
            self.greedy,
            self.seed,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            self.penalty_slot,
            self.min_tokens,
            self.num_logprobs,
            self.num_prompt_logprobs,
            self.min_p,
            self.logit_slot,
        )

        self.block_table = MultiGroupBlockTable(
            max_num_reqs, max_model_len, max_num_batched_tokens, pin_memory, device, block_sizes
        )

    # ---- membership -------------------------------------------------------------------------
    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        """req_ids of rows 0..num_reqs-1; only meaningful when the batch is condensed."""
        # Condensed, rows below num_reqs all hold a request: no None among them.
        return cast(list[str], self.index_to_req_id[: self.num_reqs])

    def _take_row(self) -> int:
        if self._holes:
            return heapq.heappop(self._holes)
        if self._num_rows >= self.max_num_reqs:
            raise RuntimeError(f"InputBatch is full: max_num_reqs={self.max_num_reqs} rows in use")
        self._num_rows += 1
        return self._num_rows - 1

    def add_request(self, state: CachedRequestState) -> int:
        """Put a request into the lowest free row; its token ids and block ids come from `state`."""
        if state.req_id in self.req_id_to_index:
            raise ValueError(f"InputBatch.add_request: request {state.req_id!r} is already in the batch")
        n = state.num_tokens
        if n > self.max_model_len:
            raise ValueError(f"request {state.req_id!r}: {n} tokens exceed max_model_len={self.max_model_len}")
        row = self._take_row()
        self.req_id_to_index[state.req_id] = row
        self.index_to_req_id[row] = state.req_id

        num_prompt = len(state.prompt_token_ids)
        self.token_ids_cpu[row, :num_prompt] = state.prompt_token_ids
        self.token_ids_cpu[row, num_prompt:n] = state.output_token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = num_prompt
        self.num_computed_tokens[row] = state.num_computed_tokens

        sp = state.sampling_params
        self.greedy[row] = sp.greedy
        self.temperature[row] = sp.temperature
        self.top_p[row] = sp.top_p
        self.top_k[row] = sp.top_k if sp.top_k > 0 else 0
        self.seed[row] = state.seed
        self.presence_penalty[row] = sp.presence_penalty
        self.frequency_penalty[row] = sp.frequency_penalty
        self.repetition_penalty[row] = sp.repetition_penalty
        self.penalty_slot[row] = state.penalty_slot
        self.min_tokens[row] = sp.min_tokens if state.min_tokens_ban else 0
        self.num_logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        self.num_prompt_logprobs[row] = -1 if sp.prompt_logprobs is None else sp.prompt_logprobs
        if state.min_tokens_ban and sp.min_tokens:
            self.min_tokens_ban[row] = state.min_tokens_ban
        else:
            self.min_tokens_ban.pop(row, None)
        self.min_p[row] = 0.0 if sp.greedy else sp.min_p
        self.logit_slot[row] = state.logit_slot
        self.num_logit_extras += int(self.min_p[row] > 0 or state.logit_slot >= 0)
        long_words = [seq for seq in sp.bad_words_token_ids or () if len(seq) > 1]
        if long_words:
            self.bad_words[row] = long_words
        else:
            self.bad_words.pop(row, None)
        self.block_table.add_row(state.block_ids, row)
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Free the request's row (leaving a hole until condense()); None if it was not in the batch."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.index_to_req_id[row] = None
        for d in self._row_dicts:
            d.pop(row, None)
        self.num_logit_extras -= int(self.min_p[row] > 0 or self.logit_slot[row] >= 0)
        self.min_p[row], self.logit_slot[row] = 0.0, -1
        self.block_table.clear_row(row)
        if row == self._num_rows - 1:
            self._num_rows -= 1
            self._drop_trailing_holes()
        else:
            heapq.heappush(self._holes, row)
        return row

    def remove_all(self) -> None:
        for req_id in list(self.req_id_to_index):
            self.remove_request(req_id)
        self.condense()

    def _drop_trailing_holes(self) -> None:
        # Holes at the top of the occupied range are just free space; keep the heap to holes below it.
        while self._num_rows > 0 and self.index_to_req_id[self._num_rows - 1] is None:
            self._num_rows -= 1
        self._holes = [h for h in self._holes if h < self._num_rows]
        heapq.heapify(self._holes)

    # ---- moving rows ------------------------------------------------------------------------
    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.index_to_req_id[src]
        assert req_id is not None and self.index_to_req_id[dst] is None
        n = int(self.num_tokens[src])
        self.token_ids_cpu[dst, :n] = self.token_ids_cpu[src, :n]
        for arr in self._row_scalars:
            arr[dst] = arr[src]
        for d in self._row_dicts:
            entry = d.pop(src, None)
            if entry is not None:
                d[dst] = entry
        self.block_table.move_row(src, dst)
        self.block_table.clear_row(src)  # move_row copies; a stale source row must not linger
        self.index_to_req_id[dst], self.index_to_req_id[src] = req_id, None
        self.req_id_to_index[req_id] = dst

    def condense(self) -> None:
        """Fill every hole with the highest occupied row, so rows 0..num_reqs-1 are the batch."""
        while self._holes:
            hole = heapq.heappop(self._holes)
            if hole >= self._num_rows:
                continue
            last = self._num_rows - 1
            self._move_row(last, hole)
            self._num_rows -= 1
            self._drop_trailing_holes()
        assert self._num_rows == self.num_reqs

    def swap_states(self, i: int, j: int) -> None:
        """Exchange two occupied rows (all arrays, ban lists and block-table row)."""
        ri, rj = self.index_to_req_id[i], self.index_to_req_id[j]
        if ri is None or rj is None:
            raise ValueError(f"InputBatch.swap_states({i}, {j}): both rows must be occupied")
        if i == j:
            return
        n = int(max(self.num_tokens[i], self.num_tokens[j]))
        self.token_ids_cpu[[i, j], :n] = self.token_ids_cpu[[j, i], :n]
        for arr in self._row_scalars:
            arr[[i, j]] = arr[[j, i]]
        for d in self._row_dicts:
            ei, ej = d.pop(i, None), d.pop(j, None)
            if ei is not None:
                d[j] = ei
            if ej is not None:
                d[i] = ej
        self.block_table.swap_row(i, j)
        self.index_to_req_id[i], self.index_to_req_id[j] = rj, ri
        self.req_id_to_index[ri], self.req_id_to_index[rj] = j, i

    # ---- per-step updates -------------------------------------------------------------------
    def append_token(self, row: int, token_id: int) -> None:
        """Record a token the runner sampled for the request in `row`."""
        n = int(self.num_tokens[row])
        if n < self.max_model_len:
            # The scheduler finishes a request at max_model_len, so a token beyond it is never fed back.
            self.token_ids_cpu[row, n] = token_id
            self.num_tokens[row] = n + 1

    def append_tokens(self, rows: np.ndarray, token_ids: list[int] | np.ndarray) -> None:
        """append_token for many rows at once (rows distinct): one numpy pass instead of a Python call
        per sampled row, the runner's per-step hot path."""
        n = self.num_tokens[rows]
        fits = n < self.max_model_len  # as in append_token: a token beyond it is never fed back
        rows, n = rows[fits], n[fits]
        self.token_ids_cpu[rows, n] = np.asarray(token_ids, dtype=np.int32)[fits]
        self.num_tokens[rows] = n + 1

    # ---- applying a step's scheduler output -------------------------------------------------
    def apply_scheduler_output(
        self,
        so: SchedulerOutput,
        requests: dict[str, CachedRequestState],
        new_state: Callable[[NewRequestData], CachedRequestState],
        forget: Callable[[str], None],
        resumed: Callable[[CachedRequestState], None],
    ) -> None:
        """Bring the rows (and the worker's request states) to the step: finished and preempted
        requests go, rows of requests not scheduled go (their state stays cached), new and resumed
        requests get rows, cached ones take their block deltas; then the rows are condensed."""
        for req_id in so.finished_req_ids:
            forget(req_id)  # the request's state and everything kept by request id
            self.remove_request(req_id)
        for req_id in so.preempted_req_ids:
            self.remove_request(req_id)  # its state stays: it comes back resumed
        # The key-view subset test runs in C and is true on most steps, skipping the per-request scan.
        if not self.req_id_to_index.keys() <= so.num_scheduled_tokens.keys():
            for req_id in [r for r in self.req_id_to_index if r not in so.num_scheduled_tokens]:
                self.remove_request(req_id)
        to_add: list[CachedRequestState] = []
        for nr in so.scheduled_new_reqs:
            state = new_state(nr)
            requests[nr.req_id] = state
            to_add.append(state)
        self._update_cached(so, requests, to_add, resumed)
        for state in to_add:
            self.add_request(state)
        self.condense()
        if self.num_reqs != len(so.num_scheduled_tokens):
            raise RuntimeError(
                f"runner batch has {self.num_reqs} requests but the step schedules {len(so.num_scheduled_tokens)}"
            )

    def _update_cached(
        self,
        so: SchedulerOutput,
        requests: dict[str, CachedRequestState],
        to_add: list[CachedRequestState],
        resumed: Callable[[CachedRequestState], None],
    ) -> None:
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = requests.get(req_id)
            if state is None:
                raise RuntimeError(f"step {so.step_id}: cached request {req_id!r} is unknown to this worker")
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_ids = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                tokens = cached.resumed_token_ids[i]
                assert new_ids is not None and tokens is not None, "a resumed request carries blocks and tokens"
                state.block_ids = tuple(list(b) for b in new_ids)
                state.output_token_ids = list(tokens[len(state.prompt_token_ids) :])
                resumed(state)
                self.remove_request(req_id)
                to_add.append(state)
                continue
            if new_ids is not None:
                for blocks, delta in zip(state.block_ids, new_ids, strict=True):
                    blocks.extend(delta)
            row = self.req_id_to_index.get(req_id)
            if row is None:
                to_add.append(state)  # back after an unscheduled step: the full row is rebuilt
                continue
            self.num_computed_tokens[row] = state.num_computed_tokens
            if new_ids is not None:
                self.block_table.append_row(new_ids, row)
