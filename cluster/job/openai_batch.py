"""OpenAI Batch API files for `kvray run` (the format vLLM's `run-batch` reads too).

Input line:  {"custom_id": "...", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
              "body": {"model"?, "prompt" | "messages", "max_tokens"?, "temperature"?, ...}}
Output line: {"id": "batch_req_...", "custom_id": "...",
              "response": {"status_code": 200, "request_id": "...", "body": <completion object>} | null,
              "error": null | {"code": "...", "message": "..."}}

A line that fails (a bad body, an engine error) gets status_code 400 (500 for an engine error),
an OpenAI error body, and the same `error`. A line without a usable custom_id gets `custom_id: null`.
Body fields map to SamplingParams by vLLM's names (logit_bias as OpenAI sends it: token-id strings ->
bias); `model` is recorded, not checked (one engine serves the whole file); fields kvray cannot honour
are refused by name, except with their "off" value, which `kvray serve` accepts too.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Callable

from cluster.job.line_check import check_text
from kvcore.request import INT32_MAX, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, SamplingParams, short_repr

URLS = ("/v1/completions", "/v1/chat/completions")
_RENAMED = {"max_completion_tokens": "max_tokens"}
_IGNORED = {"model", "user", "stream_options", "metadata", "store", "service_tier"}
_REFUSED = {
    "stream",
    "echo",
    "suffix",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "audio",
    "modalities",
    "prediction",
    "parallel_tool_calls",
}
# Accepted with these values only, as kvray serve accepts them (cluster/serve/protocol.py): they ask for nothing.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "stream": (False, None),
    "echo": (False, None),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}
_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # OpenAI's logit_bias keys: token ids as decimal strings


class BatchLineError(ValueError):
    """A rule an OpenAI batch line breaks; the message is the line's error."""


def parse_batch_record(where: str, rec: Any, render_chat: Callable[[list[Any]], str] | None) -> dict[str, Any]:
    """-> {"custom_id", "url", "model", "prompt" | "prompt_token_ids", "sampling": {...}}."""
    if not isinstance(rec, dict):
        raise BatchLineError(f"{where}: must be a JSON object, got {type(rec).__name__}")
    unknown = sorted(set(rec) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise BatchLineError(
            f"{where}: unknown field(s) {unknown}; an OpenAI batch line has custom_id, method, url, body"
        )
    cid = rec.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise BatchLineError(f"{where}: custom_id must be a non-empty string")
    check_text(where, "custom_id", cid)
    if not cid.isprintable():
        raise BatchLineError(f"{where}: custom_id={cid[:80]!r} must be printable (no control characters)")
    if rec.get("method") != "POST":
        raise BatchLineError(f"{where}: method={rec.get('method')!r}: must be 'POST'")
    url = rec.get("url")
    if url not in URLS:
        raise BatchLineError(f"{where}: url={url!r}: must be one of {list(URLS)}")
    body = rec.get("body")
    if not isinstance(body, dict):
        raise BatchLineError(f"{where}: body must be a JSON object")
    out: dict[str, Any] = {"custom_id": cid, "url": url, "model": body.get("model")}
    if url == "/v1/completions":
        out.update(_completion_prompt(where, body))
    else:
        out["prompt"], out["chat"] = _chat_prompt(where, body, render_chat), True
    out["sampling"] = _sampling(where, body, url)
    return out


def _completion_prompt(where: str, body: dict[str, Any]) -> dict[str, Any]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt in a list: the common client shape
    if isinstance(p, str):
        return {"prompt": check_text(where, "body.prompt", p)}
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return {"prompt_token_ids": p}
    raise BatchLineError(f"{where}: body.prompt must be a string or a list of token ids (one prompt a line)")


def _chat_prompt(where: str, body: dict[str, Any], render_chat: Callable[[list[Any]], str] | None) -> str:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise BatchLineError(f"{where}: body.messages must be a non-empty list of message objects")
    if render_chat is None:
        raise BatchLineError(
            f"{where}: /v1/chat/completions needs the model's chat template, and this "
            f"model has none (tokenizer_config.json chat_template)"
        )
    return render_chat(msgs)


def _sampling(where: str, body: dict[str, Any], url: str) -> dict[str, Any]:
    fields = set(SamplingParams.__dataclass_fields__)
    prompt_keys = {"prompt"} if url == "/v1/completions" else {"messages"}
    sp: dict[str, Any] = {}
    for k, v in body.items():
        if k in prompt_keys or k in _IGNORED:
            continue
        if k in _REFUSED:
            if k in _OFF_VALUES and _is_off(k, v):
                continue
            shown = f"={short_repr(v)}" if k in _OFF_VALUES else ""
            raise BatchLineError(f"{where}: body.{k}{shown} is not supported by kvray run")
        if url == "/v1/chat/completions" and k in ("logprobs", "top_logprobs"):
            if body.get("logprobs"):
                sp["logprobs"] = body.get("top_logprobs") or 0
            continue
        if k == "logit_bias":
            sp["logit_bias"] = _logit_bias(where, v)
            continue
        name = _RENAMED.get(k, k)
        if name not in fields:
            raise BatchLineError(f"{where}: body.{k} is not a field kvray knows; sampling fields: {sorted(fields)}")
        if name == "stop" and isinstance(v, str):
            v = [v]
        sp[name] = v
    return sp


def _is_off(name: str, value: Any) -> bool:
    # `in` compares with ==, and True == 1: a bool must match a bool.
    return any(type(value) is type(off) and value == off for off in _OFF_VALUES[name])


def _logit_bias(where: str, value: Any) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"50256": -100}) -> SamplingParams' {50256: -100.0}, each key and value checked."""
    if value is None:
        return None
    rule = (
        f"must be an object of at most {MAX_LOGIT_BIAS_TOKENS} entries, token id (a decimal string, "
        f"0..{INT32_MAX}) -> bias (a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}])"
    )
    if not isinstance(value, dict):
        raise BatchLineError(f"{where}: body.logit_bias={short_repr(value)}: {rule}")
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise BatchLineError(f"{where}: body.logit_bias has {len(value)} entries: {rule}")
    out: dict[int, float] = {}
    for k, v in value.items():
        if not _TOKEN_ID.fullmatch(k) or int(k) > INT32_MAX:
            raise BatchLineError(f"{where}: body.logit_bias: key {short_repr(k)} must be a token id; {rule}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise BatchLineError(
                f"{where}: body.logit_bias[{short_repr(k)}]={short_repr(v)}: must be a number in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            )
        out[int(k)] = float(v)
    return out


def make_chat_renderer(tokenizer: Any) -> Callable[[list[Any]], str] | None:
    """messages -> prompt text with the model's chat template (cluster/client/chat.py, as LLM.chat renders
    it); None when this model has no template."""
    model_dir = getattr(tokenizer, "model_dir", None)
    try:
        from cluster.client.chat import (
            ChatTemplateError,
            as_conversations,
            render_chat,
            resolve_chat_template,
            special_tokens,
        )
    except ImportError:
        return None
    try:
        template = resolve_chat_template(model_dir, None)
    except ChatTemplateError:
        return None
    tokens = special_tokens(model_dir) if model_dir else {}

    def render(messages: list[Any]) -> str:
        convs, _ = as_conversations(messages)
        return render_chat(convs[0], template, tokens=tokens)

    return render


# ---- output -----------------------------------------------------------------------------------------
def batch_error(item: Any, message: str, status: int = 400) -> dict[str, Any]:
    """The OpenAI batch output line of a line that failed (400: the request; 500: the engine)."""
    code = "server_error" if status >= 500 else "invalid_request"
    body = {
        "error": {
            "message": message,
            "type": "server_error" if status >= 500 else "invalid_request_error",
            "param": None,
            "code": code,
        }
    }
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": item.batch.get("custom_id"),
        "response": {"status_code": status, "request_id": f"kvray-{uuid.uuid4().hex}", "body": body},
        "error": {"code": code, "message": message},
    }


