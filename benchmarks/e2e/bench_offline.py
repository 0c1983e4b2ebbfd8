"""Offline throughput: the engine defaults against hand-tuned configurations, side by side in one run.

Workloads (random bf16 weights, EOS ignored):
  nano      nano-vllm's bench.py exactly: random.seed(0); 256 sequences; prompt ids randint(0, 10000),
            prompt lengths randint(100, 1024); max_tokens randint(100, 1024), temperature 0.6;
            throughput = sum(max_tokens) / wall time of one generate() after a warm-up (Qwen3-0.6B shape)
  sharegpt  1,000 sequences, log-normal lengths of about 200 in / 180 out, greedy (Llama-3.1-8B shape)
  small     256 sequences, prompt and output lengths uniform in [100, 1024], greedy

Configs (--configs, each one LLM after the other on the same prompts):
  defaults  LLM(model=..., device="cuda") and nothing else
  tuned     + async scheduling on, admission 32/32, prefix caching off, max_model_len 4096
  admit1    defaults admitting every request at once (admission_min_batch 1)
  eager     defaults with cudagraph_mode none        decode: defaults with cudagraph_mode decode
  no_prefix_cache, len4096   defaults with prefix caching off / max_model_len 4096 (the two halves of tuned)
  cap512, cap2048   defaults with mixed steps above 512 / 2048 tokens eager (model.cudagraph_max_tokens)
  big, big_cap512   max_num_seqs 512, max_num_batched_tokens 16384 (vLLM's offline defaults on big GPUs)
  shm, compiled_graph   defaults with that step transport (ray.transport)
  fp8kv, fp8w, fp8   defaults with the KV cache, the linear weights, or both in fp8 (kv_cache_dtype /
            quantization "fp8"; other numerics, so not counted in defaults_vs_best_ratio)
--idle times every step of every config with CUDA events and prints where the GPU time went.
Records offline_<tag>_output_tok_s (defaults), offline_<tag>_<config>_tok_s, graph_step_share_<tag>,
gpu_idle_frac_all_steps (defaults; CUDA events around every step's GPU work), defaults_vs_best_ratio.
--kvray-run also runs `kvray run` on the same workload as JSON lines (kvray_run_vs_api_ratio).

  python -m benchmarks.e2e.bench_offline --shape qwen3-0.6b --workload nano --configs defaults tuned
  python -m benchmarks.e2e.bench_offline --shape llama-3.1-8b --workload sharegpt --configs defaults tuned
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import SHAPES, make_random_model, record

TAGS = {"qwen3-0.6b": "qwen3_0p6b", "llama-3.1-8b": "llama8b"}
CONFIGS = {
    "defaults": {},
    "tuned": dict(
        async_scheduling=True,
        admission_min_batch=32,
        admission_max_wait_steps=32,
        enable_prefix_caching=False,
        max_model_len=4096,
    ),
    "admit1": dict(admission_min_batch=1, admission_max_wait_steps=16),
    "no_admission": dict(async_scheduling=True, enable_prefix_caching=False, max_model_len=4096),
    "decode": dict(cudagraph_mode="decode"),
    "eager": dict(cudagraph_mode="none"),
    "no_prefix_cache": dict(enable_prefix_caching=False),
    "len4096": dict(max_model_len=4096),
    "cap512": dict(cudagraph_max_tokens=512),
    "cap2048": dict(cudagraph_max_tokens=2048),
    "big": dict(max_num_seqs=512, max_num_batched_tokens=16384),
    # vLLM's own defaults for LLM() on a GPU of >= 70 GiB that is not an A100 (H100, H200).
    "seqs1024": dict(max_num_seqs=1024, max_num_batched_tokens=16384),
    "big_cap512": dict(max_num_seqs=512, max_num_batched_tokens=16384, cudagraph_max_tokens=512),
    "shm": dict(transport="shm"),
    "compiled_graph": dict(transport="compiled_graph"),
    # vLLM's kv_cache_dtype="fp8": another numerics class, so never the "best" the defaults are held to.
    "fp8kv": dict(kv_cache_dtype="fp8"),
    "fp8w": dict(quantization="fp8"),  # vLLM's quantization="fp8": the dense linear weights in e4m3
    "fp8": dict(quantization="fp8", kv_cache_dtype="fp8"),
}
NUMERICS_CHANGING = {"fp8kv", "fp8w", "fp8"}


def make_workload(kind: str, vocab: int) -> tuple[list[list[int]], list[dict]]:
    """Prompts and per-request sampling fields."""
    if kind == "nano":
        random.seed(0)
        prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
        params = [dict(temperature=0.6, ignore_eos=True, max_tokens=random.randint(100, 1024)) for _ in range(256)]
        return prompts, params
    rng = np.random.default_rng(0)
    if kind == "small":
        n = 256
        in_lens, out_lens = rng.integers(100, 1025, n), rng.integers(100, 1025, n)
    elif kind == "sharegpt":
        n = 1000
        in_lens = np.clip(rng.lognormal(np.log(200) - 0.5, 1.0, n), 4, 2048).astype(int)
        out_lens = np.clip(rng.lognormal(np.log(180) - 0.5, 1.0, n), 4, 2048).astype(int)
    else:
        raise ValueError(f"--workload {kind!r}: must be nano, small or sharegpt")
    prompts = [rng.integers(0, min(vocab, 100_000), int(k)).tolist() for k in in_lens]
    return prompts, [dict(temperature=0.0, ignore_eos=True, max_tokens=int(x)) for x in out_lens]


def run_kvray(model_dir: str, prompts: Any, params: Any, overrides: dict, args: argparse.Namespace) -> dict:
    import ray

    from cluster import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model_dir, device="cuda", **overrides)
    init_s = time.perf_counter() - t0
    try:
        # nano-vllm's warm-up is one short prompt ("Benchmark: "); the random model has no tokenizer.
        llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=16))
        sps = [SamplingParams(**p) for p in params]
        driver = llm.engines.drivers[0]
        before = llm.engines.stats()[0]
        timing = ray.get(driver.worker_call.remote(0, "start_step_timing")) if args.idle else False
        if args.profile:
            ray.get(driver.start_profile.remote(args.profile, args.profile_steps, args.profile_skip))
        mark = len(ray.get(driver.worker_call.remote(0, "compile_events", 0)))
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps)
        elapsed = time.perf_counter() - t0
        print_late_compiles(ray.get(driver.worker_call.remote(0, "compile_events", 0)), mark)
        after = llm.engines.stats()[0]
        steps_timed = ray.get(driver.worker_call.remote(0, "collect_step_timing")) if timing else []
        if args.profile:
            print("profile traces:", ray.get(driver.stop_profile.remote()))
    finally:
        llm.shutdown()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    want = sum(p["max_tokens"] for p in params)
    assert n_out == want, f"kvray produced {n_out} tokens, expected {want}"
    steps = after["num_steps"] - before["num_steps"]
    forward_steps = after.get("num_forward_steps", steps) - before.get("num_forward_steps", 0)
    graph_steps = after.get("num_graph_steps", 0) - before.get("num_graph_steps", 0)
    res = {
        "init_s": init_s,
        "elapsed_s": elapsed,
        "tok_s": want / elapsed,
        "steps": steps,
        "graph_share": graph_steps / max(forward_steps, 1),
        "ms_per_step": elapsed / max(steps, 1) * 1e3,
        "preemptions": after.get("num_preemptions", 0) - before.get("num_preemptions", 0),
        **{k: after[k] for k in ("kv_sizing_s", "kv_init_capture_s") if k in after},
    }
    if steps_timed:
        gaps = [s["gap_ms"] for s in steps_timed if s["gap_ms"] is not None]
        busy = [s["busy_ms"] for s in steps_timed[1:]]
        res["gpu_idle_frac"] = sum(gaps) / max(sum(gaps) + sum(busy), 1e-9)
        print_step_breakdown(steps_timed[1:], kv_bytes_per_token(args.shape, overrides.get("kv_cache_dtype")))
        if args.steps_json:
            Path(args.steps_json).write_text(json.dumps(steps_timed))
    timed = [o.metrics for o in outs if o.metrics is not None and o.metrics.ttft_s is not None]
    if timed:
        res["ttft_p50_ms"] = statistics.median(m.ttft_s for m in timed) * 1e3
        res["tpot_p50_ms"] = (
            statistics.median((m.e2e_s - m.ttft_s) / max(1, m.num_output_tokens - 1) for m in timed) * 1e3
        )
    return res


def print_late_compiles(events: list[dict], mark: int) -> None:
    """The kernel variants compiled in the timed run (the warm-up missed them), each beside the warm-up's
    variants of the same kernel, so that the specialisation that differs can be read off."""
    for e in events[mark:]:
        print(f"compiled in the timed run: {e['kernel']} {e['took_s']:.2f} s\n  {e['signature']}", flush=True)
        for w in events[:mark]:
            if w["kernel"] == e["kernel"]:
                print(f"  warm-up had: {w['signature']}", flush=True)


def kv_bytes_per_token(shape: str, kv_cache_dtype: str | None = None) -> int:
    """Bytes of K and V a cached token holds over all layers: bf16's two a value, or one in an fp8 cache."""
    c = SHAPES[shape]
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    value = 1 if (kv_cache_dtype or "auto").startswith("fp8") else 2
    return 2 * value * c["num_hidden_layers"] * c["num_key_value_heads"] * head


