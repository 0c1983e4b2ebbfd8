"""A long fuzz run: >= 10,000 hostile input lines (the kinds tests/fuzz_strategies.py draws) through `kvray run`.

Checks what the CI fuzz test checks, at scale: every non-blank line gets exactly one record (an output or
an error), the good lines among them are served, and the job ends normally. Runs on the CPU with the
built-in tiny-random model and an embedded Ray.

    PYTHONPATH=$PWD python -m benchmarks.checks.check_fuzz_long --lines 10000 [--seed 0] [--keep DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import record

ROOT = Path(__file__).resolve().parents[2]

BAD_TEXT = ["\ud800", "a\udc80b", "\udfff\ud800", "\x00", "\u2028", "\ufeff", "\U0010ffff", "\x1b[2J"]
EDGE = [
    0,
    1,
    -1,
    2**31 - 1,
    2**31,
    2**63,
    2**64,
    10**30,
    1e-50,
    1e300,
    float("inf"),
    float("nan"),
    0.5,
    2.0,
    True,
    None,
    "x",
    [],
    {},
    [1, "a"],
]
FIELDS = [
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "seed",
    "ignore_eos",
    "stop_token_ids",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
    "n",
    "stop",
    "no_such_field",
]


def _value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if r < 0.4:
        return rng.choice(EDGE)
    if r < 0.55:
        return rng.randint(-(2**70), 2**70)
    if r < 0.7:
        return rng.uniform(-1e3, 1e3)
    if r < 0.85 or depth > 3:
        return "".join(rng.choice(["a", "é", "中", " ", "\\", '"', *BAD_TEXT]) for _ in range(rng.randint(0, 8)))
    if r < 0.93:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {str(_value(rng, depth + 1)): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _dump(obj: Any, rng: random.Random) -> bytes:
    text = json.dumps(obj, ensure_ascii=rng.random() < 0.5, allow_nan=True)
    return text.encode("utf-8", "surrogatepass")  # a raw lone surrogate becomes invalid UTF-8


def _line(rng: random.Random) -> bytes:
    r = rng.random()
    if r < 0.3:  # good
        ids = [rng.randrange(260) for _ in range(rng.randint(1, 8))]
        return json.dumps({"prompt_token_ids": ids, "max_tokens": rng.randint(1, 4), "ignore_eos": True}).encode()
    if r < 0.75:  # a record with hostile fields
        rec = {}
        if rng.random() < 0.5:
            rec["id"] = _value(rng)
        key = rng.choice(["prompt", "prompt_token_ids", "both", "neither"])
        if key in ("prompt", "both"):
            rec["prompt"] = _value(rng)
        if key in ("prompt_token_ids", "both"):
            rec["prompt_token_ids"] = rng.choice([[rng.randrange(260) for _ in range(3)], [_value(rng)], _value(rng)])
        for name in rng.sample(FIELDS, rng.randint(0, 4)):
            rec[name] = _value(rng)
        line = _dump(rec, rng)
        return line[: rng.randint(1, len(line))] if rng.random() < 0.1 else line  # some cut short
    if r < 0.85:
        return _dump(_value(rng), rng)  # not an object
    if r < 0.95:
        return b"x" + bytes(rng.randrange(256) for _ in range(rng.randint(0, 40))).replace(b"\n", b" ").replace(
            b"\r", b" "
        )
    n = rng.choice([10, 1000, 100_000]) if rng.random() < 0.9 else 100_000
    return rng.choice(
        [
            b"[" * n + b"]" * n,
            b'{"prompt_token_ids": [' + b"9" * min(n, 20_000) + b"]}",
            b'{"prompt_token_ids": [1], "seed": ' + b"9" * min(n, 5000) + b"}",
        ]
    )


def generate(n: int, seed: int) -> list[bytes]:
    """n hostile lines of the same kinds as tests/fuzz_strategies.py, from a seeded generator (hypothesis
    is too slow to draw 10,000 lines here; the CI test uses it, with shrinking)."""
    rng = random.Random(seed)
    return [_line(rng) for _ in range(n)]


def check(lines: list[bytes], out_path: Path) -> dict:
    expected = [i for i, raw in enumerate(lines, start=1) if raw.strip()]
    recs = [json.loads(t) for t in out_path.read_text(encoding="utf-8").splitlines()]
    per_line = collections.Counter(r["line"] for r in recs)
    missing = [i for i in expected if per_line[i] == 0]
    twice = [i for i, c in per_line.items() if c > 1]
    errors = sum(1 for r in recs if r["error"] is not None)
    good = sum(1 for r in recs if r["error"] is None and r["output_token_ids"])
    return {
        "lines": len(lines),
        "expected_answers": len(expected),
        "records": len(recs),
        "missing": missing[:20],
        "num_missing": len(missing),
        "answered_twice": twice[:20],
        "errors": errors,
        "served": good,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", help="write in.jsonl / out.jsonl here (default: a temporary directory)")
    args = ap.parse_args(argv)
    work = Path(args.keep or tempfile.mkdtemp(prefix="kvray-fuzz-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    lines = generate(args.lines, args.seed)
    gen_s = time.monotonic() - t0
    (work / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    out = work / "out.jsonl"
    if out.exists():
        out.unlink()
    cmd = [
        sys.executable,
        "-m",
        "cluster.cli",
        "run",
        "--config",
        str(ROOT / "configs/local.yaml"),
        "--input",
        str(work / "in.jsonl"),
        "--output",
        str(out),
        "--max-tokens",
        "4",
        "--set",
        "model.max_model_len=128",
        "--set",
        "cache.num_gpu_blocks=256",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t1 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_s = time.monotonic() - t1
    result = check(lines, out) if out.exists() else {"records": 0}
    result.update(rc=proc.returncode, generate_s=round(gen_s, 1), run_s=round(run_s, 1), dir=str(work))
    print(json.dumps(result, indent=1))
    if proc.returncode not in (0, 3):  # 3: the job ran, and some lines got error records
        print(proc.stderr[-4000:], file=sys.stderr)
    ok = proc.returncode in (0, 3) and result.get("num_missing") == 0 and not result.get("answered_twice")
    record("fuzz_long", "lines_answered_exactly_once", result.get("records", 0), "lines")
    record("fuzz_long", "run_wall_s", run_s, "s")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
