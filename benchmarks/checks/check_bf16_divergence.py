"""How far kvray's bfloat16 greedy output follows HF transformers in float32, with HF's own bfloat16 as the
noise baseline.

One random-weight Qwen3-0.6B-shaped checkpoint (written in float32), 32 prompts of random token ids
(64-256 tokens), 128 greedy new tokens each, EOS ignored. Four runs on the same prompts:

  hf_fp32     the reference: HF generate, greedy, float32
  hf_bf16     HF generate in bfloat16: how much bf16 rounding alone moves greedy decoding
  kvray_fp32  must be identical to hf_fp32 (a divergence where HF's top-2 logit margin is clearly above
              float32 noise is reported as a likely bug)
  kvray_bf16  the figure of interest: compare its row with hf_bf16's

HF generates without padding: the prompts come in groups of equal length (--length-groups), each group
one batch, so every sequence is exactly greedy with no pad tokens or attention-mask effects. For each
run against hf_fp32: the share of identical sequences; the first-divergence position (a sequence that
never diverges counts as --new-tokens) as median, min and 10th percentile; the mean share of tokens
before the first divergence; and HF fp32's top-1/top-2 logit margin where the divergence happened.

  python -m benchmarks.checks.check_bf16_divergence            # H200, about 2 minutes
  python -m benchmarks.checks.check_bf16_divergence --smoke    # CPU, tiny-random, 4 prompts, 8 tokens
  python -m benchmarks.checks.check_bf16_divergence --shape gemma-3-12b --num-layers 12   # the new families likewise
  python -m benchmarks.checks.check_bf16_divergence --smoke --shape qwen3-30b-a3b         # CPU, a tiny Qwen3-MoE
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from benchmarks.checks.check_tp import gpu_used_mib, wait_gpu_released
from benchmarks.common import SHAPES, generate_greedy, hf_greedy_by_length, make_random_model, record

TIE_MARGIN = 1e-3  # an HF fp32 top-2 margin below this is within float32 noise of a tie


def make_prompts(n: int, groups: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts in `groups` groups of equal length (consecutive), lengths uniform in [lo, hi]."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, groups)
    per = -(-n // groups)
    return [rng.integers(0, min(vocab, 100_000), int(lens[i // per])).tolist() for i in range(n)]


# ---- HF transformers ---------------------------------------------------------------------------
def run_hf(
    model_dir: str, prompts: list[list[int]], new_tokens: int, dtype: str, device: str, want_margins: bool
) -> tuple[list[list[int]], list[list[float]], float]:
    """Greedy continuations, one batch per group of equal-length prompts (no padding); with
    want_margins also every step's top-1 minus top-2 logit."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    tokens: list[list[int]] = [[] for _ in prompts]
    margins: list[list[float]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    for i, out, prompt_len in hf_greedy_by_length(model, prompts, new_tokens, device, want_margins):
        seqs = out.sequences[:, prompt_len:].tolist()
        for k, seq in enumerate(seqs):
            tokens[i + k] = seq
        if want_margins:
            top2 = torch.stack([step.float().topk(2, dim=-1).values for step in out.logits], dim=1)  # b,t,2
            for k, gaps in enumerate((top2[..., 0] - top2[..., 1]).tolist()):
                margins[i + k] = gaps
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    del model, out
    if device == "cuda":
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    return tokens, margins, elapsed


# ---- kvray -------------------------------------------------------------------------------------
def run_kvray(
    model_dir: str, prompts: list[list[int]], new_tokens: int, dtype: str, args: argparse.Namespace
) -> tuple[list[list[int]], float]:
    from cluster import LLM

    extra = (
        {"cpu_kv_cache_gib": 0.05} if args.device == "cpu" else {"gpu_memory_utilization": args.gpu_memory_utilization}
    )
    llm = LLM(
        model=model_dir,
        device=args.device,
        dtype=dtype,
        tensor_parallel_size=1,
        max_model_len=max(map(len, prompts)) + new_tokens + 16,
        max_num_seqs=max(len(prompts), 1),
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        **extra,
    )
    return generate_greedy(llm, prompts, new_tokens, f"kvray {dtype}")


# ---- comparison --------------------------------------------------------------------------------
@dataclass
class Divergence:
    name: str
    identical_frac: float
    first_div: np.ndarray  # per sequence; new_tokens where it never diverges
    prefix_frac_mean: float
    margins_at_div: list[float]  # reference margin at each diverging sequence's first divergence

    def row(self) -> str:
        fd = self.first_div
        m = f"{np.median(self.margins_at_div):.2e}" if self.margins_at_div else "-"
        return (
            f"{self.name:<24}{self.identical_frac:>10.3f}{np.median(fd):>9.1f}{fd.min():>6d}"
            f"{np.percentile(fd, 10):>7.1f}{self.prefix_frac_mean:>10.3f}{m:>13}"
        )


HEADER = f"{'run vs reference':<24}{'identical':>10}{'median':>9}{'min':>6}{'p10':>7}{'prefix':>10}{'margin@div':>13}"


def diverge(name: str, ref: list[list[int]], got: list[list[int]], margins: list[list[float]], n: int) -> Divergence:
    first = []
    at_div = []
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        pos = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if pos is None:
            pos = n if len(a) == len(b) == n else min(len(a), len(b))
        first.append(pos)
        if pos < n and margins and margins[i] and pos < len(margins[i]):
            at_div.append(margins[i][pos])
    fd = np.array(first, dtype=np.int64)
    return Divergence(name, float(np.mean(fd == n)), fd, float(np.mean(fd / n)), at_div)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--model-dir", default="/tmp/kvray-models")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--length-groups", type=int, default=4, help="prompts come in this many equal-length groups")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--num-layers", type=int, default=None, help="fewer layers than the shape has")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, 4 prompts, 8 new tokens: tiny-random, or a tiny model of --shape's family if given",
    )
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    if args.smoke:
        from actors.models.loader import resolve_model_dir

        args.device, args.num_prompts, args.length_groups = "cpu", 4, 2
        args.min_len, args.max_len, args.new_tokens, args.max_num_batched_tokens = 16, 40, 8, 256
        model_dir, vocab = resolve_model_dir("tiny-random"), 256
        if args.shape != "qwen3-0.6b":
            model_dir = make_random_model(args.shape, args.model_dir, dtype="float32", tiny=True)
    else:
        model_dir = make_random_model(args.shape, args.model_dir, dtype="float32", num_layers=args.num_layers)
        vocab = SHAPES[args.shape]["vocab_size"]
    n = args.new_tokens
    prompts = make_prompts(args.num_prompts, args.length_groups, args.min_len, args.max_len, vocab)
    print(
        f"model {model_dir}, device {args.device}, {len(prompts)} prompts of lengths "
        f"{sorted(set(map(len, prompts)))}, {n} greedy new tokens",
        flush=True,
    )

    hf32, margins, t_hf32 = run_hf(model_dir, prompts, n, "float32", args.device, want_margins=True)
    print(
        f"hf_fp32: {t_hf32:.1f}s; HF fp32 top-2 margins: median {np.median(sum(margins, [])):.3f}, "
        f"min {min(sum(margins, [])):.2e}",
        flush=True,
    )
    hf16, _, t_hf16 = run_hf(model_dir, prompts, n, "bfloat16", args.device, want_margins=False)
    print(f"hf_bf16: {t_hf16:.1f}s", flush=True)
    import ray

    if not os.environ.get("RAY_ADDRESS") and not ray.is_initialized():
        from cluster.replicas.placement import start_local_ray  # one local Ray for both kvray runs

        start_local_ray(num_cpus=max(os.cpu_count() or 1, 3), namespace="kvray")
    baseline = gpu_used_mib() if args.device == "cuda" else None
    kv32, t_kv32 = run_kvray(model_dir, prompts, n, "float32", args)
    print(f"kvray_fp32: {t_kv32:.1f}s", flush=True)
    if args.device == "cuda":
        wait_gpu_released(baseline)  # the workers exit asynchronously; the next run sizes its KV cache
    kv16, t_kv16 = run_kvray(model_dir, prompts, n, "bfloat16", args)
    print(f"kvray_bf16: {t_kv16:.1f}s", flush=True)

    rows = [
        diverge("hf_bf16 vs hf_fp32", hf32, hf16, margins, n),
        diverge("kvray_fp32 vs hf_fp32", hf32, kv32, margins, n),
        diverge("kvray_bf16 vs hf_fp32", hf32, kv16, margins, n),
    ]
    extra = diverge("kvray_bf16 vs hf_bf16", hf16, kv16, [], n)
    print(
        f"\nfirst-divergence positions over {len(prompts)} sequences of {n} tokens (never = {n}); "
        f"prefix = mean share of tokens before it; margin@div = median HF fp32 top-2 margin there"
    )
    print(HEADER)
    for r in rows + [extra]:
        print(r.row())

    kv = rows[1]
    bad = [(i, int(pos)) for i, pos in enumerate(kv.first_div) if pos < n]
    real = [(i, pos) for i, pos in bad if margins[i][pos] >= TIE_MARGIN]
    if not bad:
        print("\nkvray fp32 == HF fp32: every sequence identical, token for token")
    else:
        print(
            f"\n!!! kvray fp32 DIFFERS from HF fp32 in {len(bad)}/{len(prompts)} sequences "
            f"(request, position, HF fp32 margin there): "
            f"{[(i, pos, float(f'{margins[i][pos]:.3g}')) for i, pos in bad[:8]]}"
        )
        if real:
            print(
                f"!!! {len(real)} of them where HF's top-2 margin is >= {TIE_MARGIN:g}: NOT a float32 near-tie, "
                f"likely a kvray bug !!!"
            )
        else:
            print(f"    (all at HF top-2 margins below {TIE_MARGIN:g}: float32 near-ties, not a bug)")
    print(f"total {time.perf_counter() - t_start:.1f}s")
    if not args.smoke:
        # The original shape keeps its metric names; the others carry theirs.
        pre = "" if args.shape == "qwen3-0.6b" else args.shape.replace("-", "_").replace(".", "p") + "_"
        for r, tag in zip(rows, [pre + "hf_bf16", pre + "kvray_fp32", pre + "kvray_bf16"], strict=True):
            record("bf16_divergence", f"{tag}_identical_frac", r.identical_frac, "fraction")
            record("bf16_divergence", f"{tag}_first_div_median", float(np.median(r.first_div)), "tokens")
            record("bf16_divergence", f"{tag}_first_div_p10", float(np.percentile(r.first_div, 10)), "tokens")
            record("bf16_divergence", f"{tag}_prefix_frac_mean", r.prefix_frac_mean, "fraction")
        record("bf16_divergence", pre + "kvray_fp32_matches_hf", 1.0 if not bad else 0.0, "bool")
    return 1 if real else 0


if __name__ == "__main__":
    sys.exit(main())
