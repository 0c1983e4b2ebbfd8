"""Logprobs from the engine's arrays into vLLM's shape: per position {token_id: Logprob(logprob, rank,
decoded_token)}.

The engine's outputs carry arrays (kvcore.logprob_rows): each EngineCoreOutput points at its step's
`LogprobsBatch` (every request of the step), where this request's rows are found by its id; row j is one
position: `token_ids[j, 0]` is the position's own token (the sampled one, or the prompt token) and
`logprobs[j, 0]` its logprob, columns 1..k the top-k tokens best first, `ranks[j]` the own token's rank
(1 = most likely). Rows may hold more than k columns (the batch's widest request): each request keeps
its own k. `EngineCoreOutput.prompt_logprobs` comes with the first token and covers prompt positions
1.. (the first prompt token has none, so vLLM's list starts with None).

As vLLM's FlatLogprobs, the per-position dicts are not built on the output path: a request keeps a
reference to each step's rows (one tuple a step) and `PositionLogprobs` builds the dicts the first time
the list is read, in bulk (one numpy gather and one .tolist() per request), so a step of 256 requests
with logprobs=5 costs the client a lookup and an append per request, not 1,536 Logprob objects.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, overload

import numpy as np

from cluster.outputs import Logprob
from kvcore.messages import EngineCoreOutput, Logprobs, LogprobsBatch

SAMPLE_FIELD = "step_logprobs"

Position = dict[int, Logprob]
P = TypeVar("P", Position, "Position | None")
Rows = tuple[LogprobsBatch, int, int]  # a batch and the rows [start, stop) of one request


def engine_computes_logprobs() -> bool:
    """Whether this engine's outputs carry logprobs at all (the sampler fills them)."""
    return SAMPLE_FIELD in getattr(EngineCoreOutput, "__dataclass_fields__", {})


class TokenDecoder(dict[int, str]):
    """token id -> its text decoded alone, special tokens kept, as vLLM shows logprob tokens. A token's
    text depends on its id only, so it is decoded once per id (at most the vocabulary) and shared by the
    requests of an OutputProcessor; a hit is a plain dict lookup."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


class PositionLogprobs(Sequence[P]):
    """vLLM's SampleLogprobs / PromptLogprobs (a list of {token_id: Logprob}, one per position), built on
    first read from the rows appended so far; a read after more appends sees those too. Equal to a list
    of the same dicts; pickled or copied, it is that list."""

    def __init__(self, k: int, decode: TokenDecoder | None, lead: list[P] | None = None) -> None:
        self.k, self.decode = k, decode
        self._built: list[P] = list(lead or [])  # the prompt's first position: None
        self._rows: list[Rows] = []
        self._len = len(self._built)

    def append(self, batch: LogprobsBatch, start: int, stop: int) -> None:
        self._rows.append((batch, start, stop))
        self._len += stop - start

    def __len__(self) -> int:
        return self._len

    def truncate(self, n: int) -> None:
        """Keep the first n positions (rows not built yet are dropped unbuilt)."""
        drop, rows = self._len - n, self._rows
        while drop > 0 and rows:
            b, a, z = rows.pop()
            if z - a > drop:
                rows.append((b, a, z - drop))
            drop -= min(drop, z - a)
        if drop > 0:
            del self._built[len(self._built) - drop :]
        self._len = min(self._len, n)

    def own_sum(self) -> float:
        """The sum of every position's own-token logprob (column 0), in position order."""
        total = 0.0
        for pos in self._built:
            if pos is not None:
                total += next(iter(pos.values())).logprob  # the own token comes first
        for b, a, z in self._rows:
            for lp in b.own_logprobs()[a:z]:
                total += lp
        return total

    def _build(self) -> list[P]:
        rows, self._rows = self._rows, []
        if not rows:
            return self._built
        w = self.k + 1
        ids = np.concatenate([b.token_ids[a:z, :w] for b, a, z in rows]).tolist()
        lps = np.concatenate([b.logprobs[a:z, :w] for b, a, z in rows]).tolist()
        ranks = np.concatenate([b.ranks[a:z] for b, a, z in rows]).tolist()
        tail: tuple[int, ...] = tuple(range(1, w))
        decode, out = self.decode, self._built
        # Seven objects a position, none of them cyclic: the collector's passes over a heap that only
        # grows would cost more than the build itself (measured 1.5-3x), so it waits until the end.
        collecting = gc.isenabled()
        gc.disable()
        try:
            for tids, vals, rank in zip(ids, lps, ranks, strict=True):
                # The own token first (its own rank), then ranks 1..k; an own token inside the top k
                # appears once, as in vLLM.
                pos: Position = {}
                for tid, lp, r in zip(tids, vals, (rank, *tail), strict=False):
                    if tid not in pos:
                        pos[tid] = Logprob(lp, r, None if decode is None else decode[tid])
                out.append(pos)
        finally:
            if collecting:
                gc.enable()
        return out

    @overload
    def __getitem__(self, i: int) -> P: ...

    @overload
    def __getitem__(self, i: slice) -> list[P]: ...

    def __getitem__(self, i: int | slice) -> P | list[P]:
        return self._build()[i]

    def __iter__(self) -> Iterator[P]:
        return iter(self._build())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (PositionLogprobs, list)):
            return self._build() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, as a list

    def __repr__(self) -> str:
        return repr(self._build())

    def __reduce__(self) -> tuple[type, tuple[list[P]]]:
        return list, (list(self._build()),)


class LogprobsProcessor:
    def __init__(
        self,
        tokenizer: Any,
        num_logprobs: int | None,
        num_prompt_logprobs: int | None,
        decoder: TokenDecoder | None = None,
    ) -> None:
        # No tokenizer (detokenize=False, or none): no decoded_token.
        decode = None if tokenizer is None else decoder or TokenDecoder(tokenizer)
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = num_prompt_logprobs
        self.logprobs: PositionLogprobs[Position] | None = (
            PositionLogprobs(num_logprobs, decode) if num_logprobs is not None else None
        )
        self.prompt_logprobs: PositionLogprobs[Position | None] | None = (
            PositionLogprobs(num_prompt_logprobs, decode, [None]) if num_prompt_logprobs is not None else None
        )

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the kept positions' own logprobs (read when the output is made, not every step)."""
        return None if self.logprobs is None else self.logprobs.own_sum()

    def update(self, o: EngineCoreOutput, num_new_tokens: int) -> None:
        if self.logprobs is not None and num_new_tokens:
            batch = o.step_logprobs
            if batch is None:
                raise ValueError("SamplingParams.logprobs was set but the engine output carries no logprobs")
            span = batch.span(o.request_id)
            start, stop = span if span is not None else (0, 0)
            if stop - start < num_new_tokens:
                raise ValueError(
                    f"request {o.request_id!r}: {stop - start} logprob rows for {num_new_tokens} new tokens"
                )
            self.logprobs.append(batch, start, start + num_new_tokens)
        if self.prompt_logprobs is not None:
            rows: Logprobs | None = o.prompt_logprobs
            if rows is not None:
                self.prompt_logprobs.append(rows.batch, rows.start, rows.stop)

    def truncate(self, num_tokens: int) -> None:
        """Drop the rows of tokens cut off by a stop string (and so their share of the cumulative logprob)."""
        if self.logprobs is not None:
            self.logprobs.truncate(num_tokens)
