"""`kvray serve` with two ingress replicas sharing two engine replicas (serve.ingress_replicas=2 over
parallel.data_parallel_size=2; local Ray, 127.0.0.1 only, CPU replicas of tiny-random): the engine
replicas live in their own deployment and register with the fleet, every ingress finds them there and
polls each driver through its own outbox. Concurrent `openai` streams through Serve's proxy (spread over
both ingresses) all complete with exactly the tokens of a run one at a time; /metrics shows the
replicas up; a whole answer whose client left is aborted; a replica whose driver died is replaced by
Ray Serve (its health check) and the new one serves. Each runs with serve.http=proxy (Serve's proxy in
front) and serve.http=direct (the two ingress replicas share the port themselves, no proxy)."""

import asyncio
import json
import re
import socket
import time

import openai
import pytest
import ray
import requests

from tests.serve_helpers import SERVE_OVERRIDES, drivers, running_server

pytestmark = pytest.mark.timeout(600)
MODEL = "tiny-random"
N_STREAMS = 24

OVERRIDES = {
    **SERVE_OVERRIDES,
    "serve.ingress_replicas": 2,
    "scheduler.max_num_seqs": 16,
    "serve.max_queued_requests": 16,
    # The replaced-replica test waits out 3 failed checks: 2 s periods keep that wait short.
    "serve.health_check_period_s": 2.0,
}


@pytest.fixture(scope="module", params=["proxy", "direct"])
def server(request):
    with running_server({**OVERRIDES, "serve.http": request.param}) as url:
        yield url


def _request(i: int) -> dict:
    body = {
        "model": MODEL,
        "prompt": f"stream {i}: " + "abc " * (i % 5 + 1),
        "max_tokens": 16 + i % 7,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    if i % 2:
        body.update(temperature=0.9, top_p=0.9, seed=100 + i)
    else:
        body.update(temperature=0)
    return body


async def _stream(c: openai.AsyncOpenAI, body: dict) -> dict:
    out = {"text": "", "ids": [], "finish": None}
    async for ch in await c.completions.create(stream=True, **body):
        for choice in ch.choices:
            out["text"] += choice.text or ""
            out["ids"] += getattr(choice, "token_ids", None) or []
            out["finish"] = choice.finish_reason or out["finish"]
    return out


async def _whole(c: openai.AsyncOpenAI, body: dict) -> dict:
    r = await c.completions.create(**body)
    return {"text": r.choices[0].text, "ids": r.choices[0].token_ids, "finish": r.choices[0].finish_reason}


def test_two_ingress_replicas_stream_over_shared_engine_replicas_token_exact(server):
    async def run():
        c = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)
        try:
            streamed = await asyncio.gather(*(_stream(c, _request(i)) for i in range(N_STREAMS)))
            reference = [await _whole(c, _request(i)) for i in range(N_STREAMS)]  # one at a time
            return streamed, reference
        finally:
            await c.close()

    streamed, reference = asyncio.run(run())
    assert streamed == reference
    assert all(s["finish"] == "length" and s["ids"] for s in streamed)
    stats = [ray.get(d.stats.remote(), timeout=30) for d in drivers()]
    assert len(stats) == 2 and all(s["fatal"] is None for s in stats), stats
    # Both ingress replicas took requests and polled both drivers, each through its own outbox.
    assert all(s["num_clients"] == 2 for s in stats), stats
    assert all(s["num_output_tokens"] > 0 for s in stats), stats


def test_metrics_show_the_engine_replicas_up(server):
    text = requests.get(server + "/metrics", timeout=60).text
    assert re.search(r'^kvray_serve_replicas\{state="up"\} 2\.0$', text, re.M), text
    assert re.search(r'^kvray_serve_replicas\{state="draining"\} 0\.0$', text, re.M), text
    assert requests.get(server + "/health", timeout=30).status_code == 200


def test_the_proxy_runs_only_with_serve_http_proxy(server, request):
    proxies = [a for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_PROXY_ACTOR" in a["name"]]
    assert bool(proxies) == (request.node.callspec.params["server"] == "proxy"), proxies


def test_a_whole_answer_whose_client_left_is_aborted(server):
    """No stream: Starlette alone would finish it for nobody. The client closes its connection once the
    engine runs the request; the request leaves every driver long before its max_tokens."""
    max_tokens = 200
    body = json.dumps(
        {"model": MODEL, "prompt": "a long answer", "max_tokens": max_tokens, "ignore_eos": True}
    ).encode()
    host, port = server.removeprefix("http://").split(":")

    def live_and_tokens() -> tuple[int, int]:
        stats = [ray.get(d.stats.remote(), timeout=30) for d in drivers()]
        return sum(s["num_live_requests"] for s in stats), sum(s["num_output_tokens"] for s in stats)

    before = live_and_tokens()[1]
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 60
        while live_and_tokens()[0] == 0:
            assert time.monotonic() < deadline, "the request never reached an engine replica"
            time.sleep(0.02)
    deadline = time.monotonic() + 60
    while (now := live_and_tokens())[0] > 0:
        assert time.monotonic() < deadline, f"still running 60 s after its client left: {now}"
        time.sleep(0.1)
    assert now[1] - before < max_tokens, (before, now)


def test_a_replica_whose_driver_died_is_replaced_and_the_new_one_serves(server):
    """Ray Serve's health check fails for the replica whose driver died; Serve starts another, which
    joins the fleet under a new id, and the ingresses send it requests."""

    def replica_of(d) -> int | None:
        try:
            return ray.get(d.stats.remote(), timeout=30)["replica"]
        except ray.exceptions.RayActorError:  # the killed one, still listed a moment
            return None

    old = {replica_of(d) for d in drivers()}
    ray.kill(drivers()[0], no_restart=True)
    deadline = time.monotonic() + 300
    fresh: list = []
    while time.monotonic() < deadline:
        ds = drivers()
        fresh = [d for d in ds if replica_of(d) not in old | {None}]
        if fresh and len(ds) == 2:
            break
        time.sleep(1.0)
    assert fresh and len(drivers()) == 2, drivers()

    async def run():
        c = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(_stream(c, _request(i)) for i in range(8)))
        finally:
            await c.close()

    deadline = time.monotonic() + 120
    while ray.get(fresh[0].stats.remote(), timeout=30)["num_output_tokens"] == 0 and time.monotonic() < deadline:
        assert all(s["finish"] == "length" for s in asyncio.run(run()))
    assert ray.get(fresh[0].stats.remote(), timeout=30)["num_output_tokens"] > 0
    assert requests.get(server + "/health", timeout=30).status_code == 200
