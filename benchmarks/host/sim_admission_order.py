"""Admission order for an offline job, predicted on the CPU: the real Scheduler and KVCacheManager run the
ShareGPT-like workload (bench_offline's 1,000 requests, max_tokens known up front) and a step-cost model
turns each SchedulerOutput into GPU time.

[speed] names a lead: with max_tokens known, admitting the longest requests first should shorten the tail of
small steps. The floor of that workload is its longest request: 1,934 output tokens need 1,934 sequential
steps whatever the order, and each step of a few rows still reads every weight. This script asks how many
steps and how much modelled time each order takes, before anything is built into the engine.

The step model (one H100, Llama-3.1-8B, bf16; measured figures, benchmarks/RESULTS.md):
  time = max(WEIGHTS_MS, tokens x 16.06 GFLOP / GEMM_FLOPS) + KV tokens read x 128 KiB / COPY_BPS
with WEIGHTS_MS the batch-1 token (5.8 ms at 0.925 of copy), GEMM_FLOPS 600 TFLOP/s, COPY_BPS 2,990 GB/s.
It leaves out launch gaps and attention's own efficiency, so its absolute seconds run below the engine's
(23.1 s measured at d390655); only the orders' ratio is the prediction.

  python -m benchmarks.host.sim_admission_order              # FCFS against longest-first
  python -m benchmarks.host.sim_admission_order --smoke      # 64 requests (CI)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.host.bench_scheduler_step import make_scheduler, runner_output
from kvcore import Request, SamplingParams

WEIGHTS_MS = 5.8
GEMM_FLOPS = 600e12
FLOPS_PER_TOKEN = 2 * 8.03e9
COPY_BPS = 2.99e12
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head size x (K, V) x bf16
KV_BLOCKS = 25_000  # ~400k tokens of 16: the H100's KV pool for this model at the default memory share


@dataclass(frozen=True)
class Run:
    order: str
    steps: int
    modelled_s: float
    small_steps: int  # steps of at most 16 requests: the tail, each paying a whole weight read
    small_s: float


def step_ms(tokens: int, kv_tokens: int) -> float:
    gemm_ms = max(WEIGHTS_MS, tokens * FLOPS_PER_TOKEN / GEMM_FLOPS * 1e3)
    return gemm_ms + kv_tokens * KV_BYTES_PER_TOKEN / COPY_BPS * 1e3


def simulate(order: str, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> Run:
    sched = make_scheduler(KV_BLOCKS, 4096)
    for i in ranked(order, prompts, max_tokens):
        params = SamplingParams(max_tokens=max_tokens[i], ignore_eos=True)
        sched.add_request(Request(f"r{i}", list(prompts[i]), params))
    steps = small = 0
    total_ms = small_ms = 0.0
    while sched.num_waiting or sched.running:
        out = sched.schedule()
        tokens = sum(out.num_scheduled_tokens.values())
        # schedule() has already counted this step's tokens as computed: each request's KV read is all of them.
        kv = sum(sched.requests[rid].num_computed_tokens for rid in out.num_scheduled_tokens)
        ms = step_ms(tokens, kv)
        steps += 1
        total_ms += ms
        if len(out.num_scheduled_tokens) <= 16:
            small += 1
            small_ms += ms
        sched.update_from_output(out, runner_output(sched, out))
    return Run(order, steps, total_ms / 1e3, small, small_ms / 1e3)


def ranked(order: str, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> list[int]:
    """Submission order: fcfs as given; longest (max_tokens, the decode steps a request holds a slot) or
    longest_total (prompt + max_tokens) first."""
    idx = list(range(len(prompts)))
    if order == "fcfs":
        return idx
    if order == "longest":
        return sorted(idx, key=lambda i: -max_tokens[i])
    if order == "longest_total":
        return sorted(idx, key=lambda i: -(max_tokens[i] + len(prompts[i])))
    raise ValueError(f"order {order!r}: must be fcfs, longest or longest_total")


def main(argv: list[str] | None = None) -> None:
    from benchmarks.e2e.bench_offline import make_workload

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="the first 64 requests")
    args = ap.parse_args(argv)
    prompts, params = make_workload("sharegpt", 128_256)
    if args.smoke:
        prompts, params = prompts[:64], params[:64]
    max_tokens = [p["max_tokens"] for p in params]
    out_tokens = sum(max_tokens)
    print(f"{len(prompts)} requests, {out_tokens:,} output tokens, the longest {max(max_tokens):,}")
    runs = [simulate(order, prompts, max_tokens) for order in ("fcfs", "longest", "longest_total")]
    for r in runs:
        print(
            f"{r.order:14s} {r.steps:5d} steps  {r.modelled_s:6.2f} s modelled  {out_tokens / r.modelled_s:7,.0f} tok/s"
            f"  steps of <= 16 requests: {r.small_steps} ({r.small_s:.2f} s)"
        )
    fcfs = runs[0]
    for r in runs[1:]:
        print(f"{r.order} against fcfs: {fcfs.modelled_s / r.modelled_s:.3f}x")


if __name__ == "__main__":
    main()
