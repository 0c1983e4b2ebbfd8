"""A step's inputs, staged by the host in O(rows) and built on the device (kvcore/kernels/input_prep.py).

Per step the host writes one int32 record into a pinned buffer: per row the tokens scheduled and the
tokens computed, the index of the token the previous step sampled for it (the row's next input, which
is on the device already) or -1, the rows that sample, and the token ids only the host has: prompt
chunks of prefilling rows. A decode row costs three words and no token, whatever its context length.
One non-blocking copy moves the used part of the record to a device buffer that never moves, and two
kernels build query_start_loc, seq_lens, logits_indices, positions and input ids from it, so a CUDA
graph can hold them (see actors/worker/cuda_graphs.py).

Two pinned buffers alternate, each guarded by the event recorded after the copy that read it, so the
host never rewrites a record the copy engine may still be reading (async scheduling stages step N+1
while step N's copy may be queued).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcore.kernels.input_prep import PrepOutputs, StageLayout, prepare_inputs
from kvcore.kernels.slot_mapping import triton_runs_on


@dataclass
class StagedStep:
    """The host's view of a staged step (all O(rows))."""

    num_reqs: int
    num_tokens: int
    num_sched: np.ndarray  # int64 [num_reqs]
    seq_lens: np.ndarray  # int64 [num_reqs]
    sample_rows: np.ndarray  # rows that sample, ascending
    max_query_len: int
    max_seq_len: int
    sampling: Any = None  # the sampler's metadata of the sampling rows (set by the runner)
    prompt_plan: Any = None  # prompt positions whose logprobs the step scores (set by the runner)


class InputStager:
    def __init__(self, max_num_reqs: int, max_num_tokens: int, device: torch.device, pin_memory: bool) -> None:
        self.layout = StageLayout(max_num_reqs, max_num_tokens)
        self.device = device
        self.use_triton = triton_runs_on(device)
        size = self.layout.size
        self._host = [torch.zeros(size, dtype=torch.int32, pin_memory=pin_memory) for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._next = 0
        self.stage = torch.zeros(size, dtype=torch.int32, device=device)
        # The previous step's sampled tokens, where the feed indices point (copied from the sampler's
        # output, so the address is fixed for graphs).
        self.fed = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.out = PrepOutputs(
            query_start_loc=torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(max_num_reqs, dtype=torch.int32, device=device),
            logits_indices=torch.zeros(max_num_reqs, dtype=torch.int64, device=device),
            input_ids=torch.zeros(max_num_tokens, dtype=torch.int64, device=device),
            positions=torch.zeros(max_num_tokens, dtype=torch.int64, device=device),
        )

    def stage_step(
        self,
        num_sched: np.ndarray,
        computed: np.ndarray,
        num_tokens_known: np.ndarray,
        feed: np.ndarray,
        token_ids: np.ndarray,
    ) -> StagedStep:
        """Write the record of a step of rows 0..R-1 and queue its copy to the device.

        num_sched/computed/num_tokens_known: per row (int); feed: index into the previous step's
        sampled tokens for rows whose next input token is on the device, else -1; token_ids: the
        batch's host token table [max_num_reqs, max_model_len] (rows read only where not fed)."""
        lay = self.layout
        r = len(num_sched)
        k = self._next
        self._next ^= 1
        done = self._events[k]
        if done is not None:
            done.synchronize()  # two steps old: normally long done
        buf = self._host_np[k]
        cu = np.cumsum(num_sched)
        total = int(cu[-1]) if r else 0
        seq_lens = computed + num_sched
        sample_rows = np.flatnonzero(seq_lens >= num_tokens_known)
        buf[0], buf[1] = r, len(sample_rows)
        buf[lay.sched : lay.sched + r] = num_sched
        buf[lay.computed : lay.computed + r] = computed
        buf[lay.feed : lay.feed + r] = feed
        buf[lay.sample : lay.sample + len(sample_rows)] = sample_rows
        # Token ids from the host: every token of an unfed row (prompt chunks), and a fed row's tokens
        # after its first (none without speculative tokens). Only these rows cost a slice copy.
        starts = cu - num_sched
        host_rows = np.flatnonzero((feed < 0) | (num_sched > 1))
        for row in host_rows.tolist():
            skip = 1 if feed[row] >= 0 else 0
            c, n, s = int(computed[row]), int(num_sched[row]), int(starts[row])
            buf[lay.tokens + s + skip : lay.tokens + s + n] = token_ids[row, c + skip : c + n]
        used = lay.tokens + total
        self.stage[:used].copy_(self._host[k][:used], non_blocking=True)
        if self.device.type == "cuda":
            event = self._events[k]
            if event is None:
                event = self._events[k] = torch.cuda.Event()
            event.record()
        return StagedStep(
            num_reqs=r,
            num_tokens=total,
            num_sched=num_sched,
            seq_lens=seq_lens,
            sample_rows=sample_rows,
            max_query_len=int(num_sched.max()) if r else 0,
            max_seq_len=int(seq_lens.max()) if r else 0,
        )

    def build(self, num_seqs: int, num_tokens_pad: int) -> None:
        """Launch the input kernels for a step padded to num_seqs / num_tokens_pad (on the current
        stream, after the copy stage_step queued; graph-capturable)."""
        prepare_inputs(self.stage, self.layout, self.fed, self.out, num_seqs, num_tokens_pad, self.use_triton)

    def keep_sampled(self, tokens: torch.Tensor) -> None:
        """The step's sampled tokens become the next step's feed source."""
        self.fed[: tokens.shape[0]].copy_(tokens)
