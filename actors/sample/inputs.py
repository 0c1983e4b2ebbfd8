"""The sampler's per-row inputs of a step, staged in pinned host buffers and copied in two DMAs.

The runner hands over the batch rows that sample and each one's output position (the index among
its output tokens of the token being sampled: seq_len - prompt length, which the scheduler's counts
give even while an async step's token is still in flight). Everything else comes from the persistent
batch's per-row arrays, so the host work is a few numpy gathers, not a Python loop per row; only rows
still under min_tokens have their ban lists written one by one.
"""

from __future__ import annotations

import numpy as np
import torch

from actors.input_batch import InputBatch
from actors.sample.sampler import SamplingMetadata
from kvcore.buffers import CpuGpuBuffer


class SamplingInputs:
    def __init__(self, max_num_reqs: int, device: torch.device, pin_memory: bool) -> None:
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.pin_memory = pin_memory
        # float32 rows: temperature, top_p, presence, frequency, repetition.
        self.f32 = CpuGpuBuffer(5, max_num_reqs, dtype=torch.float32, device=device, pin_memory=pin_memory)
        # int64 rows: top_k, seed, output position, penalty slot.
        self.i64 = CpuGpuBuffer(4, max_num_reqs, dtype=torch.int64, device=device, pin_memory=pin_memory)
        self.ban: CpuGpuBuffer | None = None  # [max_num_reqs, width], grown to the widest ban list

    def build(self, batch: InputBatch, rows: np.ndarray, positions: np.ndarray) -> SamplingMetadata:
        n = len(rows)
        greedy = batch.greedy[rows]
        slots = batch.penalty_slot[rows]
        has_pen = bool((slots >= 0).any())
        num_logprobs = int(batch.num_logprobs[rows].max()) if n else -1
        ban_rows = self._ban_rows(batch, rows, positions)
        if greedy.all() and not has_pen and not ban_rows:
            # Argmax needs no per-row parameters: skip their copies (launches cost on the host).
            return SamplingMetadata(
                None, None, None, None, None, all_greedy=True, need_filter=False, num_logprobs=num_logprobs
            )
        top_k = np.where(greedy, 0, batch.top_k[rows])
        top_p = np.where(greedy, 1.0, batch.top_p[rows])
        f, i = self.f32.np, self.i64.np
        f[0, :n] = np.where(greedy, 0.0, batch.temperature[rows])
        f[1, :n] = top_p
        f[2, :n] = batch.presence_penalty[rows]
        f[3, :n] = batch.frequency_penalty[rows]
        f[4, :n] = batch.repetition_penalty[rows]
        i[0, :n] = top_k
        i[1, :n] = batch.seed[rows]
        i[2, :n] = positions
        i[3, :n] = slots
        fg, ig = self.f32.copy_to_gpu(), self.i64.copy_to_gpu()
        return SamplingMetadata(
            **self._row_views(fg, ig, n),
            all_greedy=bool(greedy.all()),
            need_filter=bool(((top_k > 0) | (top_p < 1.0)).any()),
            penalty_slots=ig[3, :n] if has_pen else None,
            penalties=fg[2:5, :n] if has_pen else None,
            ban_ids=self._ban_ids(batch, rows, ban_rows) if ban_rows else None,
            num_logprobs=num_logprobs,
        )

    def dummy(self, n: int, filters: bool, num_logprobs: int = -1) -> SamplingMetadata:
        """Metadata for n random rows (temperature 1; top-k 8 and top-p 0.9 when `filters`) in the very
        buffers build() fills: the warm-up compiles the sampler variants that real steps use, since
        Triton specialises on the dtypes and alignment of these views."""
        f, i = self.f32.np, self.i64.np
        f[:, :n] = np.array([1.0, 0.9 if filters else 1.0, 0.0, 0.0, 1.0], dtype=np.float32)[:, None]
        i[:, :n] = np.array([8 if filters else 0, 0, 0, -1], dtype=np.int64)[:, None]
        fg, ig = self.f32.copy_to_gpu(), self.i64.copy_to_gpu()
        return SamplingMetadata(
            **self._row_views(fg, ig, n), all_greedy=False, need_filter=filters, num_logprobs=num_logprobs
        )

    @staticmethod
    def _row_views(fg: torch.Tensor, ig: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
        """The per-row views of the device buffers, one layout for build() and dummy()."""
        return dict(temperature=fg[0, :n], top_k=ig[0, :n], top_p=fg[1, :n], seeds=ig[1, :n], positions=ig[2, :n])

    @staticmethod
    def _ban_rows(batch: InputBatch, rows: np.ndarray, positions: np.ndarray) -> list[int]:
        """Indices j (into rows) still short of min_tokens: they may not sample EOS or a stop token."""
        if not batch.min_tokens_ban:
            return []
        return np.flatnonzero(positions < batch.min_tokens[rows]).tolist()

    def _ban_ids(self, batch: InputBatch, rows: np.ndarray, ban_rows: list[int]) -> torch.Tensor:
        n = len(rows)
        lists = [batch.min_tokens_ban[int(rows[j])] for j in ban_rows]
        width = max(map(len, lists))
        if self.ban is None or self.ban.np.shape[1] < width:
            self.ban = CpuGpuBuffer(
                self.max_num_reqs, width, dtype=torch.int32, device=self.device, pin_memory=self.pin_memory
            )
        buf = self.ban.np
        buf[:n, :width] = -1
        for j, ids in zip(ban_rows, lists):
            buf[j, : len(ids)] = ids
        return self.ban.copy_to_gpu(n)[:, :width]
