"""Scale-out under `kvray serve`: the time from Ray Serve's scale-up decision to the new engine replica's first
token, as [serve-ha] asks (`serve_scale_out_s_qwen3`; Ray Serve LLM's docs give 71-104 s for an 8B replica).

The server starts with serve.autoscaling from 1 to 2 engine replicas (target_ongoing_requests --target, no
upscale delay, Serve's metrics every 0.5 s). Each engine replica takes half the GPU (parallel.gpus_per_worker
0.5), so both fit the one GPU of a device call; the second starts with the Triton cache the first one warmed,
as a scale-out on a running node does. A client keeps 4x the target streaming (greedy, EOS ignored), so the
policy asks for a second replica at once, and three moments are taken by polling every 50 ms:
  decision    Serve's status for the EngineReplica deployment turns UPSCALING (its controller decided);
  registered  the new replica's driver is up and in the fleet (cluster/serve/fleet.py): ingresses route to it;
  first token the new replica's driver has produced an output token.
Every stream must complete with its tokens (the bench fails otherwise).

Records serve_scale_out_s_<tag> (decision -> first token) and serve_scale_out_start_s_<tag> (decision ->
registered), bench_serve_scale series.

  python -m benchmarks.e2e.bench_serve_scale --shape qwen3-0.6b      # GPU
  python -m benchmarks.e2e.bench_serve_scale --smoke                 # CPU, tiny-random
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.e2e.bench_serve import TAGS, free_port, one_request

POLL_S = 0.05


@dataclass
class Moments:
    decision: float | None = None
    registered: float | None = None
    first_token: float | None = None


def autoscaling_overrides(target: int, smoke: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "parallel.data_parallel_size": 1,
        "serve.autoscaling": {
            "min_replicas": 1,
            "max_replicas": 2,
            "target_ongoing_requests": target,
            "upscale_delay_s": 0.0,
            "downscale_delay_s": 600.0,  # no scale-down while it is measured
            "metrics_interval_s": 0.5,
            "look_back_period_s": 1.0,
        },
    }
    if not smoke:
        out["parallel.gpus_per_worker"] = 0.5  # both replicas on the one GPU
    return out


async def watch(app: str, timeout_s: float) -> Moments:
    """Poll Serve's status and the fleet until the second replica's first token (or the timeout)."""
    from ray import serve

    fleet = serve.get_deployment_handle("EngineFleet", app)
    first = (await fleet.view.remote()).members
    known = {m.replica for m in first}
    m = Moments()
    deadline = time.monotonic() + timeout_s
    new = None
    while time.monotonic() < deadline and m.first_token is None:
        now = time.perf_counter()
        if m.decision is None:
            status = serve.status().applications[app].deployments["EngineReplica"]
            if str(status.status).endswith("UPSCALING") or sum(status.replica_states.values()) > len(known):
                m.decision = now
        if new is None:
            members = (await fleet.view.remote()).members
            new = next((x for x in members if x.replica not in known), None)
            if new is not None:
                m.registered = now
                m.decision = m.decision if m.decision is not None else now
        elif (await new.driver.stats.remote()).get("num_output_tokens", 0) > 0:
            m.first_token = now
        await asyncio.sleep(POLL_S)
    return m


async def run(url: str, model: str, app: str, target: int, vocab: int, max_tokens: int, timeout_s: float) -> Moments:
    import random

    import aiohttp

    rng = random.Random(0)
    stop = asyncio.Event()
    failures: list[str] = []
    completed = 0

    async def loader(http: Any) -> None:
        nonlocal completed
        while not stop.is_set():
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(32, 128))]
            out = await one_request(http, url, model, prompt, max_tokens)
            if not out.ok or out.num_tokens != max_tokens:
                failures.append(out.error or f"{out.num_tokens} tokens, not {max_tokens}")
            completed += 1

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        tasks = [asyncio.create_task(loader(http)) for _ in range(4 * target)]
        try:
            moments = await watch(app, timeout_s)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
    if failures:
        raise SystemExit(f"bench_serve_scale: {len(failures)} of {completed} streams failed: {failures[0]}")
    print(f"{completed} streams completed, none failed", flush=True)
    return moments


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(TAGS), default="qwen3-0.6b")
    ap.add_argument("--model-dir", default="/tmp/kvray-models")
    ap.add_argument("--config", default="configs/gpu.yaml")
    ap.add_argument(
        "--target", type=int, default=None, help="serve.autoscaling.target_ongoing_requests (8; 2 with --smoke)"
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the new replica's token")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny-random; records nothing")
    args = ap.parse_args(argv)
    from cluster.config import load_config
    from cluster.serve.app import APP_NAME, start_server, stop_server

    # The smoke's 4 x target streams share two CPU cores with the replicas: a small target still scales out.
    args.target = args.target or (2 if args.smoke else 8)
    overrides = autoscaling_overrides(args.target, args.smoke)
    if args.smoke:
        config = load_config("configs/local.yaml", {"model.max_model_len": 256, "ray.include_dashboard": False})
        vocab, max_tokens = 256, 24
    else:
        from benchmarks.common import make_random_model, vocab_size

        config = load_config(args.config, {"model.model": make_random_model(args.shape, args.model_dir)})
        vocab, max_tokens = vocab_size(args.shape), 512
    from cluster.config import apply_overrides

    config = apply_overrides(config, overrides)
    port = free_port()
    t0 = time.perf_counter()
    started = start_server(config, "127.0.0.1", port)
    print(f"server up with one engine replica in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        m = asyncio.run(
            run(f"http://127.0.0.1:{port}", config.model.model, APP_NAME, args.target, vocab, max_tokens, args.timeout)
        )
    finally:
        stop_server(started)
    if m.first_token is None or m.decision is None or m.registered is None:
        raise SystemExit(f"bench_serve_scale: no second replica's token within {args.timeout:g} s: {m}")
    out_s, start_s = m.first_token - m.decision, m.registered - m.decision
    print(f"scale-out: decision -> registered {start_s:.2f} s, decision -> first token {out_s:.2f} s", flush=True)
    if not args.smoke:
        from benchmarks.common import record

        tag = TAGS[args.shape]
        record("bench_serve_scale", f"serve_scale_out_s_{tag}", out_s, "s")
        record("bench_serve_scale", f"serve_scale_out_start_s_{tag}", start_s, "s")


if __name__ == "__main__":
    main()
