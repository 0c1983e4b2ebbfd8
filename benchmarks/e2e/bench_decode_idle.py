"""How long the GPU idles between decode steps, with CUDA graphs on/off and async scheduling on/off.

Each configuration runs the same decode-heavy batch through the full engine (LLM -> driver actor ->
compiled-graph transport -> worker). The worker records CUDA events around every step's GPU work
(actors/step_profiler.StepTimer: `begin` right before the forward is launched, `end` after the sampled
tokens' copy is queued); over the decode steps at the full batch size,

    gpu_idle_frac_decode = sum(gap end_i -> begin_{i+1}) / (first end -> last end)

i.e. the share of wall time in which the GPU had none of the engine's work: the driver's scheduling and
the control plane (unless overlapped by async scheduling) and the worker's per-step host work.
The headline metric is the configuration with both graphs and async scheduling; all four are printed
and recorded with suffixes, side by side from one run.

  python -m benchmarks.e2e.bench_decode_idle                     # H200: Qwen3-0.6B shape, batch 256
  python -m benchmarks.e2e.bench_decode_idle --smoke             # CPU plumbing check (tiny model, no timing)
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from benchmarks.common import make_random_model, record

CONFIGS = {  # name -> (CUDA graphs, async scheduling)
    "eager_sync": (False, False),
    "eager_async": (False, True),
    "graphs_sync": (True, False),
    "graphs_async": (True, True),
}


def idle_stats(steps: list[dict], batch: int) -> dict:
    """Idle fraction over the consecutive decode steps that ran the full batch."""
    decode = [s["num_reqs"] == s["num_tokens"] == batch for s in steps]
    gaps, busy = [], []
    for i in range(1, len(steps)):
        if decode[i] and decode[i - 1] and steps[i]["gap_ms"] is not None:
            gaps.append(steps[i]["gap_ms"])
            busy.append(steps[i]["busy_ms"])
    if not gaps:
        raise RuntimeError(f"no consecutive decode steps at batch {batch} were timed ({len(steps)} steps)")
    total = sum(gaps) + sum(busy)
    return {
        "idle_frac": sum(gaps) / total,
        "decode_steps": len(gaps),
        "gap_ms_p50": statistics.median(gaps),
        "busy_ms_p50": statistics.median(busy),
        "decode_tok_s": batch * len(gaps) / (total / 1e3),
    }


def random_prompts(n: int, length: int, smoke: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    vocab = 200 if smoke else 100_000
    return [{"prompt_token_ids": rng.integers(3, vocab, length).tolist()} for _ in range(n)]


def timed_decode(llm: Any, prompts: list[dict], warm: int, output_len: int) -> tuple[Any, ...]:
    """Warm up on the first `warm` prompts, then generate all of them with rank 0 of replica 0 timing
    its steps. Returns (outputs, seconds, timed steps, host phases); shuts the LLM down."""
    import ray

    from cluster import SamplingParams

    try:
        # Warm-up: Triton compiles its kernel variants, cuBLAS picks algorithms, graphs are captured.
        llm.generate(prompts[:warm], SamplingParams(max_tokens=8, ignore_eos=True))
        driver = llm.engines.drivers[0]
        timing = ray.get(driver.worker_call.remote(0, "start_step_timing"))
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True))
        elapsed = time.perf_counter() - t0
        phases = ray.get(driver.worker_call.remote(0, "collect_host_phases")) if timing else []
        steps = ray.get(driver.worker_call.remote(0, "collect_step_timing")) if timing else []
    finally:
        llm.shutdown()
    return outs, elapsed, steps, phases


def run_config(model_dir: str, name: str, args: argparse.Namespace) -> dict:
    from cluster import LLM

    graphs, async_on = CONFIGS[name]
    device = "cpu" if args.smoke else "cuda"
    extra = (
        {"dtype": "float32", "cpu_kv_cache_gib": 0.05}
        if args.smoke
        else {"dtype": "bfloat16", "gpu_memory_utilization": args.gpu_memory_utilization}
    )
    llm = LLM(
        model=model_dir,
        device=device,
        max_model_len=args.prompt_len + args.output_len + 16,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(args.max_num_batched_tokens, args.batch),
        enable_prefix_caching=False,
        enforce_eager=not graphs,
        async_scheduling=async_on,
        transport="compiled_graph",
        **extra,
    )
    outs, elapsed, steps, phases = timed_decode(
        llm, random_prompts(args.batch, args.prompt_len, args.smoke), args.batch, args.output_len
    )
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == args.batch * args.output_len, f"{name}: {n_out} tokens"
    res = {"config": name, "output_tok_s": n_out / elapsed}
    if steps:
        res.update(idle_stats(steps, args.batch))
    for key in ("prepare_ms", "wait_ms", "complete_ms", "outside_ms"):
        if phases:
            res[key] = statistics.median(p[key] for p in phases)
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--model-dir", default="/tmp/kvray-models")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny-random model, batch 8: plumbing only")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.prompt_len, args.output_len = 8, 8, 6
        model_dir = "tiny-random"
    else:
        model_dir = make_random_model(args.shape, args.model_dir)
    results = [run_config(model_dir, name, args) for name in args.configs.split(",")]
    print(f"{'config':<14}{'idle':>8}{'gap p50 ms':>12}{'busy p50 ms':>13}{'decode tok/s':>14}{'e2e tok/s':>11}")
    for r in results:
        if "idle_frac" in r:
            print(
                f"{r['config']:<14}{r['idle_frac']:>8.3f}{r['gap_ms_p50']:>12.3f}{r['busy_ms_p50']:>13.3f}"
                f"{r['decode_tok_s']:>14.0f}{r['output_tok_s']:>11.0f}"
            )
        else:
            print(f"{r['config']:<14}{'-':>8}{'-':>12}{'-':>13}{'-':>14}{r['output_tok_s']:>11.0f}")
    print(
        "worker host phases per execute_model call, median ms: prepare (entry -> GPU work queued), wait "
        "(-> tokens read back), complete (-> return), outside (return -> next call: transport + driver)"
    )
    for r in results:
        if "prepare_ms" in r:
            print(
                f"  {r['config']:<14} prepare {r['prepare_ms']:.3f}  wait {r['wait_ms']:.3f}  "
                f"complete {r['complete_ms']:.3f}  outside {r['outside_ms']:.3f}"
            )
    if args.smoke:
        return
    for r in results:
        record("bench_decode_idle", f"gpu_idle_frac_decode_{r['config']}", r["idle_frac"], "fraction")
        if r["config"] == "graphs_async":
            record("bench_decode_idle", "gpu_idle_frac_decode", r["idle_frac"], "fraction")


if __name__ == "__main__":
    main()
