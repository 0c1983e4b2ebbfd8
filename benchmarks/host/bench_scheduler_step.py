"""Scheduler step cost on this CPU: schedule() + update_from_output() per step, median over many steps.

Two workloads, each against the real KVCacheManager (prefix caching on, block_size 16):
  256_decodes   256 requests, all in decode (prompt 512 tokens, long max_tokens so none finishes).
  prefill_mix   a steady stream of 200-2000 token prompts (half share a 512-token prefix) with
                32-128 output tokens; every step mixes chunked prefills (budget 8192) and decodes.
The fake model runner's time (building ModelRunnerOutput) is not counted.

    PYTHONPATH=. python -m benchmarks.host.bench_scheduler_step [--steps 2000]
    python -m benchmarks.host.bench_scheduler_step --smoke      # 20 steps, nothing recorded (CI)
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import record
from kvcore import Request, SamplingParams
from kvcore.kv_cache_manager import KVCacheManager
from kvcore.messages import ModelRunnerOutput, SchedulerOutput
from kvcore.sched.scheduler import Scheduler
from kvcore.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

# The series keeps the file it began in (benchmarks/README.md: results/).
BLOCK_SIZE = 16


def make_scheduler(num_blocks: int, max_model_len: int) -> Scheduler:
    import torch  # only to name a dtype in the spec; the scheduler itself never sees a tensor

    spec = FullAttentionSpec(BLOCK_SIZE, 8, 128, torch.bfloat16)
    manager = KVCacheManager(KVCacheConfig(num_blocks, [KVCacheGroupSpec(["l0"], spec)]), max_model_len)
    return Scheduler(manager, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=max_model_len)


def runner_output(sched: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """What rank 0 would return: a token for every request whose prefill is complete."""
    ids, sampled = [], []
    requests = sched.requests
    for rid in out.num_scheduled_tokens:
        req = requests[rid]
        ids.append(rid)
        sampled.append([7] if req.num_computed_tokens >= len(req.all_token_ids) else [])
    return ModelRunnerOutput(ids, sampled, out.step_id)


def timed_step(sched: Scheduler) -> tuple[int, int]:
    """(ns spent in the scheduler, requests scheduled) for one step."""
    t0 = time.perf_counter_ns()
    out = sched.schedule()
    t1 = time.perf_counter_ns()
    mro = runner_output(sched, out)
    t2 = time.perf_counter_ns()
    sched.update_from_output(out, mro)
    t3 = time.perf_counter_ns()
    return (t1 - t0) + (t3 - t2), len(out.num_scheduled_tokens)


class ManagerTimer:
    """Wraps the manager's entry points to count the time spent inside them (breakdown pass only)."""

    NAMES = ("allocate_slots", "get_computed_blocks", "free", "get_block_ids")

    def __init__(self, sched: Scheduler) -> None:
        self.ns = 0
        manager = sched.kv_cache_manager
        for name in self.NAMES:
            setattr(manager, name, self._wrap(getattr(manager, name)))

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns += time.perf_counter_ns() - t

        return timed


def bench_decodes(steps: int, breakdown: bool = False) -> tuple[list[float], float]:
    prompt, num_reqs = 512, 256
    max_model_len = prompt + steps + 600
    sched = make_scheduler(num_reqs * (max_model_len // BLOCK_SIZE + 2) + 1, max_model_len)
    rng = random.Random(0)
    for i in range(num_reqs):
        ids = [rng.randrange(32000) for _ in range(prompt)]
        sched.add_request(Request(f"d{i}", ids, SamplingParams(max_tokens=steps + 520, ignore_eos=True)))
    while sched.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        timed_step(sched)  # prefill, not measured
    times, batch = [], []
    for _ in range(steps):
        ns, n = timed_step(sched)
        times.append(ns / 1000)
        batch.append(n)
    assert min(batch) == num_reqs, "every step must run all 256 decodes"
    if breakdown:
        timer = ManagerTimer(sched)
        shares = []
        for _ in range(min(steps, 500)):
            timer.ns = 0
            ns, _ = timed_step(sched)
            shares.append((timer.ns / 1000, ns / 1000))
        in_mgr = statistics.median(s[0] for s in shares)
        total = statistics.median(s[1] for s in shares)
        print(
            f"breakdown (instrumented, 256 decodes): median step {total:.1f} us, of which "
            f"{in_mgr:.1f} us inside KVCacheManager calls, {total - in_mgr:.1f} us in the scheduler"
        )
    return times, statistics.mean(batch)


def bench_prefill_mix(steps: int) -> tuple[list[float], float]:
    max_model_len = 4096
    sched = make_scheduler(12000, max_model_len)
    rng = random.Random(1)
    shared = [rng.randrange(32000) for _ in range(512)]
    next_id = 0

    def admit() -> None:
        nonlocal next_id
        while sched.num_waiting < 16:
            n = rng.randint(200, 2000)
            ids = (
                shared + [rng.randrange(32000) for _ in range(n - 512)]
                if n > 512 and rng.random() < 0.5
                else [rng.randrange(32000) for _ in range(n)]
            )
            sched.add_request(
                Request(f"p{next_id}", ids, SamplingParams(max_tokens=rng.randint(32, 128), ignore_eos=True))
            )
            next_id += 1

    for _ in range(200):  # reach a steady state first
        admit()
        timed_step(sched)
    times, batch = [], []
    for _ in range(steps):
        admit()  # arrivals are the client's cost, not the scheduler's
        ns, n = timed_step(sched)
        times.append(ns / 1000)
        batch.append(n)
    return times, statistics.mean(batch)


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000, help="measured steps per workload")
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to the results file")
    ap.add_argument("--smoke", action="store_true", help="20 steps a workload, nothing recorded: the script runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.no_record = 20, True

    rows = []
    for metric, fn in [
        ("scheduler_step_us_256_decodes", lambda n: bench_decodes(n, breakdown=True)),
        ("scheduler_step_us_prefill_mix", bench_prefill_mix),
    ]:
        times, mean_batch = fn(args.steps)
        times.sort()
        rows.append((metric, statistics.median(times), times[int(0.9 * len(times))], mean_batch))

    print(f"{'metric':34s} {'median us':>10s} {'p90 us':>10s} {'reqs/step':>10s}")
    for metric, med, p90, mean_batch in rows:
        print(f"{metric:34s} {med:10.1f} {p90:10.1f} {mean_batch:10.1f}")
    if args.no_record:
        return
    for metric, med, _, _ in rows:
        record("scheduler_step", metric, med, "us", device=cpu_name())


if __name__ == "__main__":
    main()
