"""Offline throughput of the hybrid-attention and mixture-of-experts families: random bf16 weights of a
Qwen3-30B-A3B shape (fused-MoE kernel) and a Gemma-3-12B shape (two KV-cache groups, sliding window),
the ShareGPT-like workload of bench_offline.py (1,000 sequences, ~200 in / ~180 out), EOS ignored.
bench_offline's workload and kvray run are reused as they are; this script only picks the shapes and
records the figures under their names (the start-up log shows the max concurrency).

--num-layers keeps the checkpoint small enough to write to the GPU host's disk (a 48-layer 30B-A3B is
61 GB in bf16); throughput per layer is what the shape decides.

  python -m benchmarks.e2e.bench_families --shape qwen3-30b-a3b --num-layers 16
  python -m benchmarks.e2e.bench_families --shape gemma-3-12b --num-layers 24
  python -m benchmarks.e2e.bench_families --smoke       # CPU: tiny models of both families, 6 short requests
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.common import SHAPES, make_random_model, record

FAMILIES = ("qwen3-30b-a3b", "gemma-3-12b")


def run_smoke(shape: str, model_dir: str) -> None:
    """The same engine path on the CPU: a tiny model of the family, a few short requests."""
    from benchmarks.e2e.bench_offline import make_workload
    from cluster import LLM, SamplingParams

    prompts, out_lens = make_workload("sharegpt", 256)
    prompts = [p[:24] for p in prompts[:6]]
    llm = LLM(
        model=model_dir,
        device="cpu",
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        enable_prefix_caching=False,
    )
    try:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, ignore_eos=True))
        elapsed = time.perf_counter() - t0
    finally:
        llm.shutdown()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n == 8 * len(prompts), f"{shape}: {n} tokens, expected {8 * len(prompts)}"
    print(f"{shape} (tiny, CPU): {len(prompts)} requests, {n} tokens in {elapsed:.1f}s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=FAMILIES, nargs="+", default=list(FAMILIES))
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--model-dir", default="/tmp/kvray-models")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        for shape in args.shape:
            run_smoke(shape, make_random_model(shape, args.model_dir, dtype="float32", tiny=True))
        return 0
    from benchmarks.e2e.bench_offline import make_workload, run_kvray

    # run_kvray reads these of bench_offline's flags; the families run with the engine's defaults otherwise.
    args.idle, args.profile, args.steps_json = False, None, None
    overrides = dict(
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    if args.eager:
        overrides["cudagraph_mode"] = "none"
    for shape in args.shape:
        model_dir = make_random_model(shape, args.model_dir, num_layers=args.num_layers)
        prompts, params = make_workload("sharegpt", SHAPES[shape]["vocab_size"])
        n_in, n_out = sum(map(len, prompts)), sum(p["max_tokens"] for p in params)
        ours = run_kvray(model_dir, prompts, params, overrides, args)
        layers = f"{args.num_layers or SHAPES[shape]['num_hidden_layers']} layers"
        print(
            f"{shape} ({layers}): "
            + ", ".join(f"{k}={v:.4g}" for k, v in ours.items())
            + f" -> {ours['tok_s']:.0f} output tok/s, {(n_in + n_out) / ours['elapsed_s']:.0f} total tok/s",
            flush=True,
        )
        record(
            "bench_families",
            f"offline_{shape.replace('-', '_')}_{args.num_layers or 'all'}l_output_tok_s",
            ours["tok_s"],
            "tok/s",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
