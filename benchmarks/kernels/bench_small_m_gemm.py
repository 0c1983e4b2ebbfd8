"""The small-M GEMM over 16-bit weights against torch's linear (cuBLAS), per projection and row count, and
the per-device table that tells the engine where to use it (actors/layers/kernels/small_m_tuned.py).

For the Llama-3.1-8B and Qwen3-0.6B shapes' four projections (qkv, o, gate_up, down) at M = 1..16 rows
(the decode steps that read every weight for a few tokens) and at 32..256 (the big decode steps, where
Qwen3-0.6B's 4-12 MB matrices take cuBLAS 6.4-7.7 us against a 1-3 us byte floor: launch-bound, not
read-bound): F.linear, then the kernel over a sweep of tile, split and stage choices (`sweep_for`).
Each timing is a CUDA graph that runs the layer over enough copies of the weight to exceed the L2 cache
(a lone 33 MB weight replayed in a loop would be partly served from the 50 MB L2, which a model's step
never is), median microseconds per layer; weight bytes per us as TB/s.

Expected before the first run (M <= 16): cuBLAS's one-row kernels for Llama's qkv and o read at 0.80 and 0.68 of the
2,990 GB/s copy on the H100 (a step's trace), gate_up at 0.95, down at 0.90; a streaming kernel near 0.90
on all four would cut ~6.5 us a layer, ~0.2 ms of the 6.27 ms batch-1 step (batch1_weight_bw_frac 0.86 ->
~0.89). Expected before the first run at 32..256: the kernel 1.3-2x faster than cuBLAS on Qwen3-0.6B's
four projections at 64-256 rows (~3-5 us against 6.4-7.7), nano's big decode steps ~0.2-0.3 ms shorter
(of ~6.7 ms on the H200: +2-4% on the recipe); Llama-3.1-8B's at 128-256 rows are bound by their FLOPs,
where cuBLAS should keep them.

--write merges the measured row counts into actors/layers/kernels/small_m_configs/<device>-bfloat16.json
(the rows not measured keep their entries): a winner (>= MIN_GAIN faster than F.linear, checked close to
it) as its config, a row count where cuBLAS wins as null, so that the engine keeps F.linear there and at
the row counts it covers.

  python -m benchmarks.kernels.bench_small_m_gemm --write     # GPU; also appends to results/bench_small_m_gemm.jsonl
  python -m benchmarks.kernels.bench_small_m_gemm --smoke     # CPU, tiny shapes, Triton interpreter: errors only
  python -m benchmarks.kernels.bench_small_m_gemm --gated     # gate_up + SiLU in one launch against two
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from actors.layers.kernels.silu_mul import silu_and_mul_triton
from actors.layers.kernels.small_m_gemm import GemmConfig, small_m_linear, small_m_linear_ref, small_m_silu_mul
from actors.layers.kernels.small_m_tuned import config_entry, table_path
from benchmarks.common import SHAPES, record
from benchmarks.kernels.bench_fp8_linear import bench_shape, projections

SCRIPT = "bench_small_m_gemm"
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
MIN_GAIN = 1.03  # a win smaller than the run-to-run spread is no reason to leave cuBLAS
L2_FLUSH_BYTES = 256 << 20

SWEEP = [
    GemmConfig(block_n=bn, block_k=bk, split_k=sk, num_stages=st, num_warps=nw)
    for bn in (32, 64, 128)
    for bk in (128, 256)
    for sk in (1, 2, 4, 8)
    for st in (4,)
    for nw in (4,)
]
# Past 16 rows the activations' tile grows to 32-64 rows (and 128 here), so shorter K tiles keep the
# shared-memory stages within the SM's 228 KB; a program does more MMA work per weight byte, so the
# split over K matters less.
SWEEP_WIDE = [
    GemmConfig(block_n=bn, block_k=bk, split_k=sk, num_stages=st, num_warps=4)
    for bn in (64, 128)
    for bk in (64, 128)
    for sk in (1, 2, 4)
    for st in (3, 4)
] + [
    GemmConfig(block_n=bn, block_k=64, split_k=sk, num_stages=3, num_warps=8, block_m=128)
    for bn in (64, 128)
    for sk in (1, 2)
]


def sweep_for(m: int) -> list[GemmConfig]:
    """The configs tried at m rows: a row tile of 128 only where it is not mostly padding."""
    if m <= 16:
        return SWEEP
    return [c for c in SWEEP_WIDE if c.block_m <= m]


def time_us(layer: Callable[[torch.Tensor], torch.Tensor], weights: list[torch.Tensor], smoke: bool) -> float:
    """Median us per layer call, the calls cycling through `weights` inside one CUDA graph."""
    if smoke:
        for w in weights:
            layer(w)
        return float("nan")
    import triton.testing

    def run() -> None:
        for w in weights:
            layer(w)

    run()
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench_cudagraph(run, rep=60, return_mode="median") / len(weights)


def close(y: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool(((y.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item() < 1e-2)


def weight_copies(n: int, k: int, dtype: torch.dtype, smoke: bool) -> list[torch.Tensor]:
    """Enough copies of an [n, k] weight that cycling through them reads each from memory, not the L2."""
    device = "cpu" if smoke else "cuda"
    copies = 1 if smoke else max(2, -(-L2_FLUSH_BYTES // (n * k * 2)))
    return [torch.randn(n, k, device=device, dtype=dtype) / k**0.5 for _ in range(copies)]


def fastest(
    label: str,
    x: torch.Tensor,
    weights: list[torch.Tensor],
    configs: list[GemmConfig],
    kernel: Callable[[torch.Tensor, GemmConfig, torch.Tensor], torch.Tensor],
    ref: torch.Tensor,
    smoke: bool,
) -> tuple[float, GemmConfig | None]:
    """The fastest of `configs` for kernel(x, config, w), each checked against `ref` first; a config past
    the SM's resources is skipped (and said), one that differs from the reference ends the run."""
    best_t, best = float("inf"), None
    for c in configs:
        try:
            y = kernel(x, c, weights[0])
        except Exception as e:  # noqa: BLE001 - a config past the SM's resources: skip it, say so
            print(f"  {label} {c}: {type(e).__name__}", flush=True)
            continue
        if not close(y, ref):
            raise SystemExit(f"{label} {c}: the kernel differs from its reference")
        t = time_us(functools.partial(kernel, x, c), weights, smoke)
        if best is None or t < best_t:
            best_t, best = t, c
    return best_t, best


