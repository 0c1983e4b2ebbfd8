"""Memory and time of `kvray run` on a large input (issue 15: inputs that outgrow one file).

Writes N short token-id prompts (max_tokens=1) as S shards, runs `kvray run --input DIR` in a child
process on the embedded CPU default, and reports the child's peak RSS (the client: reading, the request
window, the writer, the resume digests), the wall time, and the output's line count. Then it reruns on
the finished output (every line skipped: the resume pass over N ids) and reports that too.

  python -m benchmarks.e2e.bench_job_million --lines 1000000 --shards 8 [--set scheduler.max_num_seqs=256 ...]

Prints one JSON line. Engine memory (the driver and worker actors) is Ray's and not counted here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])


def write_shards(d: str, lines: int, shards: int, seed: int) -> int:
    rng = random.Random(seed)
    per = -(-lines // shards)
    size = 0
    for s in range(shards):
        with open(os.path.join(d, f"part-{s:03d}.jsonl"), "w") as f:
            for i in range(s * per, min(lines, (s + 1) * per)):
                ids = [rng.randrange(1, 250) for _ in range(rng.randint(2, 8))]
                rec = {"id": f"r{i}", "prompt_token_ids": ids, "max_tokens": 1, "ignore_eos": True}
                f.write(json.dumps(rec) + "\n")
            size += f.tell()
    return size


def run(args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("TRITON_INTERPRET", None)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "cluster.cli", *args], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    # RUSAGE_CHILDREN: the largest RSS of any waited-for child so far; runs go in increasing order here.
    rss_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    if r.returncode != 0:
        raise SystemExit(f"kvray run failed ({r.returncode}): {r.stderr[-3000:]}")
    return {
        "wall_s": round(wall, 1),
        "peak_rss_mib_so_far": round(rss_mib, 1),
        "summary": json.loads(r.stdout.strip().splitlines()[-1]),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lines", type=int, default=1_000_000)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvray-million-") as d:
        inp = os.path.join(d, "in")
        os.mkdir(inp)
        t0 = time.monotonic()
        in_bytes = write_shards(inp, a.lines, a.shards, a.seed)
        gen_s = time.monotonic() - t0
        out = os.path.join(d, "out.jsonl")
        common = ["run", "--config", "configs/local.yaml", "--no-progress", "--input", inp, "--output", out]
        for o in a.overrides:
            common += ["--set", o]
        first = run(common)
        with open(out, "rb") as f:
            out_lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
        out_bytes = os.path.getsize(out)
        again = run(common)
    s1, s2 = first["summary"], again["summary"]
    print(
        json.dumps(
            {
                "lines": a.lines,
                "shards": a.shards,
                "input_mib": round(in_bytes / 2**20, 1),
                "generate_s": round(gen_s, 1),
                "run_wall_s": first["wall_s"],
                "run_peak_rss_mib": first["peak_rss_mib_so_far"],
                "completed": s1["completed"],
                "errors": s1["errors"],
                "requests_per_s": round(s1["completed"] / s1["wall_s"], 1),
                "output_lines": out_lines,
                "output_mib": round(out_bytes / 2**20, 1),
                "resume_wall_s": again["wall_s"],
                "resume_skipped": s2["skipped_already_done"],
                "peak_rss_mib_both_runs": again["peak_rss_mib_so_far"],
                "overrides": a.overrides,
            }
        )
    )


if __name__ == "__main__":
    main()