def print_step_breakdown(steps: list[dict], kv_bytes: int = 0) -> None:
    """GPU busy time by step kind: decode steps by batch size, mixed steps by token count; with the KV
    bytes a token holds, the KV bytes each kind's attention read over its busy time (GB/s), the number to
    hold against the device's ~4.3 TB/s."""

    def row(label: str, sel: list[dict]) -> str:
        ms = sum(s["busy_ms"] for s in sel)
        toks = sum(s["num_tokens"] for s in sel)
        kv = sum(s.get("kv_tokens", 0) for s in sel)
        each = [s["busy_ms"] for s in sel] or [0.0]
        line = (
            f"  {label:<22} steps {len(sel):>5}  busy {ms / 1e3:7.2f} s  mean {ms / max(len(sel), 1):7.2f} ms"
            f"  median {statistics.median(each):7.2f}  max {max(each):7.2f}"
            f"  tokens {toks:>8}  {ms / max(toks, 1) * 1e3:7.1f} us/token"
        )
        if kv_bytes and kv and ms:
            line += f"  KV {kv * kv_bytes / 1e9:7.1f} GB at {kv * kv_bytes / (ms * 1e-3) / 1e9:5.0f} GB/s"
        return line

    decode = [s for s in steps if s["num_tokens"] == s["num_reqs"]]
    mixed = [s for s in steps if s["num_tokens"] != s["num_reqs"]]
    lines = ["GPU busy time by step kind:"]
    for lo, hi in ((0, 16), (16, 64), (64, 128), (128, 256), (256, 1 << 30)):
        lines.append(
            row(f"decode {lo + 1}-{hi if hi < 1 << 30 else 'up'} rows", [s for s in decode if lo < s["num_reqs"] <= hi])
        )
    for lo, hi in ((0, 512), (512, 2048), (2048, 8192), (8192, 1 << 30)):
        lines.append(
            row(f"mixed {lo + 1}-{hi if hi < 1 << 30 else 'up'} tok", [s for s in mixed if lo < s["num_tokens"] <= hi])
        )
    print("\n".join(lines), flush=True)


