"""Tensor-parallel greedy correctness: the same prompts at TP=1 and at each TP in --tp, token for token.

One random-weight model (default: the Llama-3.1-8B shape cut to 4 layers, float32), 16 prompts of random
token ids (lengths 20-200), 32 greedy new tokens each (EOS ignored). Each configuration is a fresh LLM,
shut down (and its GPU memory waited for) before the next starts.

  float32   every sequence must equal TP=1's, token for token: exit code 1 otherwise. A mismatch prints
            the request, position and both tokens, and the float32 logit gap between those two tokens
            (HF transformers on the TP=1 prefix): a gap near 0 is a numerical near-tie, not a TP bug.
  bfloat16  rounding differs between TP sizes, so sequences may diverge: the share of identical
            sequences and where they first diverge are reported, never failed on.

--gpus-per-worker 0.5 (default) puts both TP=2 ranks on ONE GPU (two actors, gloo collectives on CUDA
tensors, CUDA graphs off); --gpus-per-worker 1 gives every rank its own GPU (NCCL, CUDA graphs on) and
records under "multigpu" instead of "check_tp". Ranks sharing a GPU each size their KV cache within
their share (gpus_per_worker) of gpu_memory_utilization of the GPU (actors/worker/model_runner.py
determine_num_blocks).

  python -m benchmarks.checks.check_tp                                   # H200: TP=1 vs TP=2 on one GPU (gloo)
  python -m benchmarks.checks.check_tp --dtype bfloat16
  python -m benchmarks.checks.check_tp --gpus-per-worker 1 --tp 2,4      # a multi-GPU host (NCCL)
  python -m benchmarks.checks.check_tp --smoke                           # CPU, tiny-random, TP=1 vs TP=2 (gloo)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.common import SHAPES, generate_greedy, make_random_model, record

TIE_GAP = 1e-3  # float32 logit gap between the two diverging tokens below which a mismatch is a near-tie


# ---- GPU memory release between runs -------------------------------------------------------------
def gpu_used_mib() -> int | None:
    """Memory in use on all GPUs as nvidia-smi sees it (every process), or None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.check_output(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], text=True, timeout=20
        )
        return sum(int(x) for x in out.split())
    except (OSError, subprocess.SubprocessError, ValueError):  # no reading (missing tool, timeout, odd output)
        return None


def wait_gpu_released(baseline_mib: int | None, timeout_s: float = 90.0) -> None:
    """Worker actors exit asynchronously after shutdown; the next engine sizes its KV cache from the
    memory it sees free, so wait until the previous engine's memory is back (within 2 GiB of baseline)."""
    if baseline_mib is None:
        time.sleep(3.0)
        return
    t0 = time.perf_counter()
    used = gpu_used_mib()
    while used is not None and used > baseline_mib + 2048 and time.perf_counter() - t0 < timeout_s:
        time.sleep(1.0)
        used = gpu_used_mib()
    print(
        f"  GPU memory in use after shutdown: {used} MiB (baseline {baseline_mib} MiB, waited "
        f"{time.perf_counter() - t0:.1f}s)",
        flush=True,
    )


# ---- workload and runs ---------------------------------------------------------------------------
def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, min(vocab, 100_000), int(k)).tolist() for k in rng.integers(lo, hi + 1, n)]


def run_engine(
    model_dir: str, tp: int, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[list[list[int]], float]:
    from cluster import LLM

    extra = (
        {"cpu_kv_cache_gib": 0.05} if args.device == "cpu" else {"gpu_memory_utilization": args.gpu_memory_utilization}
    )
    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir,
        device=args.device,
        dtype=args.dtype,
        tensor_parallel_size=tp,
        gpus_per_worker=args.gpus_per_worker,
        max_model_len=max(map(len, prompts)) + args.new_tokens + 16,
        max_num_seqs=max(len(prompts), 1),
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        enforce_eager=args.eager,
        **extra,
    )
    info = llm.engines.info if llm.engines is not None else {}
    t1 = time.perf_counter()
    tokens, gen_s = generate_greedy(llm, prompts, args.new_tokens, f"TP={tp}")
    print(f"  TP={tp}: start {t1 - t0:.1f}s, generate {gen_s:.2f}s, info {info}", flush=True)
    return tokens, gen_s


