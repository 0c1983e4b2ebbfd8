"""The OpenAI-compatible HTTP ingress: a Ray Serve deployment with FastAPI routes.

serve.ingress_replicas of them share the engine replicas (cluster/serve/engine_replica.py, found through the
fleet, cluster/serve/fleet.py); each holds the client path of LLM.generate / chat (tokenizer, chat
template, default sampling settings, output processing) and its own engine client (its own outbox in
every driver, its own KV index for routing). Routes:
  POST /v1/completions, POST /v1/chat/completions   (stream or not)
  GET  /v1/models, /health, /metrics
Errors are OpenAI-shaped JSON; a bad request fails alone and the server goes on. Before its body is
parsed a request passes cluster/serve/http_guard.py (API key, JSON media type, size).

Every name the class's methods use must be defined ABOVE the class: @serve.ingress pickles the app, and
with it the routes' functions by value, while this module is still being imported, so a helper defined
below the class is missing from their globals in the Serve replica (a NameError there, at run time).
"""
# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request) at run time.

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.client.sampling_defaults import default_sampling_params
from cluster.config import EngineConfig
from cluster.llm import check_client_model, client_model_dir, load_client_model
from cluster.serve.direct_http import DirectHTTPServer
from cluster.serve.engine_client import AsyncEngineClient, Overloaded, Unavailable
from cluster.serve.errors import APIError, bad_request, clip, error_body, overloaded
from cluster.serve.fleet import FleetView
from cluster.serve.generation import ChoiceDelta, Generation
from cluster.serve.http_guard import check_api_key, check_media_type, decode_json, read_body
from cluster.serve.loopback import bind_internal_grpc_to_loopback
from cluster.serve.metrics import ServerMetrics
from cluster.serve.prompts import PromptEncoder
from cluster.serve.protocol import CHAT, COMPLETIONS, ParsedRequest, parse_request
from cluster.serve.responses import DONE, ChunkWriter, full_response, sse
from kvcore.request import check_token_ids

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


FIRST_REPLICA_BOUND_S = 3 * 600.0 + 60.0  # an engine replica's start is bounded like EngineGroup's


async def _first_view(fleet: Any, bound_s: float) -> FleetView:
    """The fleet's live set once an engine replica is up in it (they start beside this ingress)."""
    deadline = time.monotonic() + bound_s
    view: FleetView = await fleet.view.remote()
    while not view.members:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"no engine replica joined the fleet within {bound_s:g}s")
        view = await fleet.view.remote(view.version, min(left, 5.0))
    return view


def _with_max_tokens(params: Any, max_tokens: int) -> Any:
    return dataclasses.replace(params, max_tokens=max(1, max_tokens))


def _close_all(gens: list[Generation]) -> None:
    for gen in gens:
        gen.close()


async def _merged(gens: list[Generation]) -> AsyncIterator[list[ChoiceDelta]]:
    """The deltas of a batch's generations as they come, choice indices offset per prompt (i * n + k)."""
    if len(gens) == 1:
        async for deltas in gens[0].deltas():
            yield deltas
        return
    queue: asyncio.Queue[list[ChoiceDelta] | Exception | None] = asyncio.Queue()

    async def pump(offset: int, gen: Generation) -> None:
        try:
            async for deltas in gen.deltas():
                queue.put_nowait([dataclasses.replace(d, index=d.index + offset) for d in deltas])
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait(e)
            return
        queue.put_nowait(None)

    offsets = [sum(len(g.specs) for g in gens[:k]) for k in range(len(gens))]
    tasks = [asyncio.ensure_future(pump(o, g)) for o, g in zip(offsets, gens, strict=True)]
    try:
        ended = 0
        while ended < len(tasks):
            item = await queue.get()
            if item is None:
                ended += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


