"""Pipeline-parallel greedy correctness on one GPU: PP=2 with both stages on the same GPU (two worker
processes, gpus_per_worker 0.5, activations between stages over gloo through the host) against PP=1,
token for token, with CUDA graphs on (each stage captures its own; the transfers sit outside the graphs).

For each --shapes entry (default: the Llama-3.1-8B shape cut to 4 layers and the Qwen3-0.6B shape, random
weights written by benchmarks/common.make_random_model as bench_offline.py writes them, float32), 16
prompts of random token ids (lengths 20-200), 32 greedy new tokens each (EOS ignored). Each run is a
fresh LLM, shut down (and its GPU memory waited for) before the next starts.

  float32   every sequence must equal PP=1's: exit code 1 otherwise. The PP engine runs its requests in
            PP + 1 smaller batches (the batch queue), so a mismatch can be a float32 near-tie from another
            GEMM shape: the HF logit gap between the two tokens tells (check_tp.py's diagnosis).
  bfloat16  batch shapes change rounding: the share of identical sequences is reported, never failed on.

Also checked: the PP=2 run replayed CUDA graphs (engine stats graph_step_share > 0) unless --eager.

  python -m benchmarks.checks.check_pp                        # one GPU (H100 or H200), a few minutes
  python -m benchmarks.checks.check_pp --dtype bfloat16
  python -m benchmarks.checks.check_pp --smoke                # CPU, tiny-random, PP=1 vs PP=2 (gloo)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from benchmarks.checks.check_tp import TIE_GAP, compare, gpu_used_mib, logit_gaps, make_prompts, wait_gpu_released
from benchmarks.common import SHAPES, generate_greedy, make_random_model, record

DEFAULT_SHAPES = {"llama-3.1-8b": 4, "qwen3-0.6b": None}  # shape -> layers it is cut to (None: all)


def run_engine(
    model_dir: str, pp: int, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[list[list[int]], dict]:
    from cluster import LLM

    extra = (
        {"cpu_kv_cache_gib": 0.05} if args.device == "cpu" else {"gpu_memory_utilization": args.gpu_memory_utilization}
    )
    llm = LLM(
        model=model_dir,
        device=args.device,
        dtype=args.dtype,
        pipeline_parallel_size=pp,
        gpus_per_worker=1.0 if pp == 1 else 1.0 / pp,  # every stage on the one GPU
        max_model_len=max(map(len, prompts)) + args.new_tokens + 16,
        max_num_seqs=max(len(prompts), 1),
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=True,
        enforce_eager=args.eager,
        **extra,
    )
    try:
        tokens, gen_s = generate_greedy_keep(llm, prompts, args.new_tokens, f"PP={pp}")
        stats = llm.stats()[0]
    finally:
        llm.shutdown()
    print(f"  PP={pp}: generate {gen_s:.2f}s", flush=True)
    return tokens, stats


def generate_greedy_keep(llm: Any, prompts: list[list[int]], new_tokens: int, label: str) -> Any:
    """common.generate_greedy without its shutdown (the engine's stats are read after it)."""
    shutdown, llm.shutdown = llm.shutdown, lambda: None
    try:
        return generate_greedy(llm, prompts, new_tokens, label)
    finally:
        llm.shutdown = shutdown


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), choices=sorted(SHAPES))
    p.add_argument("--model-dir", default="/tmp/kvray-models")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8, help="of the GPU, split by the stages")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--min-len", type=int, default=20)
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--no-diagnose", action="store_true", help="skip the HF logit-gap diagnosis of mismatches")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny-random, 6 short prompts, 8 tokens")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    if args.smoke:
        args.device, args.num_prompts, args.min_len, args.max_len, args.new_tokens = "cpu", 6, 10, 60, 8
        args.max_num_batched_tokens, args.eager = 256, True
        from actors.models.loader import resolve_model_dir

        models: list[tuple[str, str, int]] = [("tiny-random", resolve_model_dir("tiny-random"), 256)]
    else:
        models = [
            (
                shape,
                make_random_model(shape, args.model_dir, dtype="float32", num_layers=DEFAULT_SHAPES.get(shape)),
                int(SHAPES[shape]["vocab_size"]),  # type: ignore[call-overload]
            )
            for shape in args.shapes
        ]
    if args.device == "cuda":
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()  # make_random_model built the weights on this process's GPU
    import ray

    if not os.environ.get("RAY_ADDRESS") and not ray.is_initialized():
        from cluster.replicas.placement import start_local_ray

        start_local_ray(num_cpus=max(os.cpu_count() or 1, 4), namespace="kvray")
    strict = args.dtype == "float32"
    ok_all = True
    for shape, model_dir, vocab in models:
        print(f"{shape}: {model_dir} ({args.dtype}), {args.device}, PP=1 vs PP=2 on one device", flush=True)
        prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, vocab)
        baseline = gpu_used_mib() if args.device == "cuda" else None
        ref, _ = run_engine(model_dir, 1, prompts, args)
        if args.device == "cuda":
            wait_gpu_released(baseline)
        got, stats = run_engine(model_dir, 2, prompts, args)
        if args.device == "cuda":
            wait_gpu_released(baseline)
        c = compare(2, ref, got)
        print(f"  PP=2 vs PP=1: {c.identical}/{c.total} sequences identical")
        for req, pos, want, other in c.mismatches[:4]:
            print(f"  first mismatch of request {req}: position {pos}, PP=1 token {want}, PP=2 token {other}")
        ok = c.all_equal
        if strict and not ok and not args.no_diagnose:
            gaps = logit_gaps(model_dir, prompts, ref, c.mismatches, args.device)
            # logit_gaps diagnoses only the first few mismatches: the rest are not printed.
            for (req, pos, _want, _got), g in zip(c.mismatches, gaps, strict=False):
                near = g is not None and abs(g) < TIE_GAP
                print(f"  request {req} pos {pos}: HF fp32 logit gap {g}: {'a near-tie' if near else 'NOT a near-tie'}")
        share = float(stats.get("graph_step_share", 0.0))
        graphs_ok = args.eager or args.device != "cuda" or share > 0
        print(f"  PP=2 CUDA graph step share {share:.2f}{'' if graphs_ok else ' (expected > 0: graphs did not run)'}")
        ok_all &= (ok or not strict) and graphs_ok
        if not args.smoke:
            sfx = "" if strict else "_bf16"
            record("check_pp", f"pp2_seq_match_frac_{shape}{sfx}", c.identical / max(c.total, 1), "fraction")
            record("check_pp", f"pp2_graph_step_share_{shape}{sfx}", share, "fraction")
    print(f"PP greedy check ({args.dtype}): {'PASS' if ok_all else 'FAIL'} ({time.perf_counter() - t_start:.1f}s)")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
