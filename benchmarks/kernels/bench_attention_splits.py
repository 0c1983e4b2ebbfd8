"""Decode attention at the mixed context lengths a serving batch holds: split-KV count and tile shape.

bench_attention.py times decodes of one context length. A continuous batch holds rows of every length
(nano's recipe: 100 to ~2,050 tokens), and a CUDA graph bakes in the split count its bucket chose at
capture. This sweep times the small-tile decode launch over batches of such rows for every split count
and a few tile shapes, and reports each one's bandwidth (bytes of K/V, Q and O over the time) beside the
split count the heuristic (kvcore.kernels.attention_tiles.choose_num_splits, as a graph captures it:
max_seq_len = max_model_len) picks.

  python -m benchmarks.kernels.bench_attention_splits                 # GPU
  python -m benchmarks.kernels.bench_attention_splits --smoke         # CPU, Triton interpreter: errors only
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Callable
from typing import Any

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

import kvcore.kernels.paged_attention as pa
from benchmarks.common import record
from benchmarks.kernels.bench_attention import bench, check, copy_gbps, make_paged
from kvcore.kernels.attention_tiles import Tiles, choose_num_splits, num_sms
from kvcore.kernels.ops import longest_first, paged_attention

SCRIPT = "bench_attention_splits"
HEADS = {"qwen3-0.6b": (16, 8), "llama-3.1-8b": (32, 8)}
# Row lengths: "wide" as a batch early in nano's run holds them, "tail" as its last, longest rows do.
# "short": the Llama-3.1-8B ShareGPT-like run's big decode steps (~230 rows, mean context ~330 tokens).
# "nano": nano's big decode steps (prompts of 100-1,024 tokens plus up to ~560 outputs, mean ~780).
DISTS = {"wide": (100, 2048), "tail": (1024, 2048), "short": (32, 640), "nano": (100, 1600)}


def lengths(dist: str, b: int, seed: int) -> list[int]:
    lo, hi = DISTS[dist]
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(b)]


TILES: dict[str, Tiles | None] = {
    "default": None,  # small_tiles(): 16 x 128, 4 warps, 3 stages
    "n64s3": Tiles(16, 64, 4, 3),
    "n64s2": Tiles(16, 64, 4, 2),
    "n128s2": Tiles(16, 128, 4, 2),
    "n32s3": Tiles(16, 32, 4, 3),
    # One stage (64 KiB of K and V at 128 wide) leaves room for three programs an SM, where three
    # stages leave room for one: latency hidden by occupancy instead of by the pipeline.
    "n128s1": Tiles(16, 128, 4, 1),
    "n128s1w8": Tiles(16, 128, 8, 1),
    "n128s2w8": Tiles(16, 128, 8, 2),
    "n64s1": Tiles(16, 64, 4, 1),
    "n64s2w2": Tiles(16, 64, 2, 2),
    "n256s1": Tiles(16, 256, 4, 1),
}


def time_ms(fn: Callable[[], object], smoke: bool, rep_ms: int) -> float:
    if smoke:
        return bench(fn, smoke)
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep_ms)


def timed(
    q: Any,
    kc: Any,
    vc: Any,
    out: Any,
    qsl: Any,
    sl: Any,
    bt: Any,
    max_ctx: int,
    splits: int,
    tiles: Tiles | None,
    args: argparse.Namespace,
    order: Any = None,
) -> float:
    orig = pa.small_tiles
    if tiles is not None:
        pa.small_tiles = lambda *a, **k: tiles  # the launch's small tiles, as the heuristic would return them
    try:

        def fn() -> Any:
            scale = q.shape[-1] ** -0.5
            pa.paged_attention_triton(
                q, kc, vc, out, qsl, sl, bt, scale, None, 1, max_ctx, num_splits=splits, seq_order=order
            )

        return time_ms(fn, args.smoke, args.rep_ms)
    finally:
        pa.small_tiles = orig


def sweep_one(args: argparse.Namespace, shape: str, dist: str, b: int, device: str, dtype: torch.dtype) -> dict:
    hq, hkv = HEADS[shape]
    d, bs = (32, 16) if args.smoke else (128, 16)
    if args.smoke:
        hq, hkv = hq // 4, hkv // 4
    sl_list = lengths(dist, b, seed=b)
    if args.smoke:
        sl_list = [max(1, s // 40) for s in sl_list]
    q, kc, vc, qsl, sl, bt = make_paged([1] * b, sl_list, hq, hkv, d, bs, dtype, device)
    out = torch.empty_like(q)
    moved = 2 * sum(sl_list) * hkv * d * dtype.itemsize + 2 * q.numel() * dtype.itemsize
    ref = torch.empty_like(q)
    paged_attention(q, kc, vc, ref, qsl, sl, bt, d**-0.5, None, backend="torch")
    heur = choose_num_splits(b, hkv, 1, args.max_model_len, num_sms(q.device))
    row: dict = {"shape": shape, "dist": dist, "b": b, "heuristic_splits": heur, "us": {}}
    for tname in args.tiles:
        tiles = TILES[tname]
        for s in sorted(set(args.splits) | {heur}):
            ms = timed(q, kc, vc, out, qsl, sl, bt, args.max_model_len, s, tiles, args)
            check(out, ref, f"{shape} {dist} B={b} splits={s} tiles={tname}", 2e-2)
            row["us"][f"{tname}/s{s}"] = ms * 1e3
            if args.lpt:  # the same launch with the sequences longest first (the engine's default)
                ms = timed(q, kc, vc, out, qsl, sl, bt, args.max_model_len, s, tiles, args, longest_first(sl))
                check(out, ref, f"{shape} {dist} B={b} splits={s} tiles={tname} lpt", 2e-2)
                row["us"][f"{tname}+lpt/s{s}"] = ms * 1e3
    best = min(row["us"], key=row["us"].get)
    cur = row["us"].get(f"default{'+lpt' if args.lpt else ''}/s{heur}")  # what the engine launches

    def gbps(us: float) -> float:
        return moved / (us * 1e-6) / 1e9

    row.update(best=best, best_us=row["us"][best], heuristic_us=cur, moved_mb=moved / 1e6)
    print(
        f"{shape:13s} {dist:4s} B={b:4d} mean ctx {sum(sl_list) / b:6.0f}  heuristic s{heur}: "
        + (f"{cur:8.1f} us {gbps(cur):5.0f} GB/s" if cur else "not timed")
        + f"   best {best:12s} {row['best_us']:8.1f} us {gbps(row['best_us']):5.0f} GB/s "
        f"({100 * gbps(row['best_us']) / copy_gbps(device):3.0f}% of copy)",
        flush=True,
    )
    print("    " + "  ".join(f"{k}={v:.1f}" for k, v in row["us"].items()), flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, no results recorded")
    ap.add_argument("--shapes", nargs="+", choices=sorted(HEADS), default=sorted(HEADS))
    ap.add_argument("--dists", nargs="+", choices=sorted(DISTS), default=sorted(DISTS))
    ap.add_argument("--batches", nargs="+", type=int, default=[8, 16, 24, 32, 48, 64, 96, 128, 192, 256])
    ap.add_argument("--splits", nargs="+", type=int, default=[1, 2, 3, 4, 6, 8, 16])
    ap.add_argument("--tiles", nargs="+", choices=sorted(TILES), default=["default", "n64s2", "n128s2"])
    ap.add_argument("--rep-ms", type=int, default=50, help="do_bench_cudagraph's repetition time a point")
    ap.add_argument("--max-model-len", type=int, default=4096, help="the max_seq_len a decode graph captures with")
    ap.add_argument("--json", metavar="PATH", help="every row, one JSON object a line")
    ap.add_argument("--lpt", action="store_true", help="time each point also with the sequences longest first")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batches, args.splits, args.max_model_len, args.tiles = [3, 5], [1, 2], 64, ["default", "n64s2"]
        args.lpt = True
    elif not torch.cuda.is_available():
        raise SystemExit("bench_attention_splits needs a CUDA GPU (use --smoke on the CPU)")
    device = "cpu" if args.smoke else "cuda"
    rows = [
        sweep_one(args, shape, dist, b, device, torch.bfloat16)
        for shape in args.shapes
        for dist in args.dists
        for b in args.batches
    ]
    if args.json:
        import json

        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    if not args.smoke:
        # The time the heuristic's choice leaves on the table, summed over the sweep's rows.
        lost = sum(r["heuristic_us"] - r["best_us"] for r in rows) / sum(r["heuristic_us"] for r in rows)
        print(f"heuristic vs best over the sweep: {100 * lost:.1f}% of the heuristic's time")
        record(SCRIPT, "attn_decode_split_heuristic_lost_frac", lost, "fraction")


if __name__ == "__main__":
    main()
