"""Two nano-batches on two streams: does a decode layer get shorter when one half's GEMMs run beside the
other half's attention? The measurement before building NanoFlow-style overlap into the runner.

One decoder layer at a big decode step, Qwen3-0.6B's at nano's (256 rows, contexts 100-2,048) or
Llama-3.1-8B's at the ShareGPT-like run's (232 rows, contexts 32-640): RMSNorm, qkv GEMM, paged
attention, o GEMM, residual + RMSNorm, gate/up GEMM, SiLU-and-mul, down GEMM (cuBLAS GEMMs and the
engine's Triton kernels; rotary and the cache write left out, ~1% of a step), over several layers with
weights of their own (so the weight reads are real), timed in CUDA graphs four ways:
- full: the rows as one batch, as the engine runs today;
- halves, one stream: the first half of the rows, then the second, layer by layer (what the split costs:
  every weight read twice, each launch half as wide);
- halves, two streams: the same work, each half on its own stream, joined per layer, so that the
  scheduler may run one half's GEMMs on the SMs the other half's attention leaves;
- halves, two free streams: each half's whole forward on its own stream, joined once at the end.
The halves' outputs are checked against the full batch's (same rows, same kernels: equal up to the GEMMs'
row-count-dependent reductions).

  python -m benchmarks.kernels.bench_overlap            # GPU: prints the four, records overlap_*
  python -m benchmarks.kernels.bench_overlap --shape llama-3.1-8b   # the ShareGPT-like run's decode steps
  python -m benchmarks.kernels.bench_overlap --smoke    # CPU, tiny shapes, interpreter: the halves' check only
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

from actors.layers.kernels import layer_ops
from benchmarks.common import record
from benchmarks.kernels.bench_attention import bench, make_paged
from kvcore.kernels.ops import paged_attention

SCRIPT = "bench_overlap"
EPS = 1e-6


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head: int
    inter: int
    layers: int
    rows: int
    ctx: tuple[int, int]


# Qwen3-0.6B at nano's big decode steps; Llama-3.1-8B at the ShareGPT-like run's (~230 rows, contexts ~32-640),
# four layers of 0.44 GB each so that the weight reads are real and the run stays in memory.
SHAPES = {
    "qwen3-0.6b": Shape(1024, 16, 8, 128, 3072, 8, 256, (100, 2048)),
    "llama-3.1-8b": Shape(4096, 32, 8, 128, 14336, 4, 232, (32, 640)),
    "smoke": Shape(64, 4, 2, 16, 96, 2, 6, (5, 40)),
}


@dataclass
class Layer:
    norm1: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    norm2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class Batch:
    """A slice of the step's rows: its activations and its attention inputs."""

    x: torch.Tensor
    residual: torch.Tensor
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    table: torch.Tensor
    max_ctx: int


def make_layers(s: Shape, dtype: torch.dtype, device: str) -> list[Layer]:
    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, dtype=dtype, device=device) / k**0.5

    q_out, kv_out = s.heads * s.head, s.kv_heads * s.head
    return [
        Layer(
            torch.ones(s.hidden, dtype=dtype, device=device),
            w(q_out + 2 * kv_out, s.hidden),
            w(s.hidden, q_out),
            torch.ones(s.hidden, dtype=dtype, device=device),
            w(2 * s.inter, s.hidden),
            w(s.hidden, s.inter),
        )
        for _ in range(s.layers)
    ]


def layer_forward(s: Shape, lw: Layer, b: Batch, kc: torch.Tensor, vc: torch.Tensor, backend: str) -> None:
    """One decoder layer over batch b, in place (b.x, b.residual)."""
    h, res = layer_ops.rms_norm(b.x, lw.norm1, EPS, b.residual, backend=backend)
    qkv = F.linear(h, lw.qkv)
    q = qkv[:, : s.heads * s.head].reshape(-1, s.heads, s.head)
    attn = torch.empty_like(q)
    paged_attention(q, kc, vc, attn, b.qsl, b.seq_lens, b.table, s.head**-0.5, None, 1, b.max_ctx, backend=backend)
    o = F.linear(attn.view(-1, s.heads * s.head), lw.o)
    h, res = layer_ops.rms_norm(o, lw.norm2, EPS, res, backend=backend)
    act = layer_ops.silu_and_mul(F.linear(h, lw.gate_up), backend=backend)
    b.x.copy_(F.linear(act, lw.down))
    b.residual.copy_(res)


