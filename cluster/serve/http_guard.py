"""What an HTTP request must pass before its body is parsed: the API key, the media type, the body's size, JSON.

- The API key (vLLM's --api-key): serve.api_key, else the KVRAY_API_KEY environment variable of the process
  that builds the app; when set, every /v1 route wants `Authorization: Bearer <key>` (401 otherwise).
  /health and /metrics stay open, as in vLLM.
- Only `application/json` bodies (415 otherwise, a missing Content-Type included): a web page can send
  text/plain, a form or multipart to a local server from a visitor's browser without asking (no CORS
  preflight), but never application/json.
- At most serve.max_request_body_bytes (413): a declared Content-Length past it is refused before a byte
  is read, and a body without one (chunked) is refused as soon as it grows past it, never held whole.
- JSON that does not parse, is not UTF-8, or nests too deeply for the parser is a 400, never a 500.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Any, AsyncIterator, Mapping

from cluster.serve.errors import APIError, bad_request

API_KEY_ENV = "KVRAY_API_KEY"  # vLLM's is VLLM_API_KEY
JSON_MEDIA_TYPE = "application/json"


def resolve_api_key(configured: str | None) -> str | None:
    """The key the server demands: the config's, else the environment's, else none (an open server)."""
    if configured:
        return configured
    return os.environ.get(API_KEY_ENV) or None


def check_api_key(headers: Mapping[str, str], key: str | None) -> None:
    if key is None:
        return
    scheme, _, token = headers.get("authorization", "").partition(" ")
    # compare_digest: the time taken does not tell how much of a guess was right.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(
            401,
            "a valid API key is required: send the header `Authorization: Bearer <key>` "
            f"(the key is serve.api_key or ${API_KEY_ENV} where the server started)",
            code="invalid_api_key",
        )


def check_media_type(headers: Mapping[str, str]) -> None:
    content_type = headers.get("content-type")
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != JSON_MEDIA_TYPE:
        shown = "none" if content_type is None else repr(content_type[:80])
        raise APIError(415, f"the request body must be JSON with Content-Type: {JSON_MEDIA_TYPE} (got {shown})")


async def read_body(headers: Mapping[str, str], chunks: AsyncIterator[bytes], limit: int) -> bytes:
    """The whole body, at most `limit` bytes, else 413 (read no further than the limit)."""
    declared = headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise bad_request(f"Content-Length={declared[:40]!r}: must be an integer") from None
        if size > limit:
            raise _too_large(f"{size:,} bytes", limit)
    parts, total = [], 0
    async for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise _too_large(f"more than {limit:,} bytes", limit)
        parts.append(chunk)
    return b"".join(parts)


def _too_large(size: str, limit: int) -> APIError:
    return APIError(
        413,
        f"the request body has {size}: at most {limit:,} (serve.max_request_body_bytes) are accepted",
        code="request_too_large",
    )


def decode_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        raise bad_request("the request body is nested too deeply to parse") from None
    except ValueError as e:  # bad JSON, and bad UTF-8 (UnicodeDecodeError is a ValueError)
        raise bad_request(f"the request body is not valid JSON: {str(e)[:200]}") from None
