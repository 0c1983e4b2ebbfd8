"""What LLM.generate and LLM.chat return, with vLLM's names, field order and meanings.

Logprobs are shaped as vLLM shapes them: one dict per position, {token_id: Logprob}, holding the
sampled (or, for the prompt, the actual) token and the top `logprobs` tokens; a prompt's first
position has no logprobs (None).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)  # ~6 a position when logprobs are read: slots halve their cost and size
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None  # None when detokenize=False or there is no tokenizer


# Sequences that read and compare as lists (cluster/logprobs.PositionLogprobs builds them on first read).
SampleLogprobs = Sequence[dict[int, Logprob]]
PromptLogprobs = Sequence["dict[int, Logprob] | None"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: Any = None  # RequestTiming of the first completion (the driver's clock)
    num_cached_tokens: int = 0
    error: str | None = None  # kvray: why a bad request failed alone (finish_reason "error")


def error_output(request_id: str, prompt: str | None, prompt_token_ids: list[int], message: str) -> RequestOutput:
    return RequestOutput(
        request_id,
        prompt,
        prompt_token_ids,
        None,
        [CompletionOutput(0, "", [], finish_reason="error")],
        True,
        error=message,
    )
