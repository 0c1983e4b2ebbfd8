"""Logprobs from the engine's lists into vLLM's shape: per position {token_id: Logprob(logprob, rank,
decoded_token)}.

The engine output carries them as vLLM's LogprobsLists (plain lists, no tensors, on the control plane):
row i belongs to the i-th new token; `logprob_token_ids[i]` is [sampled token, top-1, ..., top-k],
`logprobs[i]` their log-probabilities, `sampled_token_ranks[i]` the sampled token's rank (1 = most
likely). `new_logprobs` covers sampled tokens; `new_prompt_logprobs` covers prompt positions 1.. (the
first prompt token has none), where column 0 is the prompt's own next token; it may come in several
chunks (chunked prefill).
"""
from __future__ import annotations

from typing import Any

from cluster.outputs import Logprob, PromptLogprobs, SampleLogprobs
from kvcore.messages import EngineCoreOutput

SAMPLE_FIELD = "new_logprobs"
PROMPT_FIELD = "new_prompt_logprobs"


def engine_computes_logprobs() -> bool:
    """Whether this engine's outputs carry logprobs at all (the sampler fills them)."""
    return SAMPLE_FIELD in getattr(EngineCoreOutput, "__dataclass_fields__", {})


class LogprobsProcessor:
    def __init__(self, tokenizer: Any, num_logprobs: int | None, num_prompt_logprobs: int | None) -> None:
        self.tokenizer = tokenizer  # None: no decoded_token (detokenize=False or no tokenizer)
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = num_prompt_logprobs
        self.logprobs: SampleLogprobs | None = [] if num_logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if num_logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = [None] if num_prompt_logprobs is not None else None

    def update(self, o: EngineCoreOutput, num_new_tokens: int) -> None:
        if self.logprobs is not None and num_new_tokens:
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
                self.prompt_logprobs.extend(self._rows(lists, self.num_prompt_logprobs, "prompt_logprobs"))

    def _rows(self, lists: Any, k: int, name: str) -> list[dict[int, Logprob]]:
        if lists is None:
            raise ValueError(f"SamplingParams.{name} was set but the engine output carries no {name}")
        return [self._position(ids, lps, rank, k) for ids, lps, rank in
                zip(lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks)]

    def _position(self, token_ids: list[int], logprobs: list[float], rank: int, k: int) -> dict[int, Logprob]:
        # The chosen token first (its own rank), then ranks 1..k; a chosen token inside the top k appears
        # once, as in vLLM.
        ranks = [rank, *range(1, k + 1)]
        out: dict[int, Logprob] = {}
        for tid, lp, r in zip(token_ids[:k + 1], logprobs[:k + 1], ranks):
            if tid not in out:
                out[int(tid)] = Logprob(float(lp), int(r), self._decode(tid))
        return out

    def _decode(self, token_id: int) -> str | None:
        # As vLLM: each token alone, special tokens kept.
        return None if self.tokenizer is None else self.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    def truncate(self, num_tokens: int) -> None:
        """Drop the rows of tokens cut off by a stop string, and their share of the cumulative logprob."""
        if self.logprobs is not None and len(self.logprobs) > num_tokens:
            for row in self.logprobs[num_tokens:]:
                self.cumulative_logprob -= next(iter(row.values())).logprob
            del self.logprobs[num_tokens:]
