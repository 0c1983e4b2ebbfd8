"""The OpenAI-compatible HTTP ingress: a Ray Serve deployment with FastAPI routes.

One ingress replica holds the engine replicas (EngineGroup's driver actors, one per data-parallel
replica; placement from the config, as for `kvray run`) and the client path of LLM.generate / chat
(tokenizer, chat template, default sampling settings, output processing). Routes:
  POST /v1/completions, POST /v1/chat/completions   (stream or not)
  GET  /v1/models, /health, /metrics
Errors are OpenAI-shaped JSON; a bad request fails alone and the server goes on.
"""
# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request) at run time.

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.client.chat import ChatTemplateError, as_conversations, render_chat, resolve_chat_template, special_tokens
from cluster.client.sampling_defaults import default_sampling_params
from cluster.config import DEFAULT_WORKER_CLS, EngineConfig
from cluster.llm import check_client_model, client_model_dir, load_client_model
from cluster.serve.engine_client import AsyncEngineClient, Overloaded, Unavailable
from cluster.serve.errors import APIError, bad_request, error_body, overloaded
from cluster.serve.generation import Generation
from cluster.serve.metrics import ServerMetrics
from cluster.serve.protocol import CHAT, COMPLETIONS, ParsedRequest, parse_request
from cluster.serve.responses import DONE, ChunkWriter, full_response, sse

logger = logging.getLogger(__name__)

