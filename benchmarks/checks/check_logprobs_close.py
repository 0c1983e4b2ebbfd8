"""vLLM's logprobs comparison rule (tests/models/utils.py `check_logprobs_close`): kvray against HF
transformers, greedy, in bfloat16 on the GPU.

For each prompt the two greedy outputs are walked together; while the tokens match nothing is checked.
At the first mismatch kvray's token must be in HF's top-k logprobs at that position AND HF's token in
kvray's top-k; then that sequence stops being compared (its continuations differ). Any other outcome
fails the shape. One refinement over vLLM's dict lookup: a token whose logprob equals the k-th's counts
as inside (bf16 logits tie often, and which of a tie topk keeps is arbitrary).

Both sides greedy (EOS ignored), same random-weight checkpoint, same prompts:

  kvray  LLM.generate, temperature 0, SamplingParams(logprobs=k): the vLLM-shaped per-position dicts
  HF     generate(do_sample=False, output_logits=True), eager attention, no padding (prompts come in
         equal-length groups, one batch each); the top of log_softmax in float32 of every step's logits
         (20 ranks kept: the rule reads the first k, a failure says how far outside them a token was)

With fp8 (--kv-cache-dtype fp8, --quantization fp8) a control runs beside kvray: HF again, with fp8's
rounding applied to its own modules (hf_fp8_rounding.py), held to the same rule against HF bf16. A random
model's next-token distribution is nearly flat, so fp8's rounding alone reorders it; kvray's fp8 is read
against the control (records logprobs_close_control_*: the control against HF bf16;
logprobs_close_vs_control_*: kvray against the control), not against bf16 alone.

Shapes: Llama-3.1-8B, Qwen3-0.6B, Mistral-7B (one sliding window on every layer) and Gemma-3-12B
(hybrid: sliding-window and full-attention layers), at reduced layer counts so that writing the checkpoint
and both runs stay near a minute a shape. Where a shape slides, the prompts straddle its window (lengths
window - new_tokens/2 .. window + 8), so the window is crossed in prefill or in decode.

  python -m benchmarks.checks.check_logprobs_close           # H200, bf16, 8 prompts x 32 tokens, top-5
  python -m benchmarks.checks.check_logprobs_close --shapes gemma-2-2b --num-layers 4
  python -m benchmarks.checks.check_logprobs_close --smoke   # CPU, tiny models of each shape's family, float32
  python -m benchmarks.checks.check_logprobs_close --kv-cache-dtype fp8   # kvray's KV cache in fp8 (metrics *_fp8kv)
  python -m benchmarks.checks.check_logprobs_close --quantization fp8     # kvray's linear weights in fp8 (*_fp8w)

Exit status 1 when any shape fails the rule.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.checks import hf_fp8_rounding
from benchmarks.checks.check_bf16_divergence import make_prompts
from benchmarks.checks.check_tp import gpu_used_mib, wait_gpu_released
from benchmarks.common import SHAPES, hf_greedy_by_length, make_random_model, record, tiny_shape

SCRIPT = "check_logprobs_close"
DEFAULT_SHAPES = ["llama-3.1-8b", "qwen3-0.6b", "mistral-7b", "gemma-3-12b"]
# Layers kept on the GPU: the checkpoint is written on the device, a few GB at most. Gemma-3's 8 hold
# its sixth (global) layer between sliding ones; Qwen3-0.6B is small enough to keep whole.
DEFAULT_LAYERS = {"llama-3.1-8b": 4, "qwen3-0.6b": 28, "mistral-7b": 4, "gemma-3-12b": 8, "gemma-2-2b": 4}
HF_RANKS = 20  # HF's side keeps this many ranks: a failure names how far outside the top-k a token was

# token id -> logprob of one position, best first (insertion order); the rule reads its first k entries,
# a wider dict (HF's) only adds the rank of a token that fell outside them to a failure's message.
TopK = dict[int, float]


# ---- the rule ----------------------------------------------------------------------------------
@dataclass
class SeqCheck:
    index: int
    first_div: int | None  # position of the first mismatch; None: identical
    ok: bool
    reason: str = ""  # at the divergence: each token's rank on the other side; on a failure both top-k
    max_lp_diff: float = 0.0  # |kvray - HF| logprob of the shared token, over the matched positions


def best_first(pairs: Iterable[tuple[int, float]]) -> TopK:
    """(token, logprob) pairs best first, a tie to the lower id: the token argmax (greedy) picks leads
    (topk orders ties arbitrarily, and bf16 logits tie often)."""
    return dict(sorted(pairs, key=lambda p: (-p[1], p[0])))


def _first(top: TopK, k: int) -> TopK:
    return dict(itertools.islice(top.items(), k))


def in_top(top: TopK, token: int, k: int) -> bool:
    """`token` among the first k entries, or tied with the k-th (the same logprob): which of a tie topk
    keeps is arbitrary, so a tie at the boundary counts as inside."""
    first = list(itertools.islice(top.values(), k))
    return token in _first(top, k) or (len(first) == k and token in top and top[token] == first[-1])


def _fmt(top: TopK) -> str:
    return "{" + ", ".join(f"{t}: {lp:.4f}" for t, lp in top.items()) + "}"


def _rank(top: TopK, token: int) -> str:
    """`token`'s rank in a best-first dict, or how far the dict goes."""
    for r, t in enumerate(top, 1):
        if t == token:
            return f"#{r} ({top[t]:.4f})"
    return f"below #{len(top)}"