@dataclass
class Comparison:
    tp: int
    identical: int = 0
    total: int = 0
    first_div: list[int] = field(default_factory=list)  # per diverging request: its first position
    prefix_fracs: list[float] = field(default_factory=list)  # per request: share of tokens before divergence
    mismatches: list[tuple[int, int, int, int]] = field(default_factory=list)  # (request, pos, ref, got)

    @property
    def all_equal(self) -> bool:
        return self.identical == self.total


def compare(tp: int, ref: list[list[int]], got: list[list[int]]) -> Comparison:
    c = Comparison(tp, total=len(ref))
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        pos = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if pos is None and len(a) == len(b):
            c.identical += 1
            c.prefix_fracs.append(1.0)
        else:
            pos = min(len(a), len(b)) if pos is None else pos
            c.first_div.append(pos)
            c.prefix_fracs.append(pos / max(len(a), 1))
            c.mismatches.append((i, pos, a[pos] if pos < len(a) else -1, b[pos] if pos < len(b) else -1))
    return c


def logit_gaps(
    model_dir: str, prompts: Any, ref: Any, mismatches: Any, device: str, limit: int = 4
) -> list[float | None]:
    """float32 logit(ref token) - logit(other token) at each of the first `limit` mismatches, from HF
    transformers on the prompt plus TP=1's tokens before the mismatch."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    except (OSError, ValueError, RuntimeError, ImportError) as e:  # unreadable weights, no memory: a diagnosis only
        print(f"  (no HF diagnosis: {type(e).__name__}: {e})")
        return [None] * len(mismatches[:limit])
    gaps: list[float | None] = []
    with torch.no_grad():
        for req, pos, want, got in mismatches[:limit]:
            ids = torch.tensor([prompts[req] + ref[req][:pos]], device=device)
            logits = model(input_ids=ids).logits[0, -1].float()
            gaps.append(float(logits[want] - logits[got]) if got >= 0 else None)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return gaps


def report(c: Comparison, strict: bool) -> None:
    n_tok = len(c.prefix_fracs)
    line = (
        f"TP={c.tp} vs TP=1: {c.identical}/{c.total} sequences identical, mean share of tokens before "
        f"the first divergence {sum(c.prefix_fracs) / max(n_tok, 1):.3f}"
    )
    if c.first_div:
        fd = sorted(c.first_div)
        line += f", first-divergence positions (sorted) {fd}"
    print(line)
    for req, pos, want, got in c.mismatches[: 4 if strict else 2]:
        print(f"  first mismatch of request {req}: position {pos}, TP=1 token {want}, TP={c.tp} token {got}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--num-layers", type=int, default=4, help="cut the shape to this many layers")
    p.add_argument("--model-dir", default="/tmp/kvray-models")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the dtype kvray runs in (the checkpoint is written in float32)",
    )
    p.add_argument("--tp", default="2", help="comma-separated TP sizes compared against TP=1")
    p.add_argument(
        "--gpus-per-worker", type=float, default=0.5, help="< 1: ranks share one GPU (gloo); 1: a GPU per rank (NCCL)"
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.85,
        help="of each GPU; ranks sharing one split it by gpus_per_worker",
    )
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--min-len", type=int, default=20)
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs at any TP size")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--no-diagnose", action="store_true", help="skip the HF logit-gap diagnosis of mismatches")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny-random, 6 short prompts, 8 tokens")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    tps = sorted({int(x) for x in args.tp.split(",") if x.strip()} - {1})
    if args.smoke:
        args.device, args.num_prompts, args.min_len, args.max_len, args.new_tokens = "cpu", 6, 10, 60, 8
        args.max_num_batched_tokens = 256
        from actors.models.loader import resolve_model_dir

        model_dir, vocab = resolve_model_dir("tiny-random"), 256  # written on first use
    else:
        model_dir = make_random_model(args.shape, args.model_dir, dtype="float32", num_layers=args.num_layers)
        vocab = SHAPES[args.shape]["vocab_size"]
    if args.device == "cuda":
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()  # make_random_model built the weights on this process's GPU
    import ray

    if not os.environ.get("RAY_ADDRESS") and not ray.is_initialized():
        # One local Ray for every run (LLM would start and stop one per run); workers take a CPU each
        # on the CPU, none on the GPU.
        from cluster.replicas.placement import start_local_ray

        start_local_ray(num_cpus=max(os.cpu_count() or 1, max(tps + [1]) + 2), namespace="kvray")
    strict = args.dtype == "float32"
    backend = "gloo" if args.device == "cpu" or args.gpus_per_worker < 1 else "nccl"
    print(
        f"model {model_dir} ({args.dtype}), device {args.device}, TP 1 vs {tps}, gpus_per_worker "
        f"{args.gpus_per_worker:g} ({backend}), {args.num_prompts} prompts of {args.min_len}-{args.max_len} "
        f"tokens, {args.new_tokens} greedy new tokens",
        flush=True,
    )

    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, vocab)
    baseline = gpu_used_mib() if args.device == "cuda" else None
    ref, ref_s = run_engine(model_dir, 1, prompts, args)
    if args.device == "cuda":
        wait_gpu_released(baseline)
    results: list[Comparison] = []
    timings = {1: ref_s}
    for tp in tps:
        got, timings[tp] = run_engine(model_dir, tp, prompts, args)
        if args.device == "cuda":
            wait_gpu_released(baseline)
        results.append(compare(tp, ref, got))

    print()
    for c in results:
        report(c, strict)
    ok = all(c.all_equal for c in results)
    gaps_all: list[float] = []
    if strict and not ok and not args.no_diagnose:
        for c in results:
            if c.mismatches:
                gaps = logit_gaps(model_dir, prompts, ref, c.mismatches, args.device)
                for (req, pos, _want, _got), g in zip(c.mismatches, gaps, strict=False):
                    kind = (
                        "a near-tie (numerical)"
                        if g is not None and abs(g) < TIE_GAP
                        else "NOT a near-tie: a likely TP bug"
                    )
                    print(f"  TP={c.tp} request {req} pos {pos}: HF fp32 logit gap ref-other = {g}: {kind}")
                    if g is not None:
                        gaps_all.append(abs(g))
    elapsed = time.perf_counter() - t_start
    if strict:
        print(f"TP greedy check ({args.dtype}): {'PASS' if ok else 'FAIL'} ({elapsed:.1f}s)")
    else:
        print(
            f"TP greedy comparison ({args.dtype}, divergence allowed): "
            f"{sum(c.identical for c in results)}/{sum(c.total for c in results)} sequences identical "
            f"({elapsed:.1f}s)"
        )
    if not args.smoke:
        script = "multigpu" if args.gpus_per_worker >= 1 else "check_tp"
        sfx = "" if strict else "_bf16"
        record(script, "tp_greedy_match" + sfx, 1.0 if ok else 0.0, "bool")
        for c in results:
            record(script, f"tp{c.tp}_seq_match_frac{sfx}", c.identical / max(c.total, 1), "fraction")
            record(
                script, f"tp{c.tp}_mean_prefix_frac{sfx}", sum(c.prefix_fracs) / max(len(c.prefix_fracs), 1), "fraction"
            )
            record(script, f"tp{c.tp}_generate_s{sfx}", timings[c.tp], "s")
        if gaps_all:
            record(script, "tp_mismatch_max_abs_logit_gap", max(gaps_all), "logit")
    return 0 if ok or not strict else 1


if __name__ == "__main__":
    sys.exit(main())
