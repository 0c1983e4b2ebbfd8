"""`kvray serve` on a real multi-node cluster (tests/multinode.py: a head without CPUs, where the ingress
and the drivers live, and nodes a and b of one CPU each, one replica's worker on each). The node under
one replica goes away mid-load with no spare node: that replica cannot rebuild within
parallel.placement_timeout_s and hands its requests back, and the ingress moves every one of them to the
other replica (issue 35 (b), issue 38 item 2). Every stream, greedy and seeded, completes with exactly
the tokens of the no-fault run, with no error event."""

import asyncio

import openai
import pytest
import requests
from multinode import local_cluster
from ray import serve

from cluster.config import load_config
from cluster.serve.app import APP_NAME, build
from tests.serve_helpers import free_port

pytestmark = pytest.mark.timeout(600)
MODEL = "tiny-random"
N = 12


@pytest.fixture(scope="module")
def served():
    with local_cluster(head_resources={"head": 1.0}, a=1, b=1) as c:
        config = load_config(
            "configs/local.yaml",
            {
                "model.max_model_len": 256,
                "parallel.data_parallel_size": 2,
                "parallel.max_worker_restarts": 3,
                "parallel.placement_timeout_s": 4,
                "parallel.step_timeout_s": 60,
                "cache.cpu_kv_cache_gib": 0.01,
                "scheduler.max_num_seqs": 16,
                "scheduler.max_num_batched_tokens": 256,
                "serve.max_queued_requests": 16,
                "ray.transport": "actor_calls",
                "ray.include_dashboard": False,
            },
        )
        port = free_port()
        # One proxy, on the head: the nodes share 127.0.0.1, so a proxy per node would share the port.
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        try:
            # The app's Serve replicas on the head (the drivers follow the engine replicas there): a lost
            # worker node takes only workers.
            app = build(config, actor_resources={"head": 0.01})
            serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
            yield f"http://127.0.0.1:{port}", c
        finally:
            serve.shutdown()


def _requests() -> list[dict]:
    out = []
    for i in range(N):
        req: dict = {"prompt": f"node loss {i} " * (1 + i % 3), "max_tokens": 32, "temperature": 0}
        if i % 2:
            req.update(temperature=0.9, seed=50 + i, logprobs=1)
        req["extra_body"] = {"ignore_eos": True, "return_token_ids": True}
        out.append(req)
    return out


async def _run_all(url: str, fault=None) -> list:
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=240)
    progressed = [0] * N
    ready = asyncio.Event()

    async def one(i: int, req: dict):
        stream = await c.completions.create(model=MODEL, stream=True, **req)
        ids: list[int] = []
        finish = None
        async for ch in stream:
            for cc in ch.choices:
                ids += getattr(cc, "token_ids", None) or []
                finish = cc.finish_reason or finish
            progressed[i] = len(ids)
            if sum(p >= 2 for p in progressed) >= N // 2:
                ready.set()
        return ids, finish

    try:
        tasks = [asyncio.create_task(one(i, r)) for i, r in enumerate(_requests())]
        if fault is not None:
            await ready.wait()
            await asyncio.get_running_loop().run_in_executor(None, fault)
        return await asyncio.gather(*tasks)
    finally:
        await c.close()


def test_a_lost_node_without_a_spare_moves_its_replicas_streams(served):
    url, cluster = served
    ref = asyncio.run(_run_all(url))
    assert all(len(ids) == 32 and f == "length" for ids, f in ref), ref
    got = asyncio.run(_run_all(url, fault=lambda: cluster.remove("b")))
    assert got == ref
    metrics = requests.get(url + "/metrics", timeout=30).text
    moved = sum(float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith("kvray_serve_migrations{"))
    assert moved > 0, [ln for ln in metrics.splitlines() if "migrations" in ln]
