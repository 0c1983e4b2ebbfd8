"""The runner's logprobs bookkeeping: which prompt positions a step scores, and the per-request
messages once the step's results are on the host.

Prompt logprobs: the logits at position q score prompt token q + 1, so a prefill chunk covering
positions [s, e) of a prompt of length P yields the rows for tokens s + 1 .. min(e, P - 1). They are
computed in the step itself, from the chunk's hidden states (in slices, so the vocabulary-wide logits
of a long chunk never exist at once), and the chunks of one request are handed out together with its
first sampled token. A request asking for them is not served from the prefix cache (as in vLLM), so
every position is computed once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from actors.input_batch import InputBatch
from actors.sample.logprobs import LogprobsTensors, StepLogprobs, compute_logprobs, concat
from kvcore.messages import Logprobs, LogprobsBatch

PROMPT_SLICE = 1024  # prompt positions whose logits exist at once


@dataclass
class PromptPlan:
    token_index: np.ndarray  # int64 [M]: rows of the step's hidden states
    targets: np.ndarray  # int64 [M]: the prompt token each row scores
    segments: list[tuple[str, int, int]]  # (req_id, rows, k), in order
    max_k: int


def prompt_plan(
    batch: InputBatch, num_reqs: int, computed: np.ndarray, num_sched: np.ndarray, starts: np.ndarray, done: set[str]
) -> PromptPlan | None:
    rows = np.flatnonzero(batch.num_prompt_logprobs[:num_reqs] >= 0)
    if not len(rows):
        return None
    index, targets, segments = [], [], []
    for row in rows.tolist():
        rid = batch.index_to_req_id[row]
        assert rid is not None  # rows below num_reqs are occupied
        if rid in done:
            continue
        s = int(computed[row])
        last = min(s + int(num_sched[row]), int(batch.num_prompt_tokens[row]) - 1)
        if last <= s:
            continue
        index.append(int(starts[row]) + np.arange(last - s, dtype=np.int64))
        targets.append(batch.token_ids_cpu[row, s + 1 : last + 1].astype(np.int64))
        segments.append((rid, last - s, int(batch.num_prompt_logprobs[row])))
    if not segments:
        return None
    return PromptPlan(np.concatenate(index), np.concatenate(targets), segments, max(k for _, _, k in segments))


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    plan: PromptPlan,
    use_triton: bool | None = None,
) -> LogprobsTensors:
    """The plan's rows in slices of PROMPT_SLICE, through compute_logprobs as the sampled rows go (the
    kernel on CUDA unless use_triton says otherwise; the runner passes its sampler's)."""
    dev = hidden.device
    index = torch.from_numpy(plan.token_index).to(dev)
    targets = torch.from_numpy(plan.targets).to(dev)
    parts = []
    for a in range(0, len(plan.token_index), PROMPT_SLICE):
        logits = compute_logits(hidden[index[a : a + PROMPT_SLICE]])
        parts.append(compute_logprobs(logits, targets[a : a + PROMPT_SLICE], plan.max_k, use_triton))
    if len(parts) == 1:
        return parts[0]
    return LogprobsTensors(
        torch.cat([p.token_ids for p in parts]),
        torch.cat([p.logprobs for p in parts]),
        torch.cat([p.ranks for p in parts]),
    )


def launch_copies(
    sample: LogprobsTensors | None,
    sample_k: np.ndarray | None,
    prompt: LogprobsTensors | None,
    plan: PromptPlan | None,
    cuda: bool,
) -> StepLogprobs | None:
    """Queue the host copies (before the step's readback event, which then covers them)."""
    if sample is None and prompt is None:
        return None
    return StepLogprobs(
        sample.to_host(cuda) if sample is not None else None,
        sample_k,
        prompt.to_host(cuda) if prompt is not None else None,
        plan.segments if plan is not None else None,
    )


class LogprobsCollector:
    """Per-request prompt chunks until the first token, and the messages of each completed step."""

    def __init__(self) -> None:
        self.parts: dict[str, list[Logprobs]] = {}
        self.done: set[str] = set()  # prompt logprobs handed out: never again (e.g. after a preemption)

    def forget(self, req_id: str) -> None:
        self.parts.pop(req_id, None)
        self.done.discard(req_id)

    def restart_prompt(self, req_id: str) -> None:
        """A resumed request recomputes its prompt: chunks of the earlier attempt are dropped."""
        self.parts.pop(req_id, None)

    def collect(
        self, lp: StepLogprobs | None, req_ids: list[str], sample_rows: np.ndarray, live: set[str] | None = None
    ) -> tuple[LogprobsBatch | None, dict[str, Logprobs] | None]:
        """-> (the step's sampled rows as one batch, the prompt logprobs of requests complete this step).

        The batch is the step's arrays with the rows' request ids: nothing here is per request but the
        prompt chunks (a request's prompt is handed out once)."""
        if lp is None:
            return None, None
        if lp.prompt is not None and lp.prompt_segments:
            batch, a = lp.prompt.to_batch(), 0
            for rid, n, k in lp.prompt_segments:
                self.parts.setdefault(rid, []).append(Logprobs.window(batch, a, a + n, 1 + k))
                a += n
        sampled: LogprobsBatch | None = None
        if lp.sample is not None:
            assert lp.sample_k is not None  # launch_copies sets both or neither
            # Every row sampled (a decode step): the rows are the step's, and the list pickles once.
            ids = req_ids if len(sample_rows) == len(req_ids) else list(map(req_ids.__getitem__, sample_rows.tolist()))
            sampled = lp.sample.to_batch(ids, np.asarray(lp.sample_k, dtype=np.int32))
        prompt: dict[str, Logprobs] | None = None
        if self.parts:
            for row in sample_rows.tolist():
                rid = req_ids[row]
                chunks = self.parts.pop(rid, None)
                if chunks is not None:
                    prompt = prompt or {}
                    prompt[rid] = concat(chunks)
                    self.done.add(rid)
        return sampled, prompt
