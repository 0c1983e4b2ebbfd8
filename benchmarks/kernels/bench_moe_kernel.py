"""The fused-MoE Triton kernel against a loop over experts with torch matmuls (HF's expert loop, the
kernel's torch reference), side by side on the same inputs, bf16, one rank.

Shapes: Qwen3-30B-A3B (128 experts of 768, top 8, hidden 2048) and Mixtral-8x7B (8 experts of 14336,
top 2, hidden 4096), at decode and prefill token counts. For each: both times (CUDA events, median
of --iters after warm-up), the speedup, achieved TFLOP/s (2 * pairs * 3 * H * I) and GB/s (the bytes
of the experts actually hit plus activations: decode batches are bound by weight bandwidth). The
kernel's output is checked against the loop's on every shape.

  python -m benchmarks.kernels.bench_moe_kernel            # H200, about a minute
  python -m benchmarks.kernels.bench_moe_kernel --smoke    # CPU, TRITON_INTERPRET=1, tiny shapes, checks only
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported at run time only after --smoke has set TRITON_INTERPRET
    import torch

# name: (experts, top_k, hidden, intermediate)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
TOKENS = (1, 16, 64, 256, 1024, 4096)
SMOKE = {"tiny-moe": (8, 2, 64, 32)}


def make_inputs(
    num_tokens: int, shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    import torch

    from actors.layers.fused_moe import route_topk

    experts, top_k, hidden, inter = shape
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g, device=device).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device=device) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g, device=device) / inter**0.5).to(dtype)
    logits = torch.randn(num_tokens, experts, generator=g, device=device)
    weights, ids = route_topk(logits, top_k, normalize=True, weight_dtype=dtype)
    return x, w13, w2, weights, ids


def time_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def traffic(x: torch.Tensor, ids: torch.Tensor, shape: tuple[int, int, int, int]) -> tuple[float, float]:
    """(FLOPs, bytes): three projections per (token, expert) pair; the weights of every expert hit,
    read once, plus the activations in and out."""
    experts, top_k, hidden, inter = shape
    pairs = ids.numel()
    flops = 2.0 * pairs * 3 * hidden * inter
    hit = int(ids.unique().numel())
    item = x.element_size()
    bytes_ = hit * 3 * hidden * inter * item + pairs * (2 * inter + inter + hidden) * item * 2 + x.numel() * item
    return flops, float(bytes_)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=sorted(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1: correctness only")
    args = p.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from actors.layers.kernels.fused_moe import fused_moe_triton
    from actors.layers.kernels.moe_reference import fused_moe_ref
    from benchmarks.common import record

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shapes = SMOKE if args.smoke else {k: SHAPES[k] for k in args.shape}
    tokens = (1, 5, 40) if args.smoke else args.tokens
    print(f"{'shape':<15}{'tokens':>7}{'loop ms':>10}{'fused ms':>10}{'speedup':>9}{'TFLOP/s':>9}{'GB/s':>8}")
    for name, shape in shapes.items():
        for n in tokens:
            x, w13, w2, weights, ids = make_inputs(n, shape, dtype, device)
            ref = fused_moe_ref(x, w13, w2, weights, ids)
            out = fused_moe_triton(x, w13, w2, weights, ids)
            tol = 2e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
            if args.smoke:
                print(f"{name:<15}{n:>7}   fused == loop (max |diff| {float((out - ref).abs().max()):.2e})")
                continue
            loop_ms = time_ms(functools.partial(fused_moe_ref, x, w13, w2, weights, ids), args.iters)
            fused_ms = time_ms(functools.partial(fused_moe_triton, x, w13, w2, weights, ids), args.iters)
            flops, bytes_ = traffic(x, ids, shape)
            tflops, gbs = flops / fused_ms / 1e9, bytes_ / fused_ms / 1e6
            print(
                f"{name:<15}{n:>7}{loop_ms:>10.3f}{fused_ms:>10.3f}{loop_ms / fused_ms:>8.2f}x"
                f"{tflops:>9.1f}{gbs:>8.0f}",
                flush=True,
            )
            tag = f"{name.replace('-', '_')}_t{n}"
            record("bench_moe_kernel", f"{tag}_fused_ms", fused_ms, "ms")
            record("bench_moe_kernel", f"{tag}_speedup_vs_loop", loop_ms / fused_ms, "x")
            record("bench_moe_kernel", f"{tag}_tflops", tflops, "TFLOP/s")
            record("bench_moe_kernel", f"{tag}_gbs", gbs, "GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