def check_sequence(
    index: int, kv_tokens: list[int], kv_top: list[TopK], hf_tokens: list[int], hf_top: list[TopK], k: int
) -> SeqCheck:
    """vLLM's check_logprobs_close for one prompt: the first mismatch must have each side's token in the
    other side's top-k (in_top: the first k entries of its best-first dict there, or tied with the k-th);
    the rest is not compared."""
    if len(kv_tokens) != len(hf_tokens):
        return SeqCheck(index, None, False, f"lengths differ: kvray {len(kv_tokens)}, HF {len(hf_tokens)} tokens")
    lp_diff = 0.0
    for pos, (a, b) in enumerate(zip(kv_tokens, hf_tokens, strict=True)):
        kv_at = kv_top[pos] if pos < len(kv_top) else None
        hf_at = hf_top[pos] if pos < len(hf_top) else None
        if a == b:
            if kv_at is not None and hf_at is not None and a in kv_at and a in hf_at:
                lp_diff = max(lp_diff, abs(kv_at[a] - hf_at[a]))
            continue
        where = f"prompt {index}, position {pos}"
        if kv_at is None or hf_at is None:
            return SeqCheck(index, pos, False, f"{where}: no logprobs (kvray {kv_at}, HF {hf_at})", lp_diff)
        problems = []
        if not in_top(hf_at, a, k):
            problems.append(f"kvray's token {a} is not in HF's top-{k} (HF: {_rank(hf_at, a)})")
        if not in_top(kv_at, b, k):
            problems.append(f"HF's token {b} is not in kvray's top-{k} (kvray: {_rank(kv_at, b)})")
        if problems:
            reason = (
                f"{where}: {'; '.join(problems)}; matched tokens {kv_tokens[:pos]}; "
                f"kvray token {a}, top-{k} {_fmt(_first(kv_at, k))}; HF token {b}, top-{k} {_fmt(_first(hf_at, k))}"
            )
            return SeqCheck(index, pos, False, reason, lp_diff)
        note = f"{where}: kvray {a} is HF's {_rank(hf_at, a)}, HF {b} is kvray's {_rank(kv_at, b)}"
        return SeqCheck(index, pos, True, note, lp_diff)
    return SeqCheck(index, None, True, "", lp_diff)


@dataclass
class ShapeReport:
    shape: str
    new_tokens: int
    seqs: list[SeqCheck] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(s.ok for s in self.seqs)

    @property
    def identical(self) -> int:
        return sum(s.first_div is None and s.ok for s in self.seqs)

    @property
    def divergent(self) -> int:
        return len(self.seqs) - self.identical

    def summary(self) -> str:
        divs = sorted(s.first_div for s in self.seqs if s.first_div is not None)
        lp = max((s.max_lp_diff for s in self.seqs), default=0.0)
        return (
            f"{self.shape}: {'PASS' if self.passed else 'FAIL'}; identical {self.identical}/{len(self.seqs)}; "
            f"first divergence at {divs or '-'} (of {self.new_tokens}); max |logprob diff| of the shared "
            f"token before divergence {lp:.2e}"
        )


