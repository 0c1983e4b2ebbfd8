"""Logprobs from the engine's arrays into vLLM's shape: per position {token_id: Logprob(logprob, rank,
decoded_token)}.

The engine output carries them as kvcore.messages.Logprobs (windows of one step's arrays, filled by the sampler on the
device): row j is one position; `token_ids[j, 0]` is the position's own token (the sampled one, or the
prompt token) and `logprobs[j, 0]` its logprob, columns 1..k the top-k tokens best first, `ranks[j]`
the own token's rank (1 = most likely). `EngineCoreOutput.logprobs` has one row per new token;
`EngineCoreOutput.prompt_logprobs` comes with the first token and covers prompt positions 1.. (the
first prompt token has none, so vLLM's list starts with None). Rows may hold more than k columns (the
batch's widest request): each request keeps its own k.
"""
from __future__ import annotations

from typing import Any

from cluster.outputs import Logprob, PromptLogprobs, SampleLogprobs
from kvcore.messages import EngineCoreOutput, Logprobs

SAMPLE_FIELD = "logprobs"
PROMPT_FIELD = "prompt_logprobs"


def engine_computes_logprobs() -> bool:
    """Whether this engine's outputs carry logprobs at all (the sampler fills them)."""
    return SAMPLE_FIELD in getattr(EngineCoreOutput, "__dataclass_fields__", {})


class TokenDecoder(dict[int, str]):
    """token id -> its text decoded alone, special tokens kept, as vLLM shows logprob tokens. A token's
    text depends on its id only, so it is decoded once per id (at most the vocabulary) and shared by the
    requests of an OutputProcessor: a step of 256 requests with logprobs=5 reads up to 1,536 of them, and
    a hit is a plain dict lookup."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


class LogprobsProcessor:
    def __init__(self, tokenizer: Any, num_logprobs: int | None, num_prompt_logprobs: int | None,
                 decoder: TokenDecoder | None = None) -> None:
        # No tokenizer (detokenize=False, or none): no decoded_token.
        self.decode: TokenDecoder | None = None if tokenizer is None else decoder or TokenDecoder(tokenizer)
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = num_prompt_logprobs
        self.logprobs: SampleLogprobs | None = [] if num_logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if num_logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = [None] if num_prompt_logprobs is not None else None

    def update(self, o: EngineCoreOutput, num_new_tokens: int) -> None:
        if self.logprobs is not None and num_new_tokens:
            # logprobs, num_logprobs and cumulative_logprob are set together in __init__.
            assert self.num_logprobs is not None and self.cumulative_logprob is not None
            lists = getattr(o, SAMPLE_FIELD, None)
            rows = self._rows(lists, self.num_logprobs, "logprobs")
            if len(rows) != num_new_tokens:
                raise ValueError(f"request {o.request_id!r}: {len(rows)} logprob rows for {num_new_tokens} new "
                                 "tokens")
            for row in rows:
                self.logprobs.append(row)
                self.cumulative_logprob += next(iter(row.values())).logprob
        if self.prompt_logprobs is not None:
            lists = getattr(o, PROMPT_FIELD, None)
            if lists is not None:
                assert self.num_prompt_logprobs is not None  # set together with prompt_logprobs
                self.prompt_logprobs.extend(self._rows(lists, self.num_prompt_logprobs, "prompt_logprobs"))

    def _rows(self, lists: Logprobs | None, k: int, name: str) -> list[dict[int, Logprob]]:
        if lists is None:
            raise ValueError(f"SamplingParams.{name} was set but the engine output carries no {name}")
        position = self._position
        return [position(ids, lps, rank, k) for ids, lps, rank in zip(*lists.row_lists())]

    def _position(self, token_ids: list[int], logprobs: list[float], rank: int, k: int) -> dict[int, Logprob]:
        # The chosen token first (its own rank), then ranks 1..k; a chosen token inside the top k appears
        # once, as in vLLM. The values are Python ints and floats already (LogprobsBatch.lists).
        decode = self.decode
        out: dict[int, Logprob] = {}
        for tid, lp, r in zip(token_ids[:k + 1], logprobs[:k + 1], (rank, *range(1, k + 1))):
            if tid not in out:
                out[tid] = Logprob(lp, r, None if decode is None else decode[tid])
        return out

    def truncate(self, num_tokens: int) -> None:
        """Drop the rows of tokens cut off by a stop string, and their share of the cumulative logprob."""
        if self.logprobs is not None and len(self.logprobs) > num_tokens:
            assert self.cumulative_logprob is not None  # set together with logprobs
            for row in self.logprobs[num_tokens:]:
                self.cumulative_logprob -= next(iter(row.values())).logprob
            del self.logprobs[num_tokens:]
