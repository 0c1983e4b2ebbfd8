"""Shared pieces of the `kvray serve` tests: the running server, its config, driver handles, pool books."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import ray

from cluster.config import EngineConfig, load_config
from cluster.replicas.driver_names import DRIVER_NAME_PREFIX
from cluster.stress.report import leaked_blocks
from tests.ports import free_port as free_port  # the serve tests take it from here

# Two replicas (routing, a kill on one while the other serves), a small bound per replica
# (back-pressure), a restart budget (the kill), short contexts (fast steps on two cores).
SERVE_OVERRIDES = {
    "model.max_model_len": 256,
    "parallel.data_parallel_size": 2,
    "parallel.max_worker_restarts": 2,
    "parallel.step_timeout_s": 60,
    "scheduler.max_num_seqs": 6,
    "scheduler.max_num_batched_tokens": 256,
    "serve.max_queued_requests": 4,
    "ray.include_dashboard": False,
}


def serve_config() -> EngineConfig:
    return load_config("configs/local.yaml", SERVE_OVERRIDES)


@contextlib.contextmanager
def running_server(overrides: dict[str, Any]) -> Iterator[str]:
    """`kvray serve` on a free loopback port, over configs/local.yaml with `overrides`, on a local Ray
    started here (and stopped after); yields its URL. A module's `server` fixture wraps it."""
    from cluster.replicas.placement import connect
    from cluster.serve.app import start_server, stop_server

    config = load_config("configs/local.yaml", overrides)
    port = free_port()
    started = connect(config)
    try:
        start_server(config, "127.0.0.1", port)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(started)


def drivers() -> list[Any]:
    """The live engine drivers of this (private) Ray, replica order."""
    names = sorted(
        (a["name"], a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(DRIVER_NAME_PREFIX)
    )
    out = []
    for name, ns in names:
        try:
            out.append(ray.get_actor(name, namespace=ns))
        except ValueError:  # an LLM's driver, shut down a moment ago
            continue
    return out


def pool_books() -> list[dict[str, Any]]:
    return [ray.get(d.kv_pool_accounting.remote(), timeout=30) for d in drivers()]


def wait_pool_whole(limit_s: float = 60.0) -> list[dict[str, Any]]:
    """Every replica idle with no block held (or the limit passes: the caller's asserts then fail)."""
    deadline = time.monotonic() + limit_s
    while True:
        books = pool_books()
        if all(b.get("idle") and leaked_blocks(b) == 0 for b in books) or time.monotonic() > deadline:
            return books
        time.sleep(0.2)


def percentiles(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    s = sorted(xs)

    def pick(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))]

    return f"p50={pick(0.5) * 1e3:.1f}ms p99={pick(0.99) * 1e3:.1f}ms (n={len(s)})"