def kvray_topk(position: dict, k: int) -> TopK:
    """vLLM's per-position dict {token_id: Logprob} -> the top-k by rank (the sampled token, when ranked
    below k, is left out)."""
    return best_first((t, lp.logprob) for t, lp in position.items() if lp.rank is not None and lp.rank <= k)


@dataclass(frozen=True)
class Fp8Rounding:
    """What of HF's model the control rounds to fp8 (benchmarks/checks/hf_fp8_rounding.py)."""

    weights: bool  # the decoder layers' linear weights and inputs (kvray's --quantization fp8)
    kv_cache: bool  # the keys and values entering the cache (kvray's --kv-cache-dtype fp8)


# ---- the runs ----------------------------------------------------------------------------------
def run_hf(
    model_dir: str, prompts: list[list[int]], n: int, k: int, dtype: str, device: str, fp8: Fp8Rounding | None = None
) -> tuple[Any, Any]:
    """Greedy tokens and every step's top log_softmax (float32, HF_RANKS of them, at least k), one batch
    per equal-length group; `fp8`: with fp8's rounding applied to HF's modules (the control)."""
    import torch
    from transformers import AutoModelForCausalLM

    # Eager attention: HF's reference path, and the only one of them that applies Gemma-2's soft-cap.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation="eager")
    model = model.to(device).eval()
    new_cache = None
    if fp8 is not None:
        if fp8.weights:
            hf_fp8_rounding.round_linears(model)
        if fp8.kv_cache:
            new_cache = hf_fp8_rounding.fp8_kv_cache_factory(model)
    tokens: list[list[int]] = []
    tops: list[list[TopK]] = []
    for _, out, prompt_len in hf_greedy_by_length(model, prompts, n, device, output_logits=True, new_cache=new_cache):
        logits = torch.stack(out.logits, dim=1).float()  # batch, step, vocab
        vals, idx = torch.log_softmax(logits, dim=-1).topk(max(k, HF_RANKS), dim=-1)
        tokens += out.sequences[:, prompt_len:].tolist()
        for v_row, i_row in zip(vals.tolist(), idx.tolist(), strict=True):
            tops.append([best_first(zip(ii, vv, strict=True)) for vv, ii in zip(v_row, i_row, strict=True)])
    del model, out, logits
    free_device_memory(device)
    return tokens, tops


def run_kvray(
    model_dir: str, prompts: list[list[int]], n: int, k: int, dtype: str, args: argparse.Namespace
) -> tuple[Any, Any]:
    from cluster import LLM, SamplingParams

    extra = (
        {"cpu_kv_cache_gib": 0.05}
        if args.device == "cpu"
        else {"gpu_memory_utilization": args.gpu_memory_utilization, "cudagraph_mode": args.cudagraph_mode}
    )
    llm = LLM(
        model=model_dir,
        device=args.device,
        dtype=dtype,
        tensor_parallel_size=1,
        max_model_len=max(map(len, prompts)) + n + 16,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        **extra,
    )
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=k),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    tokens, tops = [], []
    for i, o in enumerate(outs):
        if o.error is not None:
            raise RuntimeError(f"kvray {dtype}: request {i} failed: {o.error}")
        c = o.outputs[0]
        if c.logprobs is None:
            raise RuntimeError(f"kvray {dtype}: request {i} came back without logprobs")
        tokens.append(list(c.token_ids))
        tops.append([kvray_topk(d, k) for d in c.logprobs])
    return tokens, tops


