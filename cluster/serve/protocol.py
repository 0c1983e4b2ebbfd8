"""OpenAI request bodies -> what the engine runs: the prompt, SamplingParams, and the streaming options.

Field names and meanings are OpenAI's (and vLLM's extras: top_k, min_tokens, repetition_penalty,
ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens, min_p, allowed_token_ids,
bad_words; logit_bias is OpenAI's). Each value is checked by
SamplingParams itself (kvcore/request.py), so a bad one gets the rule that engine applies, with the
field named; a field kvray cannot honour is refused by name rather than ignored (best_of, as vLLM V1).
/v1/completions takes one prompt or a list of them (vLLM's batch: the choices of prompt i are
indexed i * n + k); every string of a request must be valid Unicode (no lone surrogate).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from cluster.serve.errors import bad_request, clip
from kvcore.request import MAX_LOGPROBS, RequestValidationError, SamplingParams, check_text, check_token_ids

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
class PromptInput:
    """One prompt of a request: a text (tokenized by the server) or token ids."""

    text: str | None
    token_ids: list[int] | None


@dataclass
class ParsedRequest:
    endpoint: str
    model: str | None
    prompts: list[PromptInput]  # completions: one or more; chat: none (rendered later from messages)
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

    @property
    def num_prompts(self) -> int:
        return 1 if self.chat else len(self.prompts)


def parse_request(endpoint: str, body: Any, defaults: SamplingParams) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _KNOWN[endpoint])
    if unknown:
        raise bad_request(f"unknown field(s) {unknown}; {endpoint} takes {sorted(_KNOWN[endpoint])}", param=unknown[0])
    for name, allowed in _OFF_VALUES.items():
        if name in body and body[name] not in allowed:
            raise bad_request(f"body.{name}={clip(body[name])} is not supported by kvray serve")
    if body.get("best_of") not in (None, 1):
        raise bad_request(
            f"body.best_of={clip(body['best_of'])}: best_of is not supported (as in vLLM V1); use n for n samples",
            param="best_of",
        )
    model = body.get("model")
    if model is not None:
        err = check_text("body.model", model)
        if err is not None:
            raise bad_request(err, param="model")
    stream, include_usage = _stream_options(body)
    prompts, messages = _prompts(endpoint, body)
    fields = {k: body[k] for k in _SAMPLING if k in body and body[k] is not None}
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request(f"body.user={clip(user)}: must be a string", param="user")
    for name in ("stop", "user"):
        _check_strings(f"body.{name}", body.get(name), name)
    # Chat: max_completion_tokens (OpenAI's current name) wins over the deprecated max_tokens; null = absent.
    max_tokens = body.get("max_completion_tokens") if endpoint == CHAT else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
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
            raise bad_request(f"body.{name}={clip(v)}: must be a bool")
    if agp and cfm:
        raise bad_request(
            "body.continue_final_message=true needs add_generation_prompt=false (they are not compatible)",
            param="continue_final_message",
        )
    return ParsedRequest(
        endpoint, model, prompts, messages, params, max_tokens is not None, stream, include_usage, agp, rti, cfm
    )


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request(f"body.stream={clip(stream)}: must be a bool")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad_request("body.stream_options: only allowed when stream is true")
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise bad_request(f"body.stream_options={clip(opts)}: must be an object with include_usage")
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise bad_request(f"body.stream_options.include_usage={clip(usage)}: must be a bool")
    return stream, usage


def _prompts(endpoint: str, body: dict[str, Any]) -> tuple[list[PromptInput], list[Any] | None]:
    if endpoint == CHAT:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise bad_request("body.messages must be a non-empty list of message objects", param="messages")
        _check_strings("body.messages", msgs, "messages")
        return [], msgs
    p = body.get("prompt")
    # A list of strings or of token-id lists is a batch (vLLM's); a list of ints is one prompt.
    batch = p if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p) else [p]
    return [_one_prompt(x, f"body.prompt[{k}]" if len(batch) > 1 else "body.prompt") for k, x in enumerate(batch)], None


def _one_prompt(p: Any, where: str) -> PromptInput:
    if isinstance(p, str):
        err = check_text(where, p)
        if err is not None:
            raise bad_request(err, param="prompt")
        if not p:
            raise bad_request(f"{where} is empty: a prompt needs at least one token", param="prompt")
        return PromptInput(p, None)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        err = check_token_ids(where, p)
        if err is not None:
            raise bad_request(err, param="prompt")
        return PromptInput(None, list(p))
    raise bad_request(
        f"{where} must be a non-empty string or list of token ids (or a list of those), got {clip(p)}",
        param="prompt",
    )


def _check_strings(where: str, value: Any, param: str) -> None:
    """Every string in value (nested lists and objects, keys too) is valid Unicode: a lone surrogate
    would fail later, in the template or the tokenizer, as a server error."""
    stack = [(where, value)]
    while stack:  # no recursion: depth is the client's to choose
        at, v = stack.pop()
        if isinstance(v, str):
            err = check_text(at, v)
            if err is not None:
                raise bad_request(err, param=param)
        elif isinstance(v, dict):
            stack.extend((f"{at}.{clip(k, 40)}", k) for k in v)
            stack.extend((f"{at}.{clip(k, 40)}", x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((f"{at}[{k}]", x) for k, x in enumerate(v))


def _logprobs(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """Completions: `logprobs` is the top-k count. Chat: `logprobs` is a bool and `top_logprobs` the count."""
    lp = body.get("logprobs")
    if endpoint == COMPLETIONS:
        if lp is None:
            return {}
        if isinstance(lp, bool):
            raise bad_request(
                f"body.logprobs={lp!r}: must be an integer in [0, {MAX_LOGPROBS}] for /v1/completions", param="logprobs"
            )
        return {"logprobs": lp}
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_LOGPROBS):
        raise bad_request(
            f"body.top_logprobs={clip(top)}: must be an integer in [0, {MAX_LOGPROBS}]", param="top_logprobs"
        )
    if lp is not None and not isinstance(lp, bool):
        raise bad_request(
            f"body.logprobs={clip(lp)}: must be a bool for /v1/chat/completions (top_logprobs is the count)",
            param="logprobs",
        )
    if not lp:
        if top not in (None, 0):
            raise bad_request("body.top_logprobs: needs logprobs=true", param="top_logprobs")
        return {}
    return {"logprobs": 0 if top is None else top}