def split(b: Batch, rows: int, ctxs: list[int]) -> tuple[Batch, Batch]:
    """The first `rows` rows and the rest, each with its own attention inputs (views and fresh offsets)."""
    first = Batch(b.x[:rows], b.residual[:rows], b.qsl[: rows + 1], b.seq_lens[:rows], b.table[:rows], max(ctxs[:rows]))
    rest_qsl = b.qsl[rows:] - rows
    second = Batch(b.x[rows:], b.residual[rows:], rest_qsl, b.seq_lens[rows:], b.table[rows:], max(ctxs[rows:]))
    return first, second


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, the interpreter, nothing recorded")
    ap.add_argument("--shape", choices=[k for k in SHAPES if k != "smoke"], default="qwen3-0.6b")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_overlap needs a CUDA GPU (use --smoke on the CPU)")
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    backend = "triton"
    s = SHAPES["smoke" if args.smoke else args.shape]
    tag = {"qwen3-0.6b": "qwen3_0p6b", "llama-3.1-8b": "llama8b"}[args.shape]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    ctxs = torch.randint(s.ctx[0], s.ctx[1] + 1, (s.rows,), generator=g).tolist()
    q, kc, vc, qsl, seq_lens, table = make_paged([1] * s.rows, ctxs, s.heads, s.kv_heads, s.head, 16, dtype, device)
    layers = make_layers(s, dtype, device)
    x0 = torch.randn(s.rows, s.hidden, dtype=dtype, device=device)
    full = Batch(x0.clone(), torch.zeros_like(x0), qsl, seq_lens, table, max(ctxs))
    halves = split(Batch(x0.clone(), torch.zeros_like(x0), qsl, seq_lens, table, max(ctxs)), s.rows // 2, ctxs)

    def run_full() -> None:
        for lw in layers:
            layer_forward(s, lw, full, kc, vc, backend)

    def run_halves() -> None:
        for lw in layers:
            for b in halves:
                layer_forward(s, lw, b, kc, vc, backend)

    run_full()
    run_halves()
    got = torch.cat([halves[0].x, halves[1].x]).float()
    err = (got - full.x.float()).abs().max().item() / max(1e-6, full.x.float().abs().max().item())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    print(f"halves against the full batch: max relative error {err:.2e} (tolerance {tol:.0e})", flush=True)
    if not err <= tol:
        raise SystemExit(f"the halves' outputs differ from the full batch's: {err:.2e} > {tol:.0e}")
    if args.smoke:
        return

    side = [torch.cuda.Stream(), torch.cuda.Stream()]

    def run_streams() -> None:
        main_stream = torch.cuda.current_stream()
        for lw in layers:
            for st, b in zip(side, halves, strict=True):
                st.wait_stream(main_stream)
                with torch.cuda.stream(st):
                    layer_forward(s, lw, b, kc, vc, backend)
            for st in side:
                main_stream.wait_stream(st)

    def run_free() -> None:
        """Each half's whole forward on its own stream, joined once at the end: the graph holds two
        independent branches (what a runner would capture without per-layer events)."""
        main_stream = torch.cuda.current_stream()
        for st, b in zip(side, halves, strict=True):
            st.wait_stream(main_stream)
            with torch.cuda.stream(st):
                for lw in layers:
                    layer_forward(s, lw, b, kc, vc, backend)
        for st in side:
            main_stream.wait_stream(st)

    variants: dict[str, Callable[[], None]] = {
        "full": run_full,
        "halves": run_halves,
        "streams": run_streams,
        "free": run_free,
    }
    times = {name: bench(fn, False) * 1e3 / s.layers for name, fn in variants.items()}
    kv_bytes = 2 * sum(ctxs) * s.kv_heads * s.head * kc.element_size()
    print(
        f"{args.shape} layer at {s.rows} rows (contexts {s.ctx[0]}-{s.ctx[1]}, KV {kv_bytes / 1e6:.0f} MB a layer): "
        + ", ".join(f"{k} {v:.1f} us" for k, v in times.items())
        + f"; streams/full {times['streams'] / times['full']:.3f}, free/full {times['free'] / times['full']:.3f}",
        flush=True,
    )
    for name, us in times.items():
        record(SCRIPT, f"overlap_layer_us_{name}_{tag}", us, "us")
    for name in ("streams", "free"):
        record(SCRIPT, f"overlap_{name}_vs_full_{tag}", times[name] / times["full"], "ratio")


if __name__ == "__main__":
    main()
