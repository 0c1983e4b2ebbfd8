"""When a request stops: the one place that reads EOS, stop_token_ids, min_tokens, max_tokens and
max_model_len.

The scheduler builds a `StopRule` per live request when it is added, so checking a sampled token is one
set test and one comparison; `set_finished_status` says which stop fired. max_tokens past max_model_len
is not an error (as in vLLM): the generation is capped there and finishes with "length".
"""

from __future__ import annotations

from typing import NamedTuple

from kvcore.request import Request, RequestStatus


class StopRule(NamedTuple):
    request: Request
    token_limit: int  # token count that ends it: prompt + max_tokens, capped by max_model_len
    eos: int | None  # the EOS id, unless ignore_eos
    stop_ids: frozenset[int] | None  # stop_token_ids; None when empty
    stops: frozenset[int]  # every token that stops it (EOS and stop ids; maybe empty)
    # Token count below which no stop token stops it: prompt + min_tokens. The sampler masks EOS and
    # the stop ids until then; this keeps the rule even if one is sampled anyway.
    min_len: int


def make_stop_rule(request: Request, max_model_len: int) -> StopRule:
    params = request.sampling_params
    eos = None if params.ignore_eos else request.eos_token_id
    stop_ids = frozenset(params.stop_token_ids) if params.stop_token_ids else None
    stops = frozenset(params.stop_token_ids if eos is None else [*params.stop_token_ids, eos])
    num_prompt = request.num_prompt_tokens
    return StopRule(
        request,
        min(num_prompt + params.max_tokens, max_model_len),
        eos,
        stop_ids,
        stops,
        num_prompt + params.min_tokens,
    )


def stops_on(rule: StopRule, tok: int, num_tokens: int) -> bool:
    """Whether `tok`, which brought the request to `num_tokens` tokens, ends it."""
    return num_tokens >= rule.token_limit or (tok in rule.stops and num_tokens >= rule.min_len)


def append_until_stop(rule: StopRule, token_ids: list[int]) -> list[int]:
    """Append tokens one at a time; those after the first stop are dropped. Returns the kept ones."""
    request = rule.request
    for k, tok in enumerate(token_ids):
        request.append_output_token_ids(tok)
        if stops_on(rule, tok, request.num_tokens):
            return token_ids[: k + 1]
    return token_ids


def set_finished_status(rule: StopRule, tok: int) -> None:
    """Which stop fired on `tok`, the last token kept: a stop the model chose (EOS, stop token)
    beats a length cap, so a stop token that also reaches the limit reports "stop"."""
    request = rule.request
    if request.num_tokens < rule.min_len or tok not in rule.stops:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    elif tok == rule.eos:
        request.status = RequestStatus.FINISHED_STOPPED
    else:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = tok
