"""Batched sampling in one launch per step: greedy, logit_bias, allowed_token_ids, bad_words, penalties,
min_tokens, temperature, min-p, top-k, top-p.

Every tensor-parallel rank holds the same full-vocabulary logits and the same per-row parameters, so
every rank draws the same tokens and no token ever travels between ranks. Randomness is counter-based
(Philox keyed by the request's seed, counted by output position and vocabulary index; see
actors/sample/kernel.py): there is no generator state at all, so a request's tokens depend only on its
seed and its logits, never on the batch it ran in, nor on a restart of the worker.

Seeds: a request's `seed`, else one derived from (engine seed, request id) by a stable hash, so an
unseeded request also replays the same tokens after a restart of the same engine, and every rank
derives the same one.

Greedy rows (temperature 0) take the argmax of their (penalised) logits; a batch that is all greedy
with nothing to apply is a plain argmax (greedy_argmax's split rows where the kernels run). The step's
logprobs come from the raw logits (actors/sample/logprobs.py).
Nothing here reads a device value on the host: the sampler can be captured in a CUDA graph once its
inputs live in static buffers (the kernel variant depends only on the host flags below).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch

from actors.sample.kernel import greedy_argmax, launch_sample
from actors.sample.logit_rows import LogitRows
from actors.sample.logprobs import LogprobsTensors, compute_logprobs, kernel_runs
from actors.sample.penalties import PenaltyState
from actors.sample.reference import sample_reference

# KVRAY_GREEDY_KERNEL=0 takes a plain greedy batch's argmax with torch.argmax (the A/B switch behind greedy_argmax).
GREEDY_KERNEL = os.environ.get("KVRAY_GREEDY_KERNEL", "1") != "0"


@dataclass
class SamplingMetadata:
    """Per-row parameters of the rows to sample (device tensors) and host-side flags."""

    temperature: torch.Tensor | None  # float32 [N]; 0 = greedy. None only when all_greedy
    top_k: torch.Tensor | None  # int32 [N]; 0 = disabled
    top_p: torch.Tensor | None  # float32 [N]; 1 = disabled
    seeds: torch.Tensor | None  # int64 [N]; see request_seed
    positions: torch.Tensor | None  # int64 [N]; output position of the token being sampled
    all_greedy: bool  # no random row (then the five tensors above may be None)
    need_filter: bool  # some random row has top-k or top-p
    penalty_slots: torch.Tensor | None = None  # int64 [N] into PenaltyState; -1 = none. None: no row
    penalties: torch.Tensor | None = None  # float32 [3, N]: presence, frequency, repetition
    ban_ids: torch.Tensor | None = None  # int32 [N, B]: ids masked to -inf (min_tokens, bad words); -1 pads
    # int32 [N, B] beside ban_ids: ban only when the row's last token is this id (a bad word's other
    # tokens end the output); -1 = always. None: every ban is unconditional.
    ban_prev: torch.Tensor | None = None
    # (input ids, logits indices) of the step: input_ids[logits_indices[j]] is row j's last token. Read
    # at sampling time, after the step's inputs are built on the device (the host may not know it yet).
    last_token_source: tuple[torch.Tensor, torch.Tensor] | None = None
    logit_slots: torch.Tensor | None = None  # int64 [N] into LogitRows; -1 = none. None: no row
    min_p: torch.Tensor | None = None  # float32 [N]; 0 = off. None: no row
    num_logprobs: int = -1  # the largest k any row asked for; -1 = no row

    @property
    def plain_argmax(self) -> bool:
        return self.all_greedy and self.penalty_slots is None and self.ban_ids is None and self.logit_slots is None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [N]
    logprobs: LogprobsTensors | None  # with num_logprobs columns of top-k, when any row asked


def request_seed(seed: int | None, engine_seed: int, req_id: str) -> int:
    """The Philox key of a request as a signed int64: its seed, else blake2b(engine seed, request id)."""
    if seed is None:
        digest = hashlib.blake2b(f"{engine_seed}:{req_id}".encode(), digest_size=8).digest()
        seed = int.from_bytes(digest, "little")
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


class Sampler:
    def __init__(
        self,
        penalty_state: PenaltyState | None = None,
        use_triton: bool | None = None,
        logit_rows: LogitRows | None = None,
    ) -> None:
        """use_triton None: the kernels on CUDA, the torch references on the CPU (actors/sample/logprobs.py's
        kernel_runs: the rule of the sampled and the prompt logprobs too)."""
        self.penalty_state = penalty_state
        self.use_triton = use_triton
        self.logit_rows = logit_rows

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """logits [N, V] (model dtype; read as float32) -> sampled token ids int64 [N] (+ logprobs when asked)."""
        if md.plain_argmax:
            if GREEDY_KERNEL and kernel_runs(logits.device, self.use_triton):
                tokens = greedy_argmax(logits, self._rows_per_program(logits.device))
            else:
                tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, md)
        if md.penalty_slots is not None and self.penalty_state is not None:
            self.penalty_state.record(md.penalty_slots, tokens)
        lp = None
        if md.num_logprobs >= 0:
            lp = compute_logprobs(logits, tokens, md.num_logprobs, self.use_triton)
        return SamplerOutput(tokens, lp)

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        n = logits.shape[0]
        dev = logits.device
        temperature = md.temperature if md.temperature is not None else torch.zeros(n, device=dev)
        top_k = md.top_k if md.top_k is not None else torch.zeros(n, dtype=torch.int32, device=dev)
        top_p = md.top_p if md.top_p is not None else torch.ones(n, device=dev)
        seeds = md.seeds if md.seeds is not None else torch.zeros(n, dtype=torch.int64, device=dev)
        positions = md.positions if md.positions is not None else torch.zeros(n, dtype=torch.int64, device=dev)
        slots, penalties, counts, prompt_mask = self._penalty_inputs(md)
        need_filter = md.need_filter and not md.all_greedy
        last_tokens, rows_t, min_p = self._last_tokens(md, n), self._logit_rows(md), md.min_p if need_filter else None
        if kernel_runs(dev, self.use_triton):
            rows = self._rows_per_program(dev)
            return launch_sample(
                logits,
                temperature,
                top_k,
                top_p,
                seeds,
                positions,
                need_filter=need_filter,
                rows_per_program=rows,
                ban_ids=md.ban_ids,
                ban_prev=md.ban_prev,
                last_tokens=last_tokens,
                logit_rows=rows_t,
                logit_slots=md.logit_slots,
                min_p=min_p,
                penalty_slots=slots,
                penalties=penalties,
                counts=counts,
                prompt_mask=prompt_mask,
            )
        return sample_reference(
            logits,
            temperature,
            top_k,
            top_p,
            seeds,
            positions,
            ban_ids=md.ban_ids,
            ban_prev=md.ban_prev,
            last_tokens=last_tokens,
            logit_rows=rows_t,
            logit_slots=md.logit_slots,
            min_p=min_p,
            penalty_slots=slots,
            penalties=penalties,
            counts=counts,
            prompt_mask=prompt_mask,
        )

    @staticmethod
    def _rows_per_program(device: torch.device) -> int:
        """The interpreter vectorises one program's rows; a GPU program owns one row."""
        return 1 if device.type == "cuda" else 16

    @staticmethod
    def _last_tokens(md: SamplingMetadata, n: int) -> torch.Tensor | None:
        if md.ban_prev is None:
            return None
        if md.last_token_source is None:
            raise RuntimeError("Sampler: ban_prev given without last_token_source")
        input_ids, logits_indices = md.last_token_source
        return input_ids[logits_indices[:n]]

    def _logit_rows(self, md: SamplingMetadata) -> torch.Tensor | None:
        if md.logit_slots is None:
            return None
        if self.logit_rows is None:
            raise RuntimeError("Sampler: logit_slots given but the sampler has no LogitRows")
        return self.logit_rows.rows

    def _penalty_inputs(self, md: SamplingMetadata) -> tuple[torch.Tensor | None, ...]:
        """(penalty_slots, penalties, counts, prompt_mask), all None when no row has penalties."""
        if md.penalty_slots is None:
            return None, None, None, None
        if self.penalty_state is None:
            raise RuntimeError("Sampler: penalty_slots given but the sampler has no PenaltyState")
        return md.penalty_slots, md.penalties, self.penalty_state.counts, self.penalty_state.prompt_mask
