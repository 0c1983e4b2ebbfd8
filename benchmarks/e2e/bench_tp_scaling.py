"""Decode throughput against the tensor-parallel size, side by side in one run ([multigpu]).

The Llama-3.1-8B shape (bf16, random weights) decodes a full batch (256 prompts of 128 tokens, 256 new
tokens each, greedy, EOS ignored) at TP = 1, 2, 4 and DP=2 x TP=2, as far as the host's GPUs allow, with
NCCL (one GPU per worker actor), CUDA graphs and async scheduling. Decode throughput comes from the
CUDA events rank 0 records around each step (bench_decode_idle.idle_stats: the steps at the full batch,
their busy time and the gaps between them); DP rows report the whole group's output tok/s.

  python -m benchmarks.e2e.bench_tp_scaling                   # GPU host; records under results/multigpu.jsonl
  python -m benchmarks.e2e.bench_tp_scaling --smoke           # CPU, tiny-random, TP 1 and 2 over gloo
"""

from __future__ import annotations

import argparse

from benchmarks.common import make_random_model, record
from benchmarks.e2e.bench_decode_idle import idle_stats, random_prompts, timed_decode

LAYOUTS = [(1, 1), (2, 1), (4, 1), (2, 2)]  # (tensor_parallel_size, data_parallel_size)


def run_layout(model_dir: str, tp: int, dp: int, args: argparse.Namespace) -> dict:
    from cluster import LLM

    device = "cpu" if args.smoke else "cuda"
    extra = (
        {"dtype": "float32", "cpu_kv_cache_gib": 0.05}
        if args.smoke
        else {"dtype": "bfloat16", "gpu_memory_utilization": 0.85, "async_scheduling": True}
    )
    llm = LLM(
        model=model_dir,
        device=device,
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        max_model_len=args.prompt_len + args.output_len + 16,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(8192, args.batch),
        enable_prefix_caching=False,
        **extra,
    )
    outs, elapsed, steps, _ = timed_decode(
        llm, random_prompts(args.batch * dp, args.prompt_len, args.smoke), args.batch, args.output_len
    )
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"tp": tp, "dp": dp, "output_tok_s": n_out / elapsed}
    if steps:
        res.update(idle_stats(steps, args.batch))
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--model-dir", default="/tmp/kvray-models")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny-random, TP 1 and 2 over gloo, batch 8")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.prompt_len, args.output_len = 8, 8, 6
        model_dir, num_gpus = "tiny-random", 2
    else:
        import torch

        model_dir, num_gpus = make_random_model(args.shape, args.model_dir), torch.cuda.device_count()
    layouts = [(tp, dp) for tp, dp in LAYOUTS if tp * dp <= num_gpus and not (args.smoke and dp > 1)]
    results = [run_layout(model_dir, tp, dp, args) for tp, dp in layouts]
    base = results[0].get("decode_tok_s")
    print(f"{'layout':<10}{'decode tok/s':>14}{'speedup':>9}{'busy p50 ms':>13}{'idle':>7}{'e2e tok/s':>11}")
    for r in results:
        name = f"TP{r['tp']}" + (f"xDP{r['dp']}" if r["dp"] > 1 else "")
        dec = r.get("decode_tok_s")
        speed = f"{dec / base:.2f}" if dec and base else "-"
        print(
            f"{name:<10}{dec or 0:>14.0f}{speed:>9}{r.get('busy_ms_p50', 0):>13.3f}"
            f"{r.get('idle_frac', 0):>7.3f}{r['output_tok_s']:>11.0f}"
        )
    if args.smoke:
        return
    for r in results:
        name = f"tp{r['tp']}" + (f"_dp{r['dp']}" if r["dp"] > 1 else "")
        record("multigpu", f"{name}_output_tok_s", r["output_tok_s"], "tok/s")
        if r["dp"] == 1 and "decode_tok_s" in r:
            record("multigpu", f"{name}_decode_tok_s", r["decode_tok_s"], "tok/s")
            if r["tp"] > 1 and base:
                record("multigpu", f"tp{r['tp']}_decode_speedup", r["decode_tok_s"] / base, "x")


if __name__ == "__main__":
    main()
