"""Logprob rows as the messages carry them: one step's arrays, shared by the messages of that step.

A step computes the logprobs of all its sampled rows at once. Each request's `Logprobs` is a window
of rows of that step's `LogprobsBatch`, not a copy of them: the worker converts a step's results to
numpy once, not once per request. Pickled (Ray, pipes), a window is (batch, start, stop, width) and
pickle's memo writes the batch once per message, so a step of 256 requests sends three arrays, not
768 (the ModelRunnerOutput to the driver, then the PollResult to the client). On the client the batch
turns into Python lists once (`LogprobsBatch.lists`), and each request reads its rows from those.
"""
from __future__ import annotations

import numpy as np

RowLists = tuple[list[list[int]], list[list[float]], list[int]]


class LogprobsBatch:
    """One step's rows: token_ids int32 [R, W], logprobs float32 [R, W], ranks int32 [R]."""

    __slots__ = ("token_ids", "logprobs", "ranks", "_lists")

    def __init__(self, token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray) -> None:
        self.token_ids, self.logprobs, self.ranks = token_ids, logprobs, ranks
        self._lists: RowLists | None = None

    def __reduce__(self) -> tuple[type, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        return LogprobsBatch, (self.token_ids, self.logprobs, self.ranks)  # the lists are rebuilt on demand

    def lists(self) -> RowLists:
        """The arrays as Python lists, converted once for all the windows that read them."""
        if self._lists is None:
            self._lists = (self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist())
        return self._lists


class Logprobs:
    """Log-probabilities of P consecutive positions of one request: rows [start, stop) and the first
    `width` columns of a LogprobsBatch.

    Row j: token_ids[j, 0] is the position's own token (the sampled one, or the prompt token) and
    logprobs[j, 0] its logprob; columns 1..k are the top-k tokens by logprob, best first; ranks[j] is
    the own token's rank (1 = most likely). Logprobs are the raw model's float32 log_softmax.
    `Logprobs(token_ids, logprobs, ranks)` wraps arrays of its own; `window` shares a step's batch.
    """

    __slots__ = ("batch", "start", "stop", "width")

    def __init__(self, token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray) -> None:
        self.batch = LogprobsBatch(token_ids, logprobs, ranks)
        self.start, self.stop, self.width = 0, int(ranks.shape[0]), int(token_ids.shape[1])

    @staticmethod
    def window(batch: LogprobsBatch, start: int, stop: int, width: int) -> "Logprobs":
        lp = Logprobs.__new__(Logprobs)
        lp.batch, lp.start, lp.stop, lp.width = batch, start, stop, width
        return lp

    def __reduce__(self) -> tuple[object, tuple[LogprobsBatch, int, int, int]]:
        return Logprobs.window, (self.batch, self.start, self.stop, self.width)

    def __len__(self) -> int:
        return self.stop - self.start

    def __repr__(self) -> str:
        return f"Logprobs(rows={len(self)}, width={self.width})"

    @property
    def token_ids(self) -> np.ndarray:  # int32 [P, width]
        return self.batch.token_ids[self.start:self.stop, :self.width]

    @property
    def logprobs(self) -> np.ndarray:   # float32 [P, width]
        return self.batch.logprobs[self.start:self.stop, :self.width]

    @property
    def ranks(self) -> np.ndarray:      # int32 [P]
        return self.batch.ranks[self.start:self.stop]

    def head(self, n: int) -> "Logprobs":
        """The first n rows (a stop inside a multi-token step drops the rest)."""
        return Logprobs.window(self.batch, self.start, self.start + min(n, len(self)), self.width)

    def row_lists(self) -> RowLists:
        """The rows as Python lists (token ids and logprobs may run past `width`: read the first width)."""
        ids, lps, ranks = self.batch.lists()
        a, b = self.start, self.stop
        return ids[a:b], lps[a:b], ranks[a:b]
