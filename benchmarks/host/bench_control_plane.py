"""Control-plane cost per engine step: schedule + broadcast the SchedulerOutput to every TP rank + rank 0's
reply + update_from_output, with a no-op model (actors/worker/noop.py) so only the control plane is timed.

This process plays the driver: it reserves the placement group and runs EngineCore over a RayExecutor,
exactly as the driver actor does. For TP = 1, 2, 4 and every transport (shared-memory broadcast, compiled
graph, plain actor calls), side by side in one run, it times `--steps` steps with `--num-reqs` requests
decoding, and reports the median. Appends JSON lines to benchmarks/results/control_plane.jsonl:
`control_plane_us_tp<N>_<transport>` for each, and `control_plane_us_tp<N>` (the headline at TP=2) for
the default transport (ray.transport's default in actors/config/engine.py).

  python -m benchmarks.host.bench_control_plane [--tp 1 2 4] [--steps 300] [--num-reqs 32] [--device cpu]
  python -m benchmarks.host.bench_control_plane --shm-spin-s 0.001   # spinning measured on a small host
  python -m benchmarks.host.bench_control_plane --smoke     # CPU, TP=2, every transport, 20 steps (engine smoke)
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray

from actors.driver.engine_core import EngineCore
from actors.executor.ray_workers import RayExecutor
from benchmarks.common import record
from cluster.config import EngineConfig
from cluster.replicas.placement import create_placement_group, remove, start_local_ray
from kvcore.request import Request, SamplingParams


def measure(
    tp: int, transport: str, steps: int, num_reqs: int, device: str, gpus_per_worker: float
) -> dict[str, float]:
    config = EngineConfig().replace(
        tensor_parallel_size=tp,
        transport=transport,
        device=device,
        gpus_per_worker=gpus_per_worker,
        num_gpu_blocks=8192,
        max_num_seqs=max(num_reqs, 1),
        max_model_len=4096,
        max_num_batched_tokens=4096,
        step_timeout_s=60,
    )
    pg = create_placement_group(config, name=f"bench-tp{tp}-{transport}")
    engine = None
    try:
        executor = RayExecutor(config, pg, worker_cls="actors.worker.noop.NoopWorker")
        engine = EngineCore(config, executor)
        for i in range(num_reqs):
            engine.add_request(Request(f"r{i}", list(range(1, 65)), SamplingParams(max_tokens=3000, ignore_eos=True)))
        for _ in range(20):  # prefill, graph compile, warm caches
            engine.step()
        times, sched = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            so = engine.scheduler.schedule()
            t1 = time.perf_counter()
            out = engine.executor.execute_model(so)
            engine.scheduler.update_from_output(so, out)
            t2 = time.perf_counter()
            times.append(t2 - t0)
            sched.append(t1 - t0)
        return {
            "step_us": statistics.median(times) * 1e6,
            "schedule_us": statistics.median(sched) * 1e6,
            "p90_step_us": sorted(times)[int(0.9 * len(times))] * 1e6,
        }
    finally:
        if engine is not None:
            engine.shutdown()
        remove(pg)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--transports", nargs="+", default=["shm", "compiled_graph", "actor_calls"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--num-reqs", type=int, default=32)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument(
        "--shm-spin-s",
        type=float,
        default=None,
        help="how long every shm party spins before it blocks (default: actors.transport.shm.default_spin_s, "
        "which spins only where the host has >= 2 x (ranks + 1) cores); set it to measure spinning on a small host",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, TP=2, every transport, 20 steps, nothing written")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tp, args.steps, args.device, args.no_write = [2], 20, "cpu", True
    if args.shm_spin_s is not None:
        import actors.transport.shm as shm_transport

        spin_s = args.shm_spin_s
        shm_transport.default_spin_s = lambda n_workers: spin_s
    need = max(args.tp) + 2
    started = not ray.is_initialized()  # a caller's Ray (the CI smoke's) is used as it is, and left up
    if started and args.device == "cuda":
        ray.init(include_dashboard=False)
    elif started:
        start_local_ray(num_cpus=need, include_dashboard=False)
    results = []
    try:
        num_gpus = int(ray.cluster_resources().get("GPU", 0))
        for tp in args.tp:
            # The no-op workers never touch the GPU: on a host with fewer GPUs than ranks they share.
            gpus_per_worker = 1.0 if args.device == "cpu" or tp <= num_gpus else max(num_gpus, 1) / tp
            for transport in args.transports:
                r = measure(tp, transport, args.steps, args.num_reqs, args.device, gpus_per_worker)
                print(
                    f"tp={tp} transport={transport:15s} step median {r['step_us']:9.1f} us  "
                    f"p90 {r['p90_step_us']:9.1f} us  (schedule alone {r['schedule_us']:.1f} us)",
                    flush=True,
                )
                results.append((tp, transport, r["step_us"]))
    finally:
        if started:
            ray.shutdown()
    if args.no_write:
        return
    default = EngineConfig().ray.transport
    for tp, transport, us in results:
        record("control_plane", f"control_plane_us_tp{tp}_{transport}", us, "us")
        if transport == default and tp in (2, 4):
            record("control_plane", f"control_plane_us_tp{tp}", us, "us")


if __name__ == "__main__":
    main()