def run_job(model_dir: str, prompts: Any, params: Any, out_dir: Path) -> float:
    """`kvray run --config configs/gpu.yaml` on the same workload as JSON lines; its output tok/s."""
    out_dir.mkdir(parents=True, exist_ok=True)
    inp, outp, summary = out_dir / "in.jsonl", out_dir / "out.jsonl", out_dir / "summary.json"
    with open(inp, "w") as f:
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            f.write(json.dumps({"id": f"r{i}", "prompt_token_ids": p, **sp}) + "\n")
    outp.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "cluster.cli",
        "run",
        "--config",
        "configs/gpu.yaml",
        "--set",
        f"model.model={model_dir}",
        "--input",
        str(inp),
        "--output",
        str(outp),
        "--summary-json",
        str(summary),
        "--no-progress",
    ]
    print("kvray run:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    s = json.loads(summary.read_text())
    print("kvray run summary:", s, flush=True)
    return float(s["output_tok_per_s"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--workload", choices=["nano", "small", "sharegpt"], default="nano")
    ap.add_argument("--model-dir", default="/tmp/kvray-models")
    ap.add_argument("--configs", nargs="+", default=["defaults", "tuned"], choices=sorted(CONFIGS))
    ap.add_argument(
        "--idle",
        action="store_true",
        help="CUDA events around every step (gpu_idle_frac_all_steps, the busy-time breakdown)",
    )
    ap.add_argument("--steps-json", metavar="PATH", help="with --idle: every timed step's record, as JSON")
    ap.add_argument("--kvray-run", action="store_true", help="also `kvray run` on the workload")
    ap.add_argument("--temperature", type=float, help="override the workload's temperature (nano: 0.6, else 0)")
    ap.add_argument(
        "--logprobs",
        type=int,
        metavar="K",
        help="also run the defaults with SamplingParams(logprobs=K), side by side: the throughput cost",
    )
    ap.add_argument("--profile", metavar="DIR", help="torch profiler traces of a few worker steps (defaults run)")
    ap.add_argument("--profile-steps", type=int, default=4)
    ap.add_argument("--profile-skip", type=int, default=40, help="steps of the timed run before the trace")
    args = ap.parse_args(argv)
    os.environ.setdefault("KVRAY_LOG_COMPILES", "1")  # before Ray starts: the workers inherit it

    model_dir = make_random_model(args.shape, args.model_dir)
    prompts, params = make_workload(args.workload, SHAPES[args.shape]["vocab_size"])
    if args.temperature is not None:
        params = [{**p, "temperature": args.temperature} for p in params]
    print(
        f"workload {args.workload}: {len(prompts)} seqs, {sum(map(len, prompts))} prompt tokens, "
        f"{sum(p['max_tokens'] for p in params)} output tokens",
        flush=True,
    )
    tag = TAGS[args.shape]
    results = {}
    for name in args.configs:
        a = argparse.Namespace(
            **{**vars(args), "profile": args.profile if name == "defaults" else None, "idle": args.idle}
        )
        res = run_kvray(model_dir, prompts, params, CONFIGS[name], a)
        results[name] = res
        print(f"kvray [{name}] {CONFIGS[name]}: " + ", ".join(f"{k}={v:.4g}" for k, v in res.items()), flush=True)
        record("bench_offline", f"offline_{tag}_{args.workload}_{name}_tok_s", res["tok_s"], "tok/s")
    headline = f"offline_{tag}_nano_tok_s" if args.workload == "nano" else f"offline_{tag}_output_tok_s"
    if "defaults" in results:
        d = results["defaults"]
        record("bench_offline", headline, d["tok_s"], "tok/s")
        share_tag = "qwen3" if tag == "qwen3_0p6b" else tag
        record("bench_offline", f"graph_step_share_{share_tag}", d["graph_share"], "share")
        record("bench_offline", f"init_s_{tag}_in_bench", d["init_s"], "s")
        if "gpu_idle_frac" in d and args.idle:
            record("bench_offline", "gpu_idle_frac_all_steps", d["gpu_idle_frac"], "share")
        best = max(r["tok_s"] for n, r in results.items() if n not in NUMERICS_CHANGING)
        record("bench_offline", f"defaults_vs_best_ratio_{tag}", d["tok_s"] / best, "x")
        if args.logprobs is not None:
            a = argparse.Namespace(**{**vars(args), "profile": None, "idle": False})
            lp = run_kvray(model_dir, prompts, [{**p, "logprobs": args.logprobs} for p in params], {}, a)
            print(
                f"kvray [defaults, logprobs={args.logprobs}]: {lp['tok_s']:.0f} tok/s "
                f"({lp['tok_s'] / d['tok_s']:.3f} of without)",
                flush=True,
            )
            record("bench_offline", f"offline_{tag}_logprobs{args.logprobs}_output_tok_s", lp["tok_s"], "tok/s")
            record(
                "bench_offline", f"offline_{tag}_logprobs{args.logprobs}_vs_none_ratio", lp["tok_s"] / d["tok_s"], "x"
            )
        if args.kvray_run:
            job = run_job(model_dir, prompts, params, Path("/tmp/kvray-bench-run"))
            record("bench_offline", "kvray_run_vs_api_ratio", job / d["tok_s"], "x")


if __name__ == "__main__":
    main()
