"""Logprob rows as the messages carry them: one step's arrays, shared by every request of that step.

A step computes the logprobs of all its sampled rows at once, and they travel as that one
`LogprobsBatch` (four arrays and the rows' request ids), from the worker through the driver to the
client: no per-request object is made, pickled or unpickled on the way (pickle's memo writes a batch
once per message however many outputs point at it). Each EngineCoreOutput of the step points at the
batch; the client finds its request's rows by request id (`span`, an index built once per batch), and
only the client's output processor turns rows into Python objects. `Logprobs` is a window of a batch:
one request's rows (its prompt logprobs travel as one, and `EngineCoreOutput.logprobs` reads one).

Both are messages of kvcore/wire.py that travel by reference (`inline=False`): the outputs that point at a
batch keep pointing at one object on the other side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvcore.wire import LOCAL_ONLY, message


@message(inline=False)
@dataclass(slots=True, eq=False)
class LogprobsBatch:
    """Rows: token_ids int32 [R, W], logprobs float32 [R, W], ranks int32 [R]. For a step's sampled
    rows also req_ids (one per row; a request's rows are consecutive, in token order) and ks int32 [R]
    (the k its request asked; -1: none, the row was computed for the batch only)."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray
    req_ids: list[str] | None = None
    ks: np.ndarray | None = None
    # Caches, rebuilt on demand by whoever reads the batch (off the wire).
    _last: dict[str, int] | None = field(
        default=None, init=False, repr=False, metadata=LOCAL_ONLY
    )  # req_id -> last row
    _first: dict[str, int] | None = field(default=None, init=False, repr=False, metadata=LOCAL_ONLY)  # its first row
    _own: list[float] | None = field(default=None, init=False, repr=False, metadata=LOCAL_ONLY)

    def __len__(self) -> int:
        return int(self.ranks.shape[0])

    def span(self, req_id: str) -> tuple[int, int] | None:
        """The rows [start, stop) of req_id, or None when the batch has none of its rows."""
        last = self._last
        if last is None:
            ids = self.req_ids or []
            last = self._last = dict(zip(ids, range(len(ids)), strict=True))
            if len(last) < len(ids):  # some request has several rows: their first comes from the end
                self._first = dict(zip(reversed(ids), range(len(ids) - 1, -1, -1), strict=True))
        stop = last.get(req_id)
        if stop is None:
            return None
        return (stop if self._first is None else self._first[req_id]), stop + 1

    def rows_for(self, req_id: str, n: int) -> "Logprobs | None":
        """The first n rows of req_id, trimmed to its k; None when it asked for none or has no rows here."""
        span = self.span(req_id)
        if span is None:
            return None
        k = int(self.ks[span[0]]) if self.ks is not None else int(self.token_ids.shape[1]) - 1
        if k < 0:
            return None
        return Logprobs.window(self, span[0], min(span[0] + n, span[1]), 1 + k)

    def own_logprobs(self) -> list[float]:
        """Column 0 (each row's own token's logprob) as Python floats, converted once for every reader."""
        if self._own is None:
            self._own = self.logprobs[:, 0].tolist()
        return self._own


@message(inline=False)
@dataclass(slots=True, eq=False, init=False, repr=False)
class Logprobs:
    """Log-probabilities of P consecutive positions of one request: rows [start, stop) and the first
    `width` columns of a LogprobsBatch.

    Row j: token_ids[j, 0] is the position's own token (the sampled one, or the prompt token) and
    logprobs[j, 0] its logprob; columns 1..k are the top-k tokens by logprob, best first; ranks[j] is
    the own token's rank (1 = most likely). Logprobs are the raw model's float32 log_softmax.
    `Logprobs(token_ids, logprobs, ranks)` wraps arrays of its own; `window` shares a batch.
    """

    batch: LogprobsBatch
    start: int
    stop: int
    width: int

    def __init__(self, token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray) -> None:
        self.batch = LogprobsBatch(token_ids, logprobs, ranks)
        self.start, self.stop, self.width = 0, int(ranks.shape[0]), int(token_ids.shape[1])

    @staticmethod
    def window(batch: LogprobsBatch, start: int, stop: int, width: int) -> "Logprobs":
        lp = Logprobs.__new__(Logprobs)
        lp.batch, lp.start, lp.stop, lp.width = batch, start, stop, width
        return lp

    def __len__(self) -> int:
        return self.stop - self.start

    def __repr__(self) -> str:
        return f"Logprobs(rows={len(self)}, width={self.width})"

    @property
    def token_ids(self) -> np.ndarray:  # int32 [P, width]
        return self.batch.token_ids[self.start : self.stop, : self.width]

    @property
    def logprobs(self) -> np.ndarray:  # float32 [P, width]
        return self.batch.logprobs[self.start : self.stop, : self.width]

    @property
    def ranks(self) -> np.ndarray:  # int32 [P]
        return self.batch.ranks[self.start : self.stop]
