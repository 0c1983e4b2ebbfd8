"""OpenAI request bodies -> what the engine runs: the prompt, SamplingParams, and the streaming options.

Field names and meanings are OpenAI's (and vLLM's extras: top_k, min_tokens, repetition_penalty,
ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens, min_p, allowed_token_ids,
bad_words; logit_bias is OpenAI's). Each value is checked by
SamplingParams itself (kvcore/request.py), so a bad one gets the rule that engine applies, with the
field named; a field kvray cannot honour is refused by name rather than ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from cluster.serve.errors import bad_request
from kvcore.request import RequestValidationError, SamplingParams, check_text, check_token_ids

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# OpenAI (and vLLM extra) names that map one-to-one onto SamplingParams.
_SAMPLING = (
    "temperature",
    "top_p",
    "n",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "top_k",
    "min_tokens",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "min_p",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
)
_COMMON = {"model", "stream", "stream_options", "max_tokens", "user", "logprobs", "return_token_ids", *_SAMPLING}
_KNOWN = {
    COMPLETIONS: _COMMON | {"prompt", "echo", "best_of", "suffix"},
    CHAT: _COMMON
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "response_format",
        "add_generation_prompt",
        "continue_final_message",
    },
}
# Accepted only with their "off" value: anything else would be silently ignored.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "echo": (False, None),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


@dataclass
class ParsedRequest:
    endpoint: str
    model: str | None
    prompt: str | None  # the text (chat: rendered later from messages)
    prompt_token_ids: list[int] | None
    messages: list[Any] | None
    params: SamplingParams
    max_tokens_given: bool
    stream: bool
    include_usage: bool
    add_generation_prompt: bool = True
    return_token_ids: bool = False  # vLLM's extra: token ids in each choice (and every token streamed)
    continue_final_message: bool = False  # vLLM's (HF's) chat extra: the model continues the last message

    @property
    def chat(self) -> bool:
        return self.endpoint == CHAT


def parse_request(endpoint: str, body: Any, defaults: SamplingParams) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _KNOWN[endpoint])
    if unknown:
        raise bad_request(f"unknown field(s) {unknown}; {endpoint} takes {sorted(_KNOWN[endpoint])}", param=unknown[0])
    for name, allowed in _OFF_VALUES.items():
        if name in body and body[name] not in allowed:
            raise bad_request(f"body.{name}={str(body[name])[:80]!r} is not supported by kvray serve")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"body.model={model!r}: must be a string")
    stream, include_usage = _stream_options(body)
    prompt, ids, messages = _prompt(endpoint, body)
    fields = {k: body[k] for k in _SAMPLING if k in body and body[k] is not None}
    if isinstance(fields.get("n"), int) and "best_of" in body and body["best_of"] not in (None, fields["n"]):
        raise bad_request(f"body.best_of={body['best_of']!r}: only best_of == n (or null) is supported")
    max_tokens = (
        body.get("max_completion_tokens", body.get("max_tokens")) if endpoint == CHAT else body.get("max_tokens")
    )
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    fields.update(_logprobs(endpoint, body))
    try:
        params = replace(defaults, **fields)
    except RequestValidationError as e:
        raise bad_request(str(e)) from None
    except TypeError as e:  # a value of a type the comparisons in validate() cannot take
        raise bad_request(f"a sampling field has a wrong type: {e}") from None
    agp, rti = body.get("add_generation_prompt", True), body.get("return_token_ids") or False
    cfm = body.get("continue_final_message", False)
    for name, v in (("add_generation_prompt", agp), ("return_token_ids", rti), ("continue_final_message", cfm)):
        if not isinstance(v, bool):
            raise bad_request(f"body.{name}={v!r}: must be a bool")
    if agp and cfm:
        raise bad_request(
            "body.continue_final_message=true needs add_generation_prompt=false (they are not compatible)",
            param="continue_final_message",
        )
    return ParsedRequest(
        endpoint, model, prompt, ids, messages, params, max_tokens is not None, stream, include_usage, agp, rti, cfm
    )


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request(f"body.stream={stream!r}: must be a bool")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad_request("body.stream_options: only allowed when stream is true")
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise bad_request(f"body.stream_options={str(opts)[:80]!r}: must be an object with include_usage")
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise bad_request(f"body.stream_options.include_usage={usage!r}: must be a bool")
    return stream, usage


def _prompt(endpoint: str, body: dict[str, Any]) -> tuple[str | None, list[int] | None, list[Any] | None]:
    if endpoint == CHAT:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise bad_request("body.messages must be a non-empty list of message objects", param="messages")
        return None, None, msgs
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt in a list: the shape the openai client sends for a list argument
    if isinstance(p, str):
        err = check_text("body.prompt", p)
        if err is not None:
            raise bad_request(err, param="prompt")
        return p, None, None
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        err = check_token_ids("body.prompt", p)
        if err is not None:
            raise bad_request(err, param="prompt")
        return None, list(p), None
    raise bad_request("body.prompt must be a string or a list of token ids (one prompt per request)", param="prompt")


def _logprobs(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """Completions: `logprobs` is the top-k count. Chat: `logprobs` is a bool and `top_logprobs` the count."""
    lp = body.get("logprobs")
    if endpoint == COMPLETIONS:
        if lp is None:
            return {}
        if isinstance(lp, bool):
            raise bad_request(f"body.logprobs={lp!r}: must be an integer in [0, 20] for /v1/completions")
        return {"logprobs": lp}
    top = body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise bad_request(f"body.logprobs={lp!r}: must be a bool for /v1/chat/completions (top_logprobs is the count)")
    if not lp:
        if top not in (None, 0):
            raise bad_request("body.top_logprobs: needs logprobs=true", param="top_logprobs")
        return {}
    return {"logprobs": 0 if top is None else top}
