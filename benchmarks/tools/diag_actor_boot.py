"""Where a fresh Ray actor process's boot goes: on the H200 the engine's GPU worker spent 3-4 s between its
process start and kvray's import (0.3 s on the CPU machine, where an idle prestarted worker takes the actor).

On a local Ray started as the engine starts one (cluster.replicas.placement.start_local_ray), actors are created one
after another: a GPU actor (num_gpus=1), a CPU actor (num_cpus=1) and a 0-CPU actor, each in a new process.
For each: request -> process start -> the actor's __init__ (the Python + Ray boot) -> ready as the client
sees it. Then the core-worker log of the first GPU actor's process, with the offsets of its lines from the
process start, to show which part of Ray's worker start the boot waits on.

  python -m benchmarks.tools.diag_actor_boot [--rounds 2]
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import time
from datetime import datetime
from typing import Any

import ray

from actors.profiling.start_timeline import process_start_epoch
from cluster.replicas.placement import start_local_ray


class Probe:
    def __init__(self) -> None:
        self.init_at = time.time()
        self.started = process_start_epoch()

    def marks(self) -> tuple[float, float | None, int]:
        return self.init_at, self.started, os.getpid()


def one(opts: dict[str, Any], label: str) -> tuple[int, float | None]:
    t0 = time.time()
    actor: Any = ray.remote(Probe).options(**opts).remote()
    init_at, started, pid = ray.get(actor.marks.remote())
    ready = time.time()
    spawn = (started - t0) if started else float("nan")
    boot = init_at - (started or t0)
    print(f"{label:10s} spawn {spawn:6.2f} s  boot (start -> __init__) {boot:5.2f} s  ready {ready - t0:5.2f} s", pid)
    ray.kill(actor)
    return pid, started


STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def show_log(pid: int, started: float | None) -> None:
    node: Any = ray._private.worker._global_node
    ray_dir = node.get_session_dir_path()
    files = glob.glob(os.path.join(ray_dir, "logs", f"python-core-worker-*_{pid}.log"))
    if not files:
        print("no core-worker log for pid", pid)
        return
    with open(files[0]) as f:
        lines = f.readlines()
    for ln in lines[:40]:
        m = STAMP.match(ln)
        if not m:
            continue
        at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        started = started or at
        print(f"  +{at - started:6.3f} s after the process start  {ln[26:].strip()[:140]}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    t0 = time.time()
    has_gpu = bool(os.environ.get("CUDA_VISIBLE_DEVICES", "x")) and os.path.exists("/dev/nvidia0")
    start_local_ray(num_cpus=os.cpu_count() or 1)
    print(f"ray.init {time.time() - t0:.2f} s")
    kinds = [({"num_cpus": 1}, "cpu"), ({"num_cpus": 0}, "zero-cpu")]
    if has_gpu:
        kinds.insert(0, ({"num_cpus": 0, "num_gpus": 1}, "gpu"))
    first: tuple[int, float | None] | None = None
    for r in range(args.rounds):
        for opts, label in kinds:
            got = one(opts, f"{label}#{r}")
            first = first or got
    assert first is not None
    print(f"core-worker log of pid {first[0]}:")
    show_log(*first)
    ray.shutdown()


if __name__ == "__main__":
    main()
