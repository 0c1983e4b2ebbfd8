"""Pipeline parallelism's batch queue: steps/s of a model of fixed cost split over PP stages, against the
same model as one stage.

No-op workers (actors/worker/noop.py) stand in for the model: a step costs `--model-ms` (KVRAY_NOOP_MODEL_S)
split evenly over the stages, and a later stage first waits for the previous stage's activation of the
step over the real point-to-point path (gloo). This process plays the driver, as bench_control_plane.py does:
EngineCore over a RayExecutor in the engine's placement group (`--executor ray`), or over the
LocalExecutor's worker processes and pipes (`--executor local`: no Ray, for a host too loaded to start
one), `--num-reqs` requests decoding. With one step in flight PP stages would give the one-stage steps/s
at best (each step still passes every stage); the batch queue keeps PP + 1 steps in flight, so PP stages
reach up to PP times that. Reported (benchmarks/results/pp_pipeline.jsonl):
`pp<N>_pipeline_efficiency` = (steps/s at PP=N) / (N x steps/s at PP=1), side by side in one run.

  python -m benchmarks.host.bench_pipeline [--pp 2 4] [--model-ms 80] [--steps 100] [--num-reqs 32] [--executor ray]
  python -m benchmarks.host.bench_pipeline --smoke    # PP=2, 10 steps, nothing written
  python -m benchmarks.host.bench_pipeline --async-scheduling   # the same with async scheduling on
"""

from __future__ import annotations

import argparse
import os
import time

import ray

from actors.driver.engine_core import EngineCore
from actors.executor.local import LocalExecutor
from actors.executor.ray_workers import RayExecutor
from actors.worker.noop import MODEL_TIME_ENV, NoopWorker
from benchmarks.common import record
from cluster.config import EngineConfig
from cluster.replicas.placement import create_placement_group, remove, start_local_ray
from kvcore.request import Request, SamplingParams


def steps_per_s(
    pp: int, steps: int, num_reqs: int, transport: str, executor_kind: str, async_scheduling: bool = False
) -> float:
    """Completed steps per second over `steps` steps, after a warm-up."""
    config = EngineConfig().replace(
        pipeline_parallel_size=pp,
        transport=transport,
        device="cpu",
        num_gpu_blocks=8192,
        max_num_seqs=num_reqs,
        max_model_len=4096,
        max_num_batched_tokens=4096,
        step_timeout_s=60,
        async_scheduling=async_scheduling,
    )
    pg = create_placement_group(config, name=f"bench-pp{pp}-{transport}") if executor_kind == "ray" else None
    engine = None
    try:
        executor = (
            RayExecutor(config, pg, worker_cls="actors.worker.noop.NoopWorker")
            if pg is not None
            else LocalExecutor(config, worker_cls=NoopWorker)
        )
        engine = EngineCore(config, executor)
        for i in range(num_reqs):
            engine.add_request(Request(f"r{i}", list(range(1, 65)), SamplingParams(max_tokens=3000, ignore_eos=True)))
        while engine.stats()["num_steps"] < 4 * pp:  # prefill, then the queue fills
            engine.step()
        n0 = engine.stats()["num_steps"]
        t0 = time.perf_counter()
        while engine.stats()["num_steps"] - n0 < steps:
            engine.step()
        rate = (engine.stats()["num_steps"] - n0) / (time.perf_counter() - t0)
        engine.abort([f"r{i}" for i in range(num_reqs)])
        while engine.has_unfinished():  # the steps in flight come back before the workers stop
            engine.step()
        return rate
    finally:
        if engine is not None:
            engine.shutdown()
        remove(pg)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--model-ms", type=float, default=80.0, help="a step's cost over all stages together")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--num-reqs", type=int, default=32)
    ap.add_argument("--transport", default="shm", choices=["shm", "compiled_graph", "actor_calls"])
    ap.add_argument("--executor", default="ray", choices=["ray", "local"])
    ap.add_argument(
        "--async-scheduling", action="store_true", help="workers answer each step with the previous one's output"
    )
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="PP=2, 10 steps, nothing written")
    args = ap.parse_args(argv)
    if args.smoke:
        args.pp, args.steps, args.no_write = [2], 10, True
    # The workers inherit the environment of the Ray this process starts.
    os.environ[MODEL_TIME_ENV] = str(args.model_ms / 1000)
    started = args.executor == "ray" and not ray.is_initialized()
    if started:
        start_local_ray(num_cpus=max(args.pp) + 2, include_dashboard=False)
    try:
        base = steps_per_s(1, args.steps, args.num_reqs, args.transport, args.executor, args.async_scheduling)
        print(f"pp=1: {base:.2f} steps/s (one stage of {args.model_ms:g} ms)", flush=True)
        results = []
        for pp in args.pp:
            sps = steps_per_s(pp, args.steps, args.num_reqs, args.transport, args.executor, args.async_scheduling)
            eff = sps / (pp * base)
            print(
                f"pp={pp}: {sps:.2f} steps/s ({pp} stages of {args.model_ms / pp:g} ms) = {sps / base:.2f}x "
                f"one stage, efficiency {eff:.3f}",
                flush=True,
            )
            results.append((pp, eff))
    finally:
        if started:
            ray.shutdown()
    if args.no_write:
        return
    for pp, eff in results:
        record("pp_pipeline", f"pp{pp}_pipeline_efficiency", eff, "ratio")


if __name__ == "__main__":
    main()
