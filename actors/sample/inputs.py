"""The sampler's per-row inputs of a step, staged in pinned host buffers and copied in two DMAs.

The runner hands over the batch rows that sample and each one's output position (the index among
its output tokens of the token being sampled: seq_len - prompt length, which the scheduler's counts
give even while an async step's token is still in flight). Everything else comes from the persistent
batch's per-row arrays, so the host work is a few numpy gathers, not a Python loop per row; only rows
still under min_tokens, and rows with bad words of two or more tokens, have their ban lists written one by
one. min_p and the logit rows (logit_bias, allowed_token_ids) are gathered only while some row of the
batch uses them.

A bad word [t1 .. tk] bans tk when the output ends with t1 .. tk-1 (vLLM's rule: the output only, not the
prompt). The host checks t1 .. tk-2 against the output it has; the last of them, tk-1, must equal the
sequence's last token, which under async scheduling is still on the device: the ban goes to the kernel
with that condition (ban_prev) and the kernel reads the token from the step's input ids.
"""

from __future__ import annotations

import numpy as np
import torch

from actors.input_batch import InputBatch
from actors.sample.sampler import SamplingMetadata
from kvcore.buffers import CpuGpuBuffer

# SamplingMetadata's first five fields: temperature, top_k, top_p, seeds, positions.
RowViews = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class SamplingInputs:
    def __init__(self, max_num_reqs: int, device: torch.device, pin_memory: bool) -> None:
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.pin_memory = pin_memory
        # float32 rows: temperature, top_p, presence, frequency, repetition, min_p.
        self.f32 = CpuGpuBuffer(6, max_num_reqs, dtype=torch.float32, device=device, pin_memory=pin_memory)
        # int64 rows: top_k, seed, output position, penalty slot, logit-row slot.
        self.i64 = CpuGpuBuffer(5, max_num_reqs, dtype=torch.int64, device=device, pin_memory=pin_memory)
        # [max_num_reqs, 2, width]: banned ids, and the last token each ban waits for (-1: none); grown
        # to the widest ban list.
        self.ban: CpuGpuBuffer | None = None

    def build(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        positions: np.ndarray,
        last_token_source: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SamplingMetadata:
        """last_token_source: the step's (input ids, logits indices), needed when a row has bad words."""
        n = len(rows)
        greedy = batch.greedy[rows]
        slots = batch.penalty_slot[rows]
        has_pen = bool((slots >= 0).any())
        num_logprobs = int(batch.num_logprobs[rows].max()) if n else -1
        bans = self._ban_lists(batch, rows, positions)
        min_p = lslots = None
        if batch.num_logit_extras:
            min_p, lslots = batch.min_p[rows], batch.logit_slot[rows]
        has_min_p = min_p is not None and bool((min_p > 0).any())
        has_row = lslots is not None and bool((lslots >= 0).any())
        if greedy.all() and not has_pen and not bans and not has_row:
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
        if has_min_p:
            f[5, :n] = min_p
        if has_row:
            i[4, :n] = lslots
        fg, ig = self.f32.copy_to_gpu(), self.i64.copy_to_gpu()
        ban_ids = ban_prev = None
        if bans:
            ban_ids, ban_prev = self._ban_tensors(n, bans)
            if ban_prev is not None and last_token_source is None:
                raise RuntimeError("SamplingInputs.build: a row has bad words but no last_token_source was given")
        return SamplingMetadata(
            *self._row_views(fg, ig, n),
            all_greedy=bool(greedy.all()),
            need_filter=bool(((top_k > 0) | (top_p < 1.0)).any()) or has_min_p,
            penalty_slots=ig[3, :n] if has_pen else None,
            penalties=fg[2:5, :n] if has_pen else None,
            ban_ids=ban_ids,
            ban_prev=ban_prev,
            last_token_source=last_token_source if ban_prev is not None else None,
            logit_slots=ig[4, :n] if has_row else None,
            min_p=fg[5, :n] if has_min_p else None,
            num_logprobs=num_logprobs,
        )

    def dummy(self, n: int, filters: bool, num_logprobs: int = -1) -> SamplingMetadata:
        """Metadata for n random rows (temperature 1; top-k 8 and top-p 0.9 when `filters`) in the very
        buffers build() fills: the warm-up compiles the sampler variants that real steps use, since
        Triton specialises on the dtypes and alignment of these views."""
        f, i = self.f32.np, self.i64.np
        f[:, :n] = np.array([1.0, 0.9 if filters else 1.0, 0.0, 0.0, 1.0, 0.0], dtype=np.float32)[:, None]
        i[:, :n] = np.array([8 if filters else 0, 0, 0, -1, -1], dtype=np.int64)[:, None]
        fg, ig = self.f32.copy_to_gpu(), self.i64.copy_to_gpu()
        return SamplingMetadata(
            *self._row_views(fg, ig, n), all_greedy=False, need_filter=filters, num_logprobs=num_logprobs
        )

    @staticmethod
    def _row_views(fg: torch.Tensor, ig: torch.Tensor, n: int) -> RowViews:
        """The per-row views of the device buffers, one layout for build() and dummy(): SamplingMetadata's
        temperature, top_k, top_p, seeds, positions."""
        return fg[0, :n], ig[0, :n], fg[1, :n], ig[1, :n], ig[2, :n]

    @staticmethod
    def _ban_lists(batch: InputBatch, rows: np.ndarray, positions: np.ndarray) -> dict[int, list[tuple[int, int]]]:
        """j (into rows) -> [(banned id, last token it waits for or -1)], for rows with something banned."""
        bans: dict[int, list[tuple[int, int]]] = {}
        if batch.min_tokens_ban:
            for j in np.flatnonzero(positions < batch.min_tokens[rows]).tolist():
                bans[j] = [(t, -1) for t in batch.min_tokens_ban[int(rows[j])]]
        if batch.bad_words:
            for row, words in batch.bad_words.items():
                j = int(np.searchsorted(rows, row))  # rows ascend (the stager's flatnonzero)
                if j < len(rows) and rows[j] == row:
                    pairs = _bad_word_bans(batch, row, int(positions[j]), words)
                    if pairs:
                        bans.setdefault(j, []).extend(pairs)
        return bans

    def _ban_tensors(self, n: int, bans: dict[int, list[tuple[int, int]]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        width = max(map(len, bans.values()))
        if self.ban is None or self.ban.np.shape[2] < width:
            self.ban = CpuGpuBuffer(
                self.max_num_reqs, 2, width, dtype=torch.int32, device=self.device, pin_memory=self.pin_memory
            )
        buf = self.ban.np
        buf[:n, :, :width] = -1
        conditional = False
        for j, pairs in bans.items():
            arr = np.asarray(pairs, dtype=np.int32).reshape(-1, 2)
            buf[j, :, : len(pairs)] = arr.T
            conditional = conditional or bool((arr[:, 1] >= 0).any())
        dev = self.ban.copy_to_gpu(n)
        return dev[:, 0, :width], dev[:, 1, :width] if conditional else None


def _bad_word_bans(batch: InputBatch, row: int, out_pos: int, words: list[list[int]]) -> list[tuple[int, int]]:
    """(last token, the token before it) of each bad word whose earlier tokens end the output.

    out_pos output tokens precede the one being sampled; the host knows all of them but possibly the
    last (async scheduling), which the kernel compares on the device."""
    start = int(batch.num_prompt_tokens[row])
    known = int(batch.num_tokens[row]) - start
    out = batch.token_ids_cpu[row, start : start + known]
    pairs = []
    for seq in words:
        k = len(seq)
        if out_pos < k - 1 or out_pos - 2 >= known:
            continue  # the output is shorter than the word's prefix (or, never, the host lags by 2+)
        if k == 2 or np.array_equal(out[out_pos - k + 1 : out_pos - 1], seq[:-2]):
            pairs.append((seq[-1], seq[-2]))
    return pairs
