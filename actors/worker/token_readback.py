"""Reading a step's sampled tokens back to the host without stalling the GPU.

Each step's sampled token ids are copied into a pinned host buffer with a non-blocking copy and an
event; `SampledStep.tokens()` waits on that event only. With async scheduling the runner launches step
N+1 before it reads step N's tokens back, so two readbacks can be alive at once: the buffers alternate.
Step N+1 still needs step N's tokens as inputs; `feed_index` tells which rows take them straight from
the device (the runner keeps the sampler's output in a fixed buffer; the host copy may not be there
yet). Sync or async, a decoding row's input token never travels through the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat

import numpy as np
import torch

from actors.input_batch import CachedRequestState
from actors.sample.logprobs import StepLogprobs


@dataclass
class SampledStep:
    """A step whose sampled tokens are on their way to the host."""

    step_id: int
    req_ids: list[str]  # the step's rows, in its order
    states: list[CachedRequestState]  # the same requests' states (a reused id is a new state)
    sample_rows: np.ndarray  # rows that sampled, ascending
    device_tokens: torch.Tensor | None  # [len(sample_rows)] int64, the sampler's output
    host_tokens: torch.Tensor | None  # its pinned host copy, valid once `done` has passed
    done: torch.cuda.Event | None
    # req_id -> index into device_tokens, and the position each sampled token takes.
    index_of: dict[str, int] = field(default_factory=dict)
    logprobs: StepLogprobs | None = None  # set by the runner when the step computed any
    sample_positions: np.ndarray | None = None
    graph: bool = False  # the step replayed a CUDA graph

    def tokens(self) -> list[int]:
        if self.host_tokens is None:
            return []
        if self.done is not None:
            self.done.synchronize()
        return self.host_tokens.tolist()

    def feed_index(self, req_ids: list[str], computed: np.ndarray) -> np.ndarray:
        """For each of the next step's rows: the index of its first input token in device_tokens, or
        -1. Only where the row continues right after that token (`computed` equals the token's
        position): a request preempted and recomputed from its start, or a reused id, is not fed."""
        get = self.index_of.get
        idx = np.fromiter(map(get, req_ids, repeat(-1)), dtype=np.int64, count=len(req_ids))
        if self.sample_positions is not None and len(idx):
            hit = idx >= 0
            ok = np.zeros(len(idx), dtype=bool)
            ok[hit] = self.sample_positions[idx[hit]] == computed[hit]
            idx[~ok] = -1
        return idx


class TokenReadback:
    def __init__(self, max_num_reqs: int, device: torch.device, pin_memory: bool) -> None:
        self.device = device
        self._bufs = [torch.empty(max_num_reqs, dtype=torch.int64, pin_memory=pin_memory) for _ in range(2)]
        self._next = 0

    def start(
        self,
        step_id: int,
        req_ids: list[str],
        states: list[CachedRequestState],
        sample_rows: np.ndarray,
        tokens: torch.Tensor | None,
        sample_positions: np.ndarray | None = None,
        graph: bool = False,
    ) -> SampledStep:
        if tokens is None:
            return SampledStep(step_id, req_ids, states, sample_rows, None, None, None, graph=graph)
        host = self._bufs[self._next][: tokens.shape[0]]
        self._next ^= 1
        done = None
        if self.device.type == "cuda":
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host.copy_(tokens)
        step = SampledStep(
            step_id, req_ids, states, sample_rows, tokens, host, done, sample_positions=sample_positions, graph=graph
        )
        step.index_of = dict(zip(map(req_ids.__getitem__, sample_rows.tolist()), range(len(sample_rows)), strict=True))
        return step