def free_device_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- one shape ---------------------------------------------------------------------------------
def prompt_lengths(fields: dict, args: argparse.Namespace) -> tuple[int, int]:
    """[lo, hi]: straddling the sliding window where the shape has one, else --min-len..--max-len."""
    window = fields.get("sliding_window")
    if window and not args.no_cross_window:
        return max(1, window - args.new_tokens // 2), window + 8
    return args.min_len, args.max_len


def prepare_shape(shape: str, args: argparse.Namespace) -> tuple[str, list[list[int]]]:
    """The shape's random checkpoint (written once per layer count and dtype) and its prompts."""
    layers = None if args.smoke else (args.num_layers or DEFAULT_LAYERS.get(shape))
    fields = tiny_shape(shape) if args.smoke else dict(SHAPES[shape])
    model_dir = make_random_model(shape, args.model_dir, dtype=args.dtype, num_layers=layers, tiny=args.smoke)
    free_device_memory(args.device)
    lo, hi = prompt_lengths(fields, args)
    prompts = make_prompts(args.num_prompts, args.length_groups, lo, hi, fields["vocab_size"])
    total = fields["num_hidden_layers"]
    print(
        f"\n== {shape}: {layers or total} of {total} layers, window {fields.get('sliding_window') or '-'}, "
        f"{len(prompts)} prompts of lengths {sorted(set(map(len, prompts)))}, {args.new_tokens} tokens, "
        f"top-{args.top_k}, {args.dtype} on {args.device} ({model_dir})",
        flush=True,
    )
    return model_dir, prompts


def fp8_rounding(args: argparse.Namespace) -> Fp8Rounding | None:
    """The control's rounding: what kvray runs in fp8, unless --no-control; None when nothing is."""
    kv = args.kv_cache_dtype != "auto"
    if args.no_control or not (kv or args.quantization):
        return None
    if args.kv_cache_dtype == "fp8_e5m2":
        raise SystemExit("--kv-cache-dtype fp8_e5m2: the control rounds to e4m3 only; add --no-control")
    return Fp8Rounding(weights=args.quantization == "fp8", kv_cache=kv)


def compare(shape: str, n: int, k: int, tokens: list, tops: list, hf_tokens: list, hf_tops: list) -> ShapeReport:
    report = ShapeReport(shape, n)
    for i in range(len(tokens)):
        report.seqs.append(check_sequence(i, tokens[i], tops[i], hf_tokens[i], hf_tops[i], k))
    return report


def print_report(report: ShapeReport, who: str) -> None:
    print(f"   {who}: " + report.summary(), flush=True)
    for s in report.seqs:
        if s.reason:
            print(f"   {'divergence' if s.ok else '!!! FAIL'}: {s.reason}", flush=True)


def check_shape(shape: str, args: argparse.Namespace, baseline_mib: int | None) -> ShapeReport:
    t0 = time.perf_counter()
    model_dir, prompts = prepare_shape(shape, args)
    t1 = time.perf_counter()
    hf_tokens, hf_tops = run_hf(model_dir, prompts, args.new_tokens, args.top_k, args.dtype, args.device)
    t2 = time.perf_counter()
    if args.device == "cuda":
        wait_gpu_released(baseline_mib)  # the previous shape's workers exit asynchronously
    kv_tokens, kv_tops = run_kvray(model_dir, prompts, args.new_tokens, args.top_k, args.dtype, args)
    t3 = time.perf_counter()
    report = compare(shape, args.new_tokens, args.top_k, kv_tokens, kv_tops, hf_tokens, hf_tops)
    print(f"   checkpoint {t1 - t0:.1f}s, HF {t2 - t1:.1f}s, kvray {t3 - t2:.1f}s", flush=True)
    print_report(report, "kvray")
    # Now: a later shape that runs past the step's limit keeps this one's records.
    record_report(report, variant(args))
    rounding = fp8_rounding(args)
    if rounding is not None:
        # The control's top-k is cut to k, as kvray's is: the rule then reads both sides alike.
        ctl_tokens, ctl_tops = run_hf(
            model_dir, prompts, args.new_tokens, args.top_k, args.dtype, args.device, fp8=rounding
        )
        ctl_tops = [[_first(top, args.top_k) for top in seq] for seq in ctl_tops]
        control = compare(shape, args.new_tokens, args.top_k, ctl_tokens, ctl_tops, hf_tokens, hf_tops)
        print(f"   control, HF with fp8's rounding ({time.perf_counter() - t3:.1f}s):", flush=True)
        print_report(control, "HF fp8 against HF")
        record_report(control, variant(args), prefix="logprobs_close_control")
        # kvray against the control: the same rounding on both sides, so what is left is the model dtype's
        # noise and the rare value that lands on the other side of an e4m3 rounding step.
        same = compare(shape, args.new_tokens, args.top_k, kv_tokens, kv_tops, ctl_tokens, ctl_tops)
        print_report(same, "kvray against HF fp8")
        record_report(same, variant(args), prefix="logprobs_close_vs_control")
    return report


def variant(args: argparse.Namespace) -> str:
    """The metric suffix of kvray's numerics: _fp8w (fp8 weights), _fp8kv (an fp8 cache), both, or none."""
    w = f"_{args.quantization}w" if args.quantization else ""
    return w + ("" if args.kv_cache_dtype == "auto" else f"_{args.kv_cache_dtype}kv")


def tag(shape: str) -> str:
    return shape.replace("-", "_").replace(".", "p")


def record_report(r: ShapeReport, suffix: str, prefix: str = "logprobs_close") -> None:
    t = tag(r.shape) + suffix
    record(SCRIPT, f"{prefix}_pass_{t}", 1.0 if r.passed else 0.0, "bool")
    record(SCRIPT, f"{prefix}_divergent_{t}", r.divergent, "sequences")
    record(SCRIPT, f"{prefix}_max_lp_diff_{t}", max(s.max_lp_diff for s in r.seqs), "nats")


# ---- main --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=DEFAULT_SHAPES)
    p.add_argument("--num-layers", type=int, default=None, help=f"every shape's layers (default {DEFAULT_LAYERS})")
    p.add_argument("--model-dir", default="/tmp/kvray-models")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--length-groups", type=int, default=4, help="prompts come in this many equal-length groups")
    p.add_argument("--min-len", type=int, default=32, help="prompt lengths of shapes without a window")
    p.add_argument("--max-len", type=int, default=160)
    p.add_argument("--no-cross-window", action="store_true", help="windowed shapes use --min/--max-len too")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument(
        "--cudagraph-mode",
        default="decode",
        choices=["all", "decode", "none"],
        help="decode: the decode steps replay graphs; mixed-step graphs would add minutes of cold capture",
    )
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"], help="kvray's cache"
    )
    p.add_argument("--quantization", default=None, choices=["fp8"], help="kvray's dense linear weights")
    p.add_argument(
        "--no-control",
        action="store_true",
        help="with fp8: skip the control (HF with fp8's rounding held to the same rule, hf_fp8_rounding.py)",
    )
    p.add_argument("--results-dir", default=None, help="where the RESULT records go (default benchmarks/results)")
    p.add_argument("--smoke", action="store_true", help="CPU, float32, tiny models of each shape's family")
    if "--smoke" in (sys.argv[1:] if argv is None else argv):  # its defaults; explicit flags still win
        p.set_defaults(device="cpu", dtype="float32", num_prompts=4, length_groups=2, min_len=16, max_len=40)
        p.set_defaults(new_tokens=8, max_num_batched_tokens=256)
    args = p.parse_args(argv)
    for name, lo in (("num_prompts", 1), ("length_groups", 1), ("min_len", 1), ("new_tokens", 1), ("top_k", 1)):
        if getattr(args, name) < lo:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= {lo}")
    if args.length_groups > args.num_prompts or args.max_len < args.min_len:
        p.error("--length-groups must be <= --num-prompts and --max-len >= --min-len")
    if args.results_dir:
        common.RESULTS_DIR = Path(args.results_dir)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    started_ray = False
    if not os.environ.get("RAY_ADDRESS"):
        import ray

        from cluster.replicas.placement import start_local_ray  # one local Ray for every shape

        if not ray.is_initialized():
            start_local_ray(num_cpus=max(os.cpu_count() or 1, 3), namespace="kvray")
            started_ray = True
    try:
        baseline = gpu_used_mib() if args.device == "cuda" else None
        reports = [check_shape(shape, args, baseline) for shape in args.shapes]
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    print(
        f"\nvLLM's rule, {args.num_prompts} prompts x {args.new_tokens} tokens, top-{args.top_k}, {args.dtype}, "
        f"kvray's KV cache {args.kv_cache_dtype}, quantization {args.quantization}:"
    )
    for r in reports:
        print("  " + r.summary())
    record(SCRIPT, f"logprobs_close_pass{variant(args)}", float(all(r.passed for r in reports)), "bool")
    failed = [r.shape for r in reports if not r.passed]
    print(f"{'FAIL: ' + ', '.join(failed) if failed else 'PASS'} ({time.perf_counter() - t_start:.1f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