def batch_output(item: Any, out: Any) -> dict[str, Any]:
    """One OpenAI batch output line for a finished Item (its .batch holds custom_id, url, model) and the
    RequestOutput the client made of it."""
    b = item.batch
    chat = b.get("url") == "/v1/chat/completions"
    rid = uuid.uuid4().hex
    choices = []
    for c in out.outputs:
        choice: dict[str, Any] = {
            "index": c.index,
            "finish_reason": c.finish_reason,
            "logprobs": openai_logprobs(c, chat) if c.logprobs is not None else None,
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        choices.append(choice)
    n_prompt, n_out = len(item.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    body = {
        "id": ("chatcmpl-" if chat else "cmpl-") + rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": b.get("model"),
        "choices": choices,
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
    }
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": b.get("custom_id"),
        "response": {"status_code": 200, "request_id": f"kvray-{rid}", "body": body},
        "error": None,
    }


def openai_logprobs(c: Any, chat: bool) -> dict[str, Any]:
    """OpenAI's logprobs shapes: chat {"content": [...]}, completions {"tokens", "token_logprobs", ...}."""
    steps = []
    for tid, d in zip(c.token_ids, c.logprobs, strict=False):
        own = d.get(tid)
        tops = sorted(d.items(), key=lambda kv: kv[1].rank or 0)
        steps.append(
            (
                own.decoded_token if own else None,
                own.logprob if own else None,
                [(lp.decoded_token, lp.logprob) for t, lp in tops if t != tid or lp.rank is not None],
            )
        )
    if chat:
        return {
            "content": [
                {"token": tok, "logprob": lp, "top_logprobs": [{"token": t, "logprob": v} for t, v in tops]}
                for tok, lp, tops in steps
            ]
        }
    return {
        "tokens": [s[0] for s in steps],
        "token_logprobs": [s[1] for s in steps],
        "top_logprobs": [{t: v for t, v in s[2]} for s in steps],
        "text_offset": None,
    }


def is_success(rec: dict[str, Any]) -> bool:
    """An output line that answers its input for good (a rerun skips it)."""
    if "custom_id" in rec and "response" in rec:
        resp = rec.get("response")
        return rec.get("error") is None and isinstance(resp, dict) and resp.get("status_code") == 200
    return rec.get("error") is None and rec.get("finish_reason") != "error"


def record_key(rec: dict[str, Any]) -> str | None:
    key = rec.get("custom_id") if "custom_id" in rec else rec.get("id")
    return key if isinstance(key, str) else None
