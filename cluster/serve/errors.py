"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

Every failure a route can meet becomes one of these (a bad field 400, a missing API key 401, an unknown
model 404, a body too large 413 or not JSON 415, a full engine 503 with Retry-After, an engine failure
500): a client never sees a bare traceback. A message never echoes unbounded input: values are shown
through `clip`, and a message is cut at MAX_MESSAGE_CHARS whatever it holds.
"""

from __future__ import annotations

import re
from typing import Any

# "SamplingParams.temperature=-1: ..." (kvcore/request.py) or "body.top_p ..." (our own checks).
_FIELD_IN_MESSAGE = re.compile(r"(?:SamplingParams|body)\.(\w+)")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    503: "service_unavailable_error",
    500: "server_error",
}
MAX_MESSAGE_CHARS = 2000
CLIP_CHARS = 80


def clip(value: object, limit: int = CLIP_CHARS) -> str:
    """repr(value) for a message, at most `limit` characters (plus how long it was): a 1 MB model name
    must not come back in a 1 MB error. repr escapes what cannot be encoded (a lone surrogate)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param if param is not None else field_of(message)
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    if len(message) > MAX_MESSAGE_CHARS:
        message = f"{message[:MAX_MESSAGE_CHARS]}... (message cut at {MAX_MESSAGE_CHARS} characters)"
    # Text from the request may hold a lone surrogate, which no response can encode: escape it.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if param is not None:  # a field name, but an unknown one comes from the request
        param = param[:CLIP_CHARS].encode("utf-8", "backslashreplace").decode("utf-8")
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code if code is not None else str(status),
        }
    }


def field_of(message: str) -> str | None:
    """The request field a validation message names, if it names one."""
    m = _FIELD_IN_MESSAGE.search(message)
    return m.group(1) if m else None


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def overloaded(message: str, retry_after_s: int) -> APIError:
    return APIError(503, message, code="overloaded", retry_after_s=retry_after_s)