# Decorated where it is defined: a Serve replica imports this module (the class travels by reference),
# and must find the routes already bound to the class. Nothing may follow the class (module docstring).
@serve.ingress(app)
class OpenAIServer:
    """The ingress deployment's class (cluster/serve/app.py wraps it with serve.deployment)."""

    # Ray Serve awaits an async constructor (it waits for the first engine replica); mypy wants it sync.
    async def __init__(  # type: ignore[misc]
        self,
        config: EngineConfig,
        fleet: Any,
        api_key: str | None = None,
        loopback_only: bool = False,
        engines: Any = None,
        direct_http: tuple[str, int] | None = None,
    ) -> None:
        """`fleet`: the fleet's handle; `engines`: the engine replicas' deployment handle, held only so
        that the application graph deploys them (nothing reaches them through Serve); `direct_http`:
        (host, port) this replica answers HTTP on itself (serve.http=direct), else Serve's proxy does."""
        if loopback_only:
            bind_internal_grpc_to_loopback()  # before Serve starts this replica's gRPC server
        self.api_key = api_key
        self.tokenizer, hf_config = load_client_model(config)
        self.model_dir = client_model_dir(config) if hf_config is not None else None
        self.defaults = default_sampling_params(self.model_dir)
        if hf_config is not None:
            check_client_model(config, hf_config)
        self.engines = engines
        view = await _first_view(fleet, max(FIRST_REPLICA_BOUND_S, 3 * config.parallel.step_timeout_s + 60.0))
        self.client = AsyncEngineClient(config, view.members[0].info, fleet=fleet)
        self.client.sync(view)
        self.config = config
        self.model_name = config.serve.served_model_name or config.model.model
        self.max_model_len = int(self.client.info["max_model_len"])
        vocab = self.client.info.get("vocab_size")
        self.vocab_size = int(vocab) if vocab else None
        self.prompts = PromptEncoder(self.tokenizer, self.max_model_len)
        # What one replica can ever hold (scheduler.max_num_seqs + serve.max_queued_requests): an n past
        # it could never be admitted, so it is a 400, not a 503 to retry.
        self.replica_capacity = self.config.scheduler.max_num_seqs + self.config.serve.max_queued_requests
        self.server_metrics = ServerMetrics()
        self.created = int(time.time())
        self.direct: DirectHTTPServer | None = None
        if direct_http is not None:
            # The routes find `self` as Serve's current replica object, set once this constructor returns.
            self.direct = DirectHTTPServer(app, *direct_http)
            self.direct.start_when(lambda: serve.get_replica_context().servable_object is self)

    # ---- routes -----------------------------------------------------------------------------
    @app.post(COMPLETIONS)
    async def completions(self, request: Request) -> Response:
        return await self._answer(COMPLETIONS, request)

    @app.post(CHAT)
    async def chat_completions(self, request: Request) -> Response:
        return await self._answer(CHAT, request)

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            check_api_key(request.headers, self.api_key)
        except APIError as e:
            return self._error("/v1/models", e)
        return JSONResponse(
            {
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
        )

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
            response_id, gens, req = await self._start(endpoint, request)
        except APIError as e:
            return self._error(endpoint, e)
        except RecursionError:  # a body nested just below the parser's limit, too deep for a check after it
            return self._error(endpoint, bad_request("the request body is nested too deeply"))
        except Exception as e:  # one request's bug must not look like a crash
            logger.exception("%s: unexpected error", endpoint)
            return self._error(endpoint, APIError(500, f"{type(e).__name__}: {e}"))
        if req.stream:
            self.server_metrics.requests.labels(endpoint, "200").inc()
            return StreamingResponse(self._stream(response_id, gens, req), media_type="text/event-stream")
        try:
            return await self._whole(response_id, gens, req)
        except asyncio.CancelledError:
            self.server_metrics.disconnects.inc()
            raise
        finally:
            for gen in gens:
                gen.close()

    async def _start(self, endpoint: str, request: Request) -> tuple[str, list[Generation], ParsedRequest]:
        """-> (the response's id, one generation per prompt, the request); raises APIError."""
        check_api_key(request.headers, self.api_key)
        check_media_type(request.headers)
        raw = await read_body(request.headers, request.stream(), self.config.serve.max_request_body_bytes)
        req = parse_request(endpoint, decode_json(raw), self.defaults)
        if req.model is not None and req.model != self.model_name:
            raise APIError(
                404,
                f"The model {clip(req.model)} does not exist; this server serves {self.model_name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        self._check_fits(req)
        encoded = await self.prompts.encode(req)
        prefix = "chatcmpl-" if req.chat else "cmpl-"
        request_id = prefix + uuid.uuid4().hex
        gens: list[Generation] = []
        try:
            for k, (text, ids) in enumerate(encoded):
                params = req.params
                if req.chat and not req.max_tokens_given:
                    params = _with_max_tokens(params, self.max_model_len - len(ids))
                gen = Generation(
                    self.client,
                    self.tokenizer,
                    request_id if len(encoded) == 1 else f"{request_id}-{k}",
                    text,
                    ids,
                    params,
                    self.config.serve.stream_interval if req.stream else 1,
                    self.config.serve.stream_batching_ms / 1e3 if req.stream else 0.0,
                )
                gens.append(gen)
                await gen.start()
        except Overloaded as e:
            self.server_metrics.rejected.inc()
            _close_all(gens)
            raise overloaded(str(e), self.config.serve.retry_after_s) from None
        except Unavailable as e:
            _close_all(gens)
            raise APIError(503, str(e), code="engine_down", retry_after_s=self.config.serve.retry_after_s) from None
        except BaseException:  # a refusal (APIError), or the client left while the driver took the request
            _close_all(gens)
            raise
        return request_id, gens, req

    def _check_fits(self, req: ParsedRequest) -> None:
        """What no retry could ever admit is a 400 naming the field, not a 503."""
        n = req.params.n
        if n > self.replica_capacity:
            raise bad_request(
                f"body.n={n}: more samples than one engine replica can ever hold ({self.replica_capacity} = "
                f"scheduler.max_num_seqs {self.config.scheduler.max_num_seqs} + serve.max_queued_requests "
                f"{self.config.serve.max_queued_requests})",
                param="n",
            )
        total = req.num_prompts * n
        a = self.config.serve.autoscaling
        most = a.max_replicas if a is not None else self.config.parallel.data_parallel_size
        everything = self.replica_capacity * most
        if total > everything:
            raise bad_request(
                f"body.prompt: {req.num_prompts} prompts x n={n} = {total} engine requests, more than every "
                f"replica together can ever hold ({everything})",
                param="prompt",
            )
        err = check_token_ids("body.stop_token_ids", list(req.params.stop_token_ids), self.vocab_size)
        if err is not None:
            raise bad_request(err, param="stop_token_ids")

    async def _whole(self, response_id: str, gens: list[Generation], req: ParsedRequest) -> Response:
        outs = [await gen.result() for gen in gens]
        for gen in gens:
            self._observe(gen)
        children = [c for gen in gens for c in gen.parent.children]
        errors = [c for c in children if c.error is not None]
        if errors:
            msg = str(errors[0].error)
            status = 400 if "rejected:" in msg and not any(c.completion.token_ids for c in children) else 500
            return self._error(req.endpoint, APIError(status, msg))
        self.server_metrics.requests.labels(req.endpoint, "200").inc()
        return JSONResponse(full_response(response_id, self.model_name, outs, req.chat, req.return_token_ids))

    async def _stream(self, response_id: str, gens: list[Generation], req: ParsedRequest) -> AsyncIterator[str]:
        writer = ChunkWriter(
            response_id,
            self.model_name,
            req.chat,
            sum(len(g.specs) for g in gens),
            req.include_usage,
            req.return_token_ids,
        )
        try:
            async for deltas in _merged(gens):
                failed = [d for d in deltas if d.error is not None]
                if failed:  # an engine failure ends the stream with one clean error event
                    yield sse(error_body(500, str(failed[0].error)))
                    break
                chunk = writer.deltas(deltas)
                if chunk is not None:
                    yield chunk
            else:
                if req.include_usage:
                    yield writer.usage(sum(g.num_prompt_tokens for g in gens), sum(g.num_output_tokens for g in gens))
            for gen in gens:
                self._observe(gen)
            yield DONE
        except asyncio.CancelledError:
            self.server_metrics.disconnects.inc()
            raise
        finally:
            for gen in gens:
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
        # Serve calls this on a graceful shutdown: this ingress's tasks end; the engine replicas stay.
        direct = getattr(self, "direct", None)
        if direct is not None:
            direct.stop()
        client = getattr(self, "client", None)
        if client is not None:
            try:
                client.shutdown()
            except Exception as e:  # noqa: BLE001 - Ray may be going down already
                logger.debug("engine shutdown: %s", e)