def _linear(x: torch.Tensor, c: GemmConfig, w: torch.Tensor) -> torch.Tensor:
    return small_m_linear(x, w, None, x.dtype, config=c)


def tune_shape(
    name: str, proj: str, n: int, k: int, rows: list[int], dtype: torch.dtype, smoke: bool
) -> dict[str, list[int] | None]:
    """-> {str(M): the winning config's row, or None where F.linear is as fast} for every row count timed."""
    weights = weight_copies(n, k, dtype, smoke)
    entries: dict[str, list[int] | None] = {}
    for m in rows:
        sweep = sweep_for(m)
        configs = [c for c in (sweep[:2] if smoke else sweep) if c.split_k == 1 or (k // c.block_k) % c.split_k == 0]
        x = torch.randn(m, k, device=weights[0].device, dtype=dtype)
        ref = small_m_linear_ref(x, weights[0], None)
        t_torch = time_us(functools.partial(torch.nn.functional.linear, x), weights, smoke)
        best_t, best = fastest(f"{name} {proj} M={m}", x, weights, configs, _linear, ref, smoke)
        gain = t_torch / best_t
        print(
            f"{name:13s} {proj:8s} M={m:3d}  F.linear {t_torch:7.1f} us ({2 * n * k / t_torch / 1e6:4.2f} TB/s)  "
            f"kernel {best_t:7.1f} us ({2 * n * k / best_t / 1e6:4.2f} TB/s)  {gain:4.2f}x  {best}",
            flush=True,
        )
        if smoke:
            continue
        if best is None:  # no config fits the SM: cuBLAS
            entries[str(m)] = None
            continue
        record(SCRIPT, f"bf16_small_m_speedup_{name}_{proj}_m{m}", gain, "x")
        record(SCRIPT, f"bf16_linear_tbs_{name}_{proj}_m{m}", 2 * n * k / t_torch / 1e6, "TB/s")
        record(SCRIPT, f"bf16_small_m_tbs_{name}_{proj}_m{m}", 2 * n * k / best_t / 1e6, "TB/s")
        entries[str(m)] = config_entry(best) if gain >= MIN_GAIN else None
    return entries


def merge_table(path: Path, device: str, measured: dict[str, dict[str, list[int] | None]]) -> dict:
    """The device's table with the measured row counts replaced and every other entry kept."""
    shapes: dict[str, dict[str, list[int] | None]] = {}
    if path.is_file():
        shapes = json.loads(path.read_text())["shapes"]
    for shape, by_m in measured.items():
        shapes.setdefault(shape, {}).update(by_m)
    for shape, by_m in shapes.items():
        shapes[shape] = dict(sorted(by_m.items(), key=lambda kv: int(kv[0])))
    return {"device": device, "dtype": "bfloat16", "shapes": shapes}


GATED_SWEEP = [
    GemmConfig(block_n=bn, block_k=bk, split_k=1, num_stages=st, num_warps=4)
    for bn in (16, 32, 64)
    for bk in (128, 256)
    for st in (3, 4)
]


def _two_launches(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_triton(torch.nn.functional.linear(x, w))


def _one_launch(x: torch.Tensor, c: GemmConfig, w: torch.Tensor) -> torch.Tensor:
    return small_m_silu_mul(x, w, config=c)


def gated_shape(name: str, n: int, k: int, rows: list[int], dtype: torch.dtype, smoke: bool) -> None:
    """F.linear's gate_up then SiluAndMul's launch (the engine without the fusion, where the table keeps
    cuBLAS for gate_up) against small_m_silu_mul, one launch: bf16_gated_speedup_<name>_m<M>."""
    weights = weight_copies(n, k, dtype, smoke)
    for m in rows:
        x = torch.randn(m, k, device=weights[0].device, dtype=dtype)
        ref = silu_and_mul_triton(small_m_linear_ref(x, weights[0], None))
        t_two = time_us(functools.partial(_two_launches, x), weights, smoke)
        configs = GATED_SWEEP[:1] if smoke else GATED_SWEEP
        best_t, best = fastest(f"{name} gated M={m}", x, weights, configs, _one_launch, ref, smoke)
        print(
            f"{name:13s} gated    M={m:3d}  F.linear+silu {t_two:7.1f} us  one launch {best_t:7.1f} us  "
            f"{t_two / best_t:4.2f}x  {best}",
            flush=True,
        )
        if not smoke and best is not None:
            record(SCRIPT, f"bf16_gated_speedup_{name}_m{m}", t_two / best_t, "x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, the interpreter, nothing recorded")
    ap.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "qwen3-0.6b"], choices=sorted(SHAPES))
    ap.add_argument("--rows", nargs="+", type=int, default=ROWS)
    ap.add_argument("--write", action="store_true", help="write the device's table for the engine")
    ap.add_argument("--gated", action="store_true", help="only gate_up + SiLU: two launches against one")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_small_m_gemm needs a CUDA GPU (use --smoke on the CPU)")
    torch.manual_seed(0)
    dtype = torch.bfloat16
    table: dict[str, dict[str, list[int] | None]] = {}
    if args.gated:
        for name in args.shapes:
            n, k = projections(bench_shape(name, args.smoke))["gate_up"]
            gated_shape(name, n, k, [1, 3] if args.smoke else args.rows, dtype, args.smoke)
        return
    for name in args.shapes:
        for proj, (n, k) in projections(bench_shape(name, args.smoke)).items():
            entries = tune_shape(name, proj, n, k, [1, 3, 17] if args.smoke else args.rows, dtype, args.smoke)
            table.setdefault(f"{n}x{k}", {}).update(entries)
    if args.write and not args.smoke:
        device = torch.cuda.get_device_name()
        path = table_path(device, dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = merge_table(path, device, table)
        path.write_text(json.dumps(merged, indent=1) + "\n")
        print(f"wrote {path} ({len(merged['shapes'])} shapes)", flush=True)
        out = os.environ.get("OUT")
        if out:  # what a device call brings back
            (Path(out) / path.name).write_text(path.read_text())


if __name__ == "__main__":
    main()
