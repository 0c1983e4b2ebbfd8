"""The decode tiles an end-to-end A/B should try, from bench_attention_splits.py --json rows: of the
tile shapes other than the default, the one with the least time summed over the rows (unsplit, which is
how batches of >= 17 rows x 8 KV heads run), printed as KVRAY_DECODE_TILES's BLOCK_N:WARPS:STAGES.

  python -m benchmarks.tools.pick_decode_tiles sweep.jsonl [--shape llama-3.1-8b] [--min-batch 128]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def pick(rows: list[dict], shape: str, min_batch: int, tiles: dict) -> tuple[str, dict[str, float]]:
    totals: dict[str, float] = {}
    for r in rows:
        if r["shape"] != shape or r["b"] < min_batch:
            continue
        for key, us in r["us"].items():
            name, splits = key.split("/")
            if splits == "s1" and name != "default" and "+" not in name:  # "+lpt": an order, not tiles
                totals[name] = totals.get(name, 0.0) + us
    if not totals:
        raise SystemExit(f"no unsplit rows of {shape} with B >= {min_batch}")
    best = min(totals, key=lambda name: totals[name])
    t = tiles[best]
    return f"{t.block_n}:{t.num_warps}:{t.num_stages}", totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep")
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--min-batch", type=int, default=128)
    a = ap.parse_args()
    from benchmarks.kernels.bench_attention_splits import TILES

    rows = [json.loads(line) for line in Path(a.sweep).read_text().splitlines() if line.strip()]
    value, totals = pick(rows, a.shape, a.min_batch, TILES)
    print(" ".join(f"{k}={v:.0f}us" for k, v in sorted(totals.items(), key=lambda kv: kv[1])), file=sys.stderr)
    print(value)


if __name__ == "__main__":
    main()
