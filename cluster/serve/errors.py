"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

Every failure a route can meet becomes one of these (a bad field 400, an unknown model 404, a full
engine 503 with Retry-After, an engine failure 500): a client never sees a bare traceback.
"""

from __future__ import annotations

import re
from typing import Any

# "SamplingParams.temperature=-1: ..." (kvcore/request.py) or "body.top_p ..." (our own checks).
_FIELD_IN_MESSAGE = re.compile(r"(?:SamplingParams|body)\.(\w+)")

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable_error", 500: "server_error"}


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
