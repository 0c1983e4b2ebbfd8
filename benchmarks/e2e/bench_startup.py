"""Engine start-up (LLM(...) to ready) with a cold and a warm Triton cache, and the first run's TTFT.

Each measurement runs in a fresh process (Triton also caches compiled kernels in memory): cold with an
empty TRITON_CACHE_DIR, then warm with the cache the cold run filled. In the warm process, a workload
of 128 requests (prompts of 128-512 tokens, 64 greedy tokens) runs twice with no warm-up call before,
with the same lengths but fresh token ids the second time (no prefix-cache hits), and a third time
after a pause of PAUSE_S: first_run_ttft_ratio = TTFT p50 of the first run / of the second (target
<= 1.2: nothing compiles on the first requests); the third tells a first-run cost from a cost of
starting after idle. Last, a start with Ray already running (RAY_ADDRESS, as under `ray job submit`):
the engine's own start without Ray's (init_s_*_attached). compile_ahead_s_*_cold: the wall time of the cold
start's dry passes, which compiled its kernel variants on a thread pool (KVRAY_COMPILE_THREADS=0: none, the
variants compile one after the other as the warm-ups launch them). The engine stats split the start into ray
connect / placement / probe / workers (and the worker processes' phases, worker_*_s) / model load /
KV sizing / KV + capture.

  python -m benchmarks.e2e.bench_startup --shape qwen3-0.6b
  python -m benchmarks.e2e.bench_startup --warm-only    # the Triton cache as it is (warm after other runs)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import SHAPES, make_random_model, record

STARTUP_KEYS = ("probe_s", "workers_start_s", "load_model_s", "kv_sizing_s", "kv_init_capture_s", "step_path_s")
PAUSE_S = 5.0
TAGS = {"qwen3-0.6b": "qwen3_0p6b", "llama-3.1-8b": "llama8b"}


def child(model_dir: str, runs: int) -> dict:
    t0 = time.perf_counter()
    import ray

    from cluster import LLM, SamplingParams

    import_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    llm = LLM(model=model_dir, device="cuda")
    out = {"init_s": time.perf_counter() - t0, "import_s": import_s}
    driver = llm.engines.drivers[0]
    stats = llm.engines.stats()[0]
    out.update(llm.engines.startup_s)
    out.update({k: v for k, v in stats.items() if k in STARTUP_KEYS or k.startswith("worker_")})
    compiles = ray.get(driver.worker_call.remote(0, "compile_events", 0))
    out["compiles_at_start"] = len(compiles)
    out["compile_s_at_start"] = round(sum(e["took_s"] for e in compiles), 2)
    # The dry passes that compiled the start's variants on a thread pool (actors/worker/compile_ahead.py): with
    # them, each compile's took_s runs from its hand-off to the pool until the pool drained, so their sum is
    # no wall time; the passes' own wall time is.
    ahead = ray.get(driver.worker_call.remote(0, "compiled_ahead"))
    out["compiled_ahead"] = ahead
    out["compile_ahead_s"] = round(sum(p["wall_s"] for p in ahead), 2)
    print(
        "slowest start-up compiles:",
        json.dumps(sorted(compiles, key=lambda e: -e["took_s"])[:15], indent=1),
        file=sys.stderr,
    )
    lens = np.random.default_rng(1).integers(128, 513, 128)
    sp = SamplingParams(max_tokens=64, ignore_eos=True)
    try:
        for r in range(runs):
            if r == 2:
                # An idle gap before the third run: if it is as slow as the first, what the first run
                # pays is the wake-up after idle (clocks, sleeping loops), not a missing warm-up.
                time.sleep(PAUSE_S)
            # Same lengths, fresh tokens: a repeated prompt would hit the prefix cache and flatter the later run.
            rng = np.random.default_rng(100 + r)
            prompts = [{"prompt_token_ids": rng.integers(0, 10000, int(n)).tolist()} for n in lens]
            timing = ray.get(driver.worker_call.remote(0, "start_step_timing"))
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp)
            wall = time.perf_counter() - t0
            if timing:
                host = ray.get(driver.worker_call.remote(0, "collect_host_phases"))
                out[f"run{r}_steps"] = step_summary(
                    ray.get(driver.worker_call.remote(0, "collect_step_timing")), host, wall
                )
            ttft = statistics.median(o.metrics.ttft_s for o in outs if o.metrics and o.metrics.ttft_s is not None)
            out[f"run{r}_ttft_p50_ms"] = ttft * 1e3
            out[f"run{r}_wall_s"] = wall
            # Any compile here is a variant the warm-up missed: a request waited for it.
            late = ray.get(driver.worker_call.remote(0, "compile_events", len(compiles)))
            compiles += late
            out[f"run{r}_compiles"] = [f"{e['kernel']} {e['took_s']:.2f}s {e['signature'][:300]}" for e in late]
    finally:
        llm.shutdown()
    return out


def step_summary(steps: list[dict], host: list[dict], wall_s: float) -> dict:
    """Where a run's wall time went on rank 0: GPU busy, GPU gaps between steps, the worker's host phases,
    and what lies outside every step (the client and driver before the first step and after the last),
    plus the first steps one by one: a first-run cost shows as a slower first step or a late start."""
    busy = sum(st["busy_ms"] or 0.0 for st in steps)
    gaps = sum(st["gap_ms"] or 0.0 for st in steps)
    phases = {k: round(sum(h[k] for h in host), 1) for k in ("prepare_ms", "wait_ms", "complete_ms", "outside_ms")}
    first = [
        {
            k: (round(v, 2) if isinstance(v, float) else v)
            for k, v in {**st, **(host[i] if i < len(host) else {})}.items()
        }
        for i, st in enumerate(steps[:6])
    ]
    return {
        "n": len(steps),
        "busy_ms": round(busy, 1),
        "gaps_ms": round(gaps, 1),
        "outside_steps_ms": round(wall_s * 1e3 - busy - gaps, 1),
        **phases,
        "first": first,
    }


def running_ray(child_env: dict[str, str]) -> dict[str, str]:
    """A local Ray this process keeps up for the attached run, and the environment a client needs to
    join it: its GCS address, and token auth on (a local Ray 2.60 starts with a token in ~/.ray, which
    a joining client reads only when told to). The engine's workers are this Ray's processes and take
    this process's environment, not the client's: the Triton cache and the compile log go here."""
    import ray

    from cluster.replicas.placement import start_local_ray

    os.environ.update({k: child_env[k] for k in ("TRITON_CACHE_DIR", "KVRAY_LOG_COMPILES") if k in child_env})
    start_local_ray(num_cpus=os.cpu_count() or 1)
    return {"RAY_AUTH_MODE": "token", "RAY_ADDRESS": str(ray.get_runtime_context().gcs_address)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--model-dir", default="/tmp/kvray-models")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--warm-only", action="store_true", help="skip the cold-cache start (about a minute)")
    args = ap.parse_args(argv)
    if args.child:
        print("CHILD " + json.dumps(child(args.child, args.runs)), flush=True)
        return
    model_dir = make_random_model(args.shape, args.model_dir)
    tag = TAGS[args.shape]
    cache = None if args.warm_only else tempfile.mkdtemp(prefix="kvray-triton-cache-")
    results = {}
    for name, runs in (("cold", 1), ("warm", 3), ("attached", 1)):
        if name == "cold" and args.warm_only:
            continue
        env = {**os.environ, "KVRAY_LOG_COMPILES": "1", **({"TRITON_CACHE_DIR": cache} if cache else {})}
        if name == "attached":
            # Ray already up (`ray start`, or the cluster `ray job submit` targets): the engine's own start.
            env.update(running_ray(env))
        p = subprocess.run(
            [sys.executable, "-m", "benchmarks.e2e.bench_startup", "--child", model_dir, "--runs", str(runs)],
            cwd=Path(__file__).resolve().parents[2],
            env=env,
            capture_output=True,
            text=True,
        )
        sys.stderr.write(p.stderr[-4000:])
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("CHILD ")), None)
        if p.returncode != 0 or line is None:
            raise RuntimeError(f"{name} start-up run failed (rc={p.returncode}): {p.stdout[-2000:]}")
        results[name] = json.loads(line[6:])
        print(f"start-up [{name} Triton cache]: {results[name]}", flush=True)
    record("bench_startup", f"init_s_{tag}_attached", results["attached"]["init_s"], "s")
    if "cold" in results:
        record("bench_startup", f"init_s_{tag}_cold", results["cold"]["init_s"], "s")
        record("bench_startup", f"compile_ahead_s_{tag}_cold", results["cold"]["compile_ahead_s"], "s")
    record("bench_startup", f"init_s_{tag}", results["warm"]["init_s"], "s")
    w = results["warm"]
    record(
        "bench_startup",
        f"first_run_ttft_ratio_{tag}" if tag != "qwen3_0p6b" else "first_run_ttft_ratio",
        w["run0_ttft_p50_ms"] / w["run1_ttft_p50_ms"],
        "x",
    )


if __name__ == "__main__":
    main()