# FastAPI's own OpenTelemetry hooks look their providers up on every request; Serve traces on its own.
app = FastAPI(
    title="kvray", docs_url=None, redoc_url=None, telemetry={"tracing": False, "metrics": False, "logs": False}
)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # An unknown route or method: OpenAI-shaped too.
    return JSONResponse(
        error_body(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"), status_code=exc.status_code
    )


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("%s %s: unexpected error", request.method, request.url.path)
    return JSONResponse(error_body(500, f"{type(exc).__name__}: {exc}"), status_code=500)


# Decorated where it is defined: a Serve replica imports this module (the class travels by reference),
# and must find the routes already bound to the class.
@serve.ingress(app)
class OpenAIServer:
    """The ingress deployment's class (cluster/serve/app.py wraps it with serve.deployment)."""

    def __init__(self, config: EngineConfig, worker_cls: str = DEFAULT_WORKER_CLS) -> None:
        self.tokenizer, hf_config = load_client_model(config)
        self.model_dir = client_model_dir(config) if hf_config is not None else None
        self.defaults = default_sampling_params(self.model_dir)
        if hf_config is not None:
            check_client_model(config, hf_config)
        self.client = AsyncEngineClient(config, worker_cls)
        self.config = self.client.config
        self.model_name = config.serve.served_model_name or config.model.model
        self.max_model_len = int(self.client.info["max_model_len"])
        self.server_metrics = ServerMetrics()
        self.created = int(time.time())

    # ---- routes -----------------------------------------------------------------------------
    @app.post(COMPLETIONS)
    async def completions(self, request: Request) -> Response:
        return await self._answer(COMPLETIONS, request)

    @app.post(CHAT)
    async def chat_completions(self, request: Request) -> Response:
        return await self._answer(CHAT, request)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "kvray",
                    "max_model_len": self.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health(self) -> Response:
        if self.client.healthy():
            return Response(status_code=200)
        return JSONResponse(error_body(503, "every engine replica is down"), status_code=503)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        stats = await self.client.engine_stats()
        return Response(
            self.server_metrics.render(self.client.books, stats), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    # ---- one request ------------------------------------------------------------------------
    async def _answer(self, endpoint: str, request: Request) -> Response:
        try:
            gen, req = await self._start(endpoint, request)
        except APIError as e:
            return self._error(endpoint, e)
        except Exception as e:  # noqa: BLE001 - one request's bug must not look like a crash
            logger.exception("%s: unexpected error", endpoint)
            return self._error(endpoint, APIError(500, f"{type(e).__name__}: {e}"))
        if req.stream:
            self.server_metrics.requests.labels(endpoint, "200").inc()
            return StreamingResponse(self._stream(gen, req), media_type="text/event-stream")
        try:
            return await self._whole(gen, req)
        except asyncio.CancelledError:
            self.server_metrics.disconnects.inc()
            raise
        finally:
            gen.close()

    async def _start(self, endpoint: str, request: Request) -> tuple[Generation, ParsedRequest]:
        try:
            body = await request.json()
        except ValueError as e:
            raise bad_request(f"the request body is not valid JSON: {e}") from None
        req = parse_request(endpoint, body, self.defaults)
        if req.model is not None and req.model != self.model_name:
            raise APIError(
                404,
                f"The model `{req.model}` does not exist; this server serves {self.model_name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        text, ids = self._encode(req)
        if len(ids) >= self.max_model_len:
            raise bad_request(
                f"the prompt has {len(ids)} tokens: it must be shorter than max_model_len={self.max_model_len}",
                param="messages" if req.chat else "prompt",
            )
        if req.chat and not req.max_tokens_given:
            req.params = _with_max_tokens(req.params, self.max_model_len - len(ids))
        prefix = "chatcmpl-" if req.chat else "cmpl-"
        gen = Generation(
            self.client,
            self.tokenizer,
            prefix + uuid.uuid4().hex,
            text,
            ids,
            req.params,
            self.config.serve.stream_interval if req.stream else 1,
            self.config.serve.stream_batching_ms / 1e3 if req.stream else 0.0,
        )
        try:
            await gen.start()
        except Overloaded as e:
            self.server_metrics.rejected.inc()
            raise overloaded(str(e), self.config.serve.retry_after_s) from None
        except Unavailable as e:
            raise APIError(503, str(e), code="engine_down", retry_after_s=self.config.serve.retry_after_s) from None
        except asyncio.CancelledError:  # the client left while the driver took the request
            gen.close()
            raise
        return gen, req

    def _encode(self, req: ParsedRequest) -> tuple[str | None, list[int]]:
        if req.prompt_token_ids is not None:
            return None, req.prompt_token_ids
        if self.tokenizer is None:
            raise bad_request("text prompts need the model's tokenizer.json on the server; send token ids")
        if not req.chat:
            assert req.prompt is not None  # parse_request gives a text or token ids
            return req.prompt, self.tokenizer.encode(req.prompt)
        try:
            template = resolve_chat_template(self.tokenizer.model_dir, None)
            tokens = special_tokens(self.tokenizer.model_dir) if self.tokenizer.model_dir else {}
            convs, _ = as_conversations(req.messages)
            text = render_chat(
                convs[0],
                template,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tokens=tokens,
            )
        except ChatTemplateError as e:
            raise bad_request(str(e), param="messages") from None
        # The template placed the special tokens itself (as LLM.chat tokenizes).
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    async def _whole(self, gen: Generation, req: ParsedRequest) -> Response:
        out = await gen.result()
        self._observe(gen)
        errors = [c for c in gen.parent.children if c.error is not None]
        if errors:
            msg = str(errors[0].error)
            status = 400 if "rejected:" in msg and not any(c.completion.token_ids for c in gen.parent.children) else 500
            return self._error(req.endpoint, APIError(status, msg))
        self.server_metrics.requests.labels(req.endpoint, "200").inc()
        return JSONResponse(full_response(gen.request_id, self.model_name, out, req.chat, req.return_token_ids))

    async def _stream(self, gen: Generation, req: ParsedRequest) -> AsyncIterator[str]:
        writer = ChunkWriter(
            gen.request_id, self.model_name, req.chat, len(gen.specs), req.include_usage, req.return_token_ids
        )
        try:
            async for deltas in gen.deltas():
                failed = [d for d in deltas if d.error is not None]
                if failed:  # an engine failure ends the stream with one clean error event
                    yield sse(error_body(500, str(failed[0].error)))
                    break
                chunk = writer.deltas(deltas)
                if chunk is not None:
                    yield chunk
            else:
                if req.include_usage:
                    yield writer.usage(gen.num_prompt_tokens, gen.num_output_tokens)
            self._observe(gen)
            yield DONE
        except asyncio.CancelledError:
            self.server_metrics.disconnects.inc()
            raise
        finally:
            gen.close()

    def _observe(self, gen: Generation) -> None:
        self.server_metrics.output_tokens.inc(gen.num_output_tokens)
        if gen.first_token_at is not None:
            self.server_metrics.ttft.observe(gen.first_token_at - gen.arrival)
        self.server_metrics.e2e.observe(time.monotonic() - gen.arrival)

    def _error(self, endpoint: str, e: APIError) -> JSONResponse:
        self.server_metrics.requests.labels(endpoint, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers())

    def __del__(self) -> None:
        # Serve calls this on a graceful shutdown: the engine replicas go with the ingress.
        client = getattr(self, "client", None)
        if client is not None:
            try:
                client.shutdown()
            except Exception as e:  # noqa: BLE001 - Ray may be going down already
                logger.debug("engine shutdown: %s", e)


def _with_max_tokens(params: Any, max_tokens: int) -> Any:
    from dataclasses import replace

    return replace(params, max_tokens=max(1, max_tokens))
