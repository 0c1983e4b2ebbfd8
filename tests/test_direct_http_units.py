"""serve.http=direct without Ray: the config rule, the build that needs an address, and CancelOnDisconnect
(a client that leaves cancels its route once the body is read; one that leaves after the answer cancels
nothing; the app's later receive() sees the disconnect; the server's own cancel still propagates)."""

import asyncio

import pytest

from actors.config.section import ConfigError
from cluster.config import load_config
from cluster.serve.direct_http import CancelOnDisconnect, reuse_port_socket

SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}


def test_serve_http_is_proxy_or_direct():
    assert load_config("configs/local.yaml").serve.http == "proxy"
    assert load_config("configs/local.yaml", {"serve.http": "direct"}).serve.http == "direct"
    with pytest.raises(ConfigError, match=r"serve.http='grpc': must be one of 'proxy', 'direct'"):
        load_config("configs/local.yaml", {"serve.http": "grpc"})


def test_direct_without_an_address_is_refused_naming_kvray_serve():
    from cluster.serve.app import build_app

    with pytest.raises(ValueError, match=r"serve.http='direct'.*kvray serve --host H --port P"):
        build_app({"config": "configs/local.yaml", "set": "serve.http=direct"})


class _Connection:
    """uvicorn's side of one request: the body, then (when the test says) the client leaving."""

    def __init__(self) -> None:
        self.left = asyncio.Event()
        self.sent: list[dict] = []
        self.body_given = False

    async def receive(self) -> dict:
        if not self.body_given:
            self.body_given = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)


def _run(app, conn: _Connection, leave_after_s: float | None):
    async def go():
        task = asyncio.ensure_future(CancelOnDisconnect(app)(SCOPE, conn.receive, conn.send))
        if leave_after_s is not None:
            await asyncio.sleep(leave_after_s)
            conn.left.set()
        await asyncio.wait_for(task, 10)
        return task

    return asyncio.run(go())


def test_a_client_leaving_after_its_body_cancels_the_route():
    seen = {}

    async def slow_whole(scope, receive, send):
        await receive()
        try:
            await asyncio.sleep(30)  # a whole answer the engine is still producing
        except asyncio.CancelledError:
            seen["cancelled"] = True
            raise

    conn = _Connection()
    task = _run(slow_whole, conn, leave_after_s=0.05)
    assert seen == {"cancelled": True} and not task.cancelled() and conn.sent == []


def test_a_streamed_route_sees_the_disconnect_through_its_own_receive():
    seen = {}

    async def streaming(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})

        async def listen():
            seen["listened"] = (await receive())["type"]

        listener = asyncio.ensure_future(listen())
        try:
            while True:
                await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            seen["cancelled"] = True
            await asyncio.sleep(0)
            raise
        finally:
            await asyncio.wait_for(listener, 5)

    _run(streaming, _Connection(), leave_after_s=0.1)
    assert seen == {"cancelled": True, "listened": "http.disconnect"}


def test_leaving_after_the_answer_cancels_nothing():
    seen = {"after": False}

    async def answers_then_works(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})
        await asyncio.sleep(0.2)  # the client closes meanwhile: its answer is complete
        seen["after"] = True

    conn = _Connection()
    _run(answers_then_works, conn, leave_after_s=0.05)
    assert seen["after"] and conn.sent[-1]["more_body"] is False


def test_the_servers_own_cancel_still_propagates():
    async def go():
        conn = _Connection()

        async def slow(scope, receive, send):
            await receive()
            await asyncio.sleep(30)

        task = asyncio.ensure_future(CancelOnDisconnect(slow)(SCOPE, conn.receive, conn.send))
        await asyncio.sleep(0.05)
        task.cancel()  # the server going down, the client still there
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())


def test_two_sockets_share_one_port():
    a = reuse_port_socket("127.0.0.1", 0)
    try:
        port = a.getsockname()[1]
        b = reuse_port_socket("127.0.0.1", port)
        b.close()
    finally:
        a.close()


def test_the_server_leaves_the_processes_signal_handlers_alone():
    """On the main thread (a Serve replica with serve.single_event_loop) uvicorn would take SIGINT and SIGTERM
    from Ray and Serve for as long as it serves."""
    import signal

    from cluster.serve.direct_http import DirectHTTPServer

    async def app(scope, receive, send):
        pass

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    server = DirectHTTPServer(app, "127.0.0.1", 0).server
    with server.capture_signals():
        assert {s: signal.getsignal(s) for s in before} == before
