"""fp8 weights (model.quantization="fp8") against bf16, per linear layer, side by side in one run.

For the Llama-3.1-8B and Qwen3-0.6B shapes' four projections (qkv, o, gate_up, down) at token counts from a
tail decode step to a prefill chunk: the bf16 GEMM (F.linear), the fp8 layer as the engine runs it (the
per-token quantizer then torch._scaled_mm; at M <= KVRAY_FP8_SMALL_M the Triton kernel over fp16-widened
weights), the small-M kernel itself at M <= 64, and the scaled GEMM alone. CUDA-graph replay, median us;
weight bytes read per us as TB/s, and TFLOP/s. Expected: the weight-bound rows (M <= 64) near 2x (half the
bytes) with the small-M kernel, the compute-bound ones (M >= 2048) 1.5-1.9x with the scaled GEMM.
`--sweep` also times the small-M kernel's tile / split / stage choices at M <= 64 and prints the best.

  python -m benchmarks.kernels.bench_fp8_linear            # GPU, appends to results/bench_fp8_linear.jsonl
  python -m benchmarks.kernels.bench_fp8_linear --smoke    # CPU, tiny shapes, Triton interpreter: errors only
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from actors.layers.fp8_linear import fp8_linear, per_token_quant_fp8, quantize_weight_fp8
from actors.layers.kernels.small_m_gemm import GemmConfig, w8a16_linear
from benchmarks.common import SHAPES, record
from benchmarks.kernels.bench_layer_kernels import bench

SCRIPT = "bench_fp8_linear"
TOKENS = [1, 16, 64, 128, 256, 2048, 8192]


def projections(shape: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection's weight at TP=1."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    d = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}


def bench_shape(name: str, smoke: bool) -> dict:
    """The shape's config; with --smoke a tiny one with the same projections (the interpreter is slow)."""
    shape = SHAPES[name]
    if smoke:
        shape = dict(shape, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
        shape["head_dim"] = 16
    return shape


def check_close(y: torch.Tensor, y_bf16: torch.Tensor, what: str) -> float:
    err = ((y.float() - y_bf16.float()).norm() / y_bf16.float().norm()).item()
    if not err < 0.08:  # fp8's rounding: a few percent; more is a bug
        raise SystemExit(f"{what}: relative error {err:.3f} against bf16")
    return err


def scaled_mm_nt(
    xq: torch.Tensor, wq: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """torch's own FP8 GEMM on the same operands (the weight transposed per call, as a linear layer would)."""
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=dtype)


def run_shape(name: str, shape: dict, tokens: list[int], smoke: bool, sweep: bool) -> None:
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    for proj, (n, k) in projections(shape).items():
        w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
        wq, ws = quantize_weight_fp8(w)
        for m in tokens:
            x = torch.randn(m, k, device=device, dtype=dtype)
            xq, xs = per_token_quant_fp8(x)
            y_bf16 = torch.nn.functional.linear(x, w)
            err = check_close(fp8_linear(x, wq, ws, None, dtype), y_bf16, f"{name} {proj} M={m}")
            if m <= 64:  # the small-M kernel (under the interpreter with --smoke)
                check_close(w8a16_linear(x, wq, ws, None, dtype), y_bf16, f"{name} {proj} M={m} small-M kernel")
            t_bf16 = bench(functools.partial(torch.nn.functional.linear, x, w), smoke)
            t_fp8 = bench(functools.partial(fp8_linear, x, wq, ws, None, dtype), smoke)
            t_small = float("nan")
            if m <= 64:
                t_small = bench(functools.partial(w8a16_linear, x, wq, ws, None, dtype), smoke)
            t_mm = bench(functools.partial(scaled_mm_nt, xq, wq, xs, ws, dtype), smoke)
            flop = 2 * m * n * k
            print(
                f"{name:13s} {proj:8s} M={m:5d}  bf16 {t_bf16:8.1f} us ({2 * n * k / t_bf16 / 1e6:5.2f} TB/s, "
                f"{flop / t_bf16 / 1e6:6.1f} TFLOP/s)  fp8 {t_fp8:8.1f} us ({n * k / t_fp8 / 1e6:5.2f} TB/s, "
                f"{flop / t_fp8 / 1e6:6.1f} TFLOP/s)  small-M kernel {t_small:8.1f} us ({n * k / t_small / 1e6:5.2f} "
                f"TB/s)  scaled_mm alone {t_mm:8.1f} us  speed-up {t_bf16 / t_fp8:4.2f}x, small-M kernel "
                f"{t_bf16 / t_small:4.2f}x  rel err {err:.4f}",
                flush=True,
            )
            if sweep and m <= 64 and not smoke:
                sweep_small_m(name, proj, x, wq, ws, t_small)
            if not smoke:
                record(SCRIPT, f"fp8_linear_speedup_{name}_{proj}_m{m}", t_bf16 / t_fp8, "x")
                if m <= 64:
                    record(SCRIPT, f"fp8_small_m_kernel_speedup_{name}_{proj}_m{m}", t_bf16 / t_small, "x")


SWEEP = [
    GemmConfig(block_n=bn, block_k=bk, split_k=sk, num_stages=st)
    for bn in (64, 128)
    for bk in (128, 256)
    for st in (3, 5)
    for sk in (1, 2, 4, 8)
]


def sweep_small_m(name: str, proj: str, x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, t_default: float) -> None:
    """The small-M kernel's choices against its default (the engine's) on one (projection, M)."""
    import triton.testing

    def run(c: GemmConfig) -> float:
        fn = functools.partial(w8a16_linear, x, wq, ws, None, x.dtype, c)
        fn()
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")

    best_t, best = min(((run(c), c) for c in SWEEP), key=lambda tc: tc[0])  # configs don't order: key on time
    print(
        f"  sweep {name} {proj} M={x.shape[0]}: best {best_t:6.1f} us {best} "
        f"(default {t_default:6.1f} us: {t_default / best_t:4.2f}x the best)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, no results recorded")
    ap.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "qwen3-0.6b"], choices=sorted(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    ap.add_argument("--sweep", action="store_true", help="time the small-M kernel's configurations too")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_fp8_linear needs a CUDA GPU (use --smoke on the CPU)")
    torch.manual_seed(0)
    for name in args.shapes:
        run_shape(
            name, bench_shape(name, args.smoke), [3, 20, 80] if args.smoke else args.tokens, args.smoke, args.sweep
        )


if __name__ == "__main__":
    main()
