"""OpenAI response bodies: completions and chat completions, whole or as server-sent-event chunks.

Logprobs take OpenAI's shapes through the batch job's formatter (cluster/job/openai_batch.py), so
`kvray run` on an OpenAI batch file and the server answer alike.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

from cluster.job.openai_batch import openai_logprobs
from cluster.outputs import RequestOutput
from cluster.serve.generation import ChoiceDelta

DONE = "data: [DONE]\n\n"
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_encode_str = json.encoder.encode_basestring  # what that encoder writes for a str (ensure_ascii=False)


def to_json(v: Any) -> str:
    """_ENCODER.encode(v), with the shapes of a stream chunk (str, int, None, token-id lists, dicts of
    those) written directly: the encoder's per-call set-up was most of a chunk's cost."""
    t = type(v)
    if v is None:
        return "null"
    if t is str:
        return _encode_str(v)
    if t is int:
        return str(v)
    if t is dict:
        return "{" + ",".join(_encode_str(k) + ":" + to_json(x) for k, x in v.items()) + "}"
    if t is list and all(type(x) is int for x in v):
        return "[" + ",".join(map(str, v)) + "]"
    return _ENCODER.encode(v)


def sse(obj: Any) -> str:
    return f"data: {to_json(obj)}\n\n"


def usage(num_prompt: int, num_output: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output}


def _lp(token_ids: list[int], rows: Any, chat: bool) -> dict[str, Any] | None:
    if rows is None:
        return None
    return openai_logprobs(SimpleNamespace(token_ids=token_ids, logprobs=rows), chat)


def full_response(
    request_id: str, model: str, outs: list[RequestOutput], chat: bool, return_token_ids: bool = False
) -> dict[str, Any]:
    """One response for a request's prompts (several only for a batch of completions: the choices of
    prompt i are indexed i * n + k, as vLLM indexes them)."""
    choices = []
    offset = 0
    for out in outs:
        for c in out.outputs:
            choice: dict[str, Any] = {
                "index": offset + c.index,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "logprobs": _lp(c.token_ids, c.logprobs, chat),
            }
            if return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            if chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            choices.append(choice)
        offset += len(out.outputs)
    n_in = sum(len(out.prompt_token_ids) for out in outs)
    n_out = sum(len(c.token_ids) for out in outs for c in out.outputs)
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(n_in, n_out),
    }


class ChunkWriter:
    """The SSE chunks of one streamed request (OpenAI's chunk objects, in order)."""

    def __init__(
        self, request_id: str, model: str, chat: bool, n: int, include_usage: bool, return_token_ids: bool = False
    ) -> None:
        self.request_id, self.model, self.chat = request_id, model, chat
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids  # then every new token makes a chunk, text or not
        self.created = int(time.time())
        self._role_sent = [False] * n
        # Every chunk's fields but its choices, encoded once: "data: {...,"choices":[" + choices + "]...}".
        head = to_json(self._chunk([]))
        cut = head.index('"choices":[]') + len('"choices":[')
        self._head, self._tail = "data: " + head[:cut], head[cut:] + "\n\n"

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            obj["usage"] = None
        return obj

    def deltas(self, deltas: list[ChoiceDelta]) -> str | None:
        """The chunk of one batch of deltas; None when none of them has anything to show."""
        choices = []
        for d in deltas:
            if not (
                d.text or d.finish_reason or d.logprobs or self._pending(d) or (self.return_token_ids and d.token_ids)
            ):
                continue  # tokens that complete no character yet: nothing to show
            choice: dict[str, Any] = {
                "index": d.index,
                "logprobs": _lp(d.token_ids, d.logprobs, self.chat),
                "finish_reason": d.finish_reason,
            }
            if self.chat:
                delta: dict[str, Any] = {}
                if not self._role_sent[d.index]:
                    delta["role"] = "assistant"
                    self._role_sent[d.index] = True
                if d.text or "role" in delta:
                    delta["content"] = d.text
                choice["delta"] = delta
            else:
                choice["text"] = d.text
                choice["stop_reason"] = d.stop_reason
            if self.return_token_ids:
                choice["token_ids"] = d.token_ids
            choices.append(choice)
        return self._head + ",".join(map(to_json, choices)) + self._tail if choices else None

    def _pending(self, d: ChoiceDelta) -> dict[str, Any]:
        return {"role": True} if self.chat and not self._role_sent[d.index] else {}

    def usage(self, num_prompt: int, num_output: int) -> str:
        obj = self._chunk([])
        obj["usage"] = usage(num_prompt, num_output)
        return sse(obj)
