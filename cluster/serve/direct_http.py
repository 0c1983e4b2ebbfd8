"""serve.http=direct: each ingress replica answers HTTP itself, with no Ray Serve proxy in between.

Behind Serve's proxy every request and every streamed chunk crosses one more process (the proxy, an
actor call per request and a streaming generator per response), and the proxy is one process per
node: at saturation it is the first to run out of its one core, more ingress replicas or not
(benchmarks/RESULTS.md). vLLM's API servers share one listening port instead (`--api-server-count`);
so do these: every ingress replica binds host:port with SO_REUSEPORT and the kernel spreads the
connections over the replicas of that node. Serve still runs the deployments (placement, health
checks, replacement); only its proxy is off.

Two things the proxy did are done here:
  - a client that goes away cancels its request (the proxy cancels the replica's call): Starlette
    notices it for a streamed response only, so `CancelOnDisconnect` watches the connection of every
    request whose body has been read, and cancels the route when the client leaves;
  - the server starts only once Serve has made this replica's object current, which the routes
    resolve `self` from (ray.serve's class-based views): a connection before that would fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any, Awaitable, Callable, Iterator

import uvicorn

logger = logging.getLogger(__name__)

KEEP_ALIVE_S = 90  # Ray Serve's proxy keeps idle connections as long (DEFAULT_UVICORN_KEEP_ALIVE_TIMEOUT_S)
READY_BOUND_S = 60.0  # how long the server waits for Serve to make the replica current

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]


class CancelOnDisconnect:
    """ASGI middleware: once a request's body has been read, a disconnect cancels the route.

    It alone reads the connection after the body; the app's later receive() calls wait for the
    disconnect it saw (a StreamingResponse listens for exactly that)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gone = asyncio.Event()
        route = asyncio.current_task()
        watcher: asyncio.Task[None] | None = None
        answered = False  # the response's last byte went out: a disconnect after it is the normal end
        cancelled = False  # this middleware cancelled the route

        async def watch() -> None:
            nonlocal cancelled
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            if not answered and route is not None:
                cancelled = True
                route.cancel()

        async def app_receive() -> Message:
            nonlocal watcher
            if watcher is not None or gone.is_set():
                await gone.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif not message.get("more_body", False):
                watcher = asyncio.get_running_loop().create_task(watch())
            return message

        async def app_send(message: Message) -> None:
            nonlocal answered
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True

        try:
            await self.app(scope, app_receive, app_send)
        except asyncio.CancelledError:
            if not cancelled:
                raise  # not the client's leaving: the server going down
            # The client left: nobody is there to answer; the route's own handlers counted it.
        finally:
            if watcher is not None:
                watcher.cancel()
            if cancelled and route is not None:
                route.uncancel()


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that the node's other ingress replicas share (SO_REUSEPORT)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn takes SIGINT and SIGTERM when it runs on the main thread (a Serve replica's user code may):
        # they are Ray's and Serve's, which stop the replica; this server stops with it.
        yield


class DirectHTTPServer:
    """One ingress replica's own HTTP server on host:port (shared with its siblings on the node)."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        """app: the ingress's ASGI app (FastAPI)."""
        self.host, self.port = host, port
        config = uvicorn.Config(
            CancelOnDisconnect(app),
            lifespan="off",
            access_log=False,
            log_config=None,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        self.server = _Server(config)
        self.task: asyncio.Task[None] | None = None  # held: the loop keeps only a weak reference to a task

    def start_when(self, ready: Callable[[], bool]) -> None:
        """Start serving on the running loop once ready() holds (checked every 10 ms, bounded)."""
        self.task = asyncio.get_running_loop().create_task(self._serve_when(ready))

    async def _serve_when(self, ready: Callable[[], bool]) -> None:
        deadline = asyncio.get_running_loop().time() + READY_BOUND_S
        while not ready():
            if asyncio.get_running_loop().time() > deadline:
                logger.error("serve.http=direct: the replica never became current; not serving %s", self.url)
                return
            await asyncio.sleep(0.01)
        try:
            sock = reuse_port_socket(self.host, self.port)
        except OSError as e:  # taken since `kvray serve` checked it, by a server that does not share it
            logger.error("serve.http=direct: cannot listen on %s: %s", self.url, e)
            return
        logger.info("serve.http=direct: serving %s", self.url)
        await self.server.serve(sockets=[sock])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        """Stop accepting: uvicorn closes the listening socket within its next tick (0.1 s) and lets the
        connections in flight finish, until Serve's graceful shutdown timeout ends the process."""
        self.server.should_exit = True
