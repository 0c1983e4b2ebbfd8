"""Summarize py-spy raw profiles (folded stacks: `frame;frame;...;frame count` a line), one per process,
as bench_serve.py --profile and bench_serve_ceiling.py --profile write them: samples, and the frames with
the most samples of their own and in all (inclusive), each as a share of the process's samples.

With `--gil` (how those scripts record), a sample is a moment that process held the GIL: samples over
(seconds x rate) is how busy its Python was.

  python -m benchmarks.tools.summarize_pyspy /tmp/prof [--top 15] [--rate 50 --seconds 8]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path


def read_folded(path: Path) -> tuple[collections.Counter[str], collections.Counter[str], int]:
    """(samples by leaf frame, samples by any frame on the stack, all samples) of one raw profile."""
    own: collections.Counter[str] = collections.Counter()
    anywhere: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        total += count
        frames = stack.split(";")
        own[frames[-1]] += count
        for f in set(frames):
            anywhere[f] += count
    return own, anywhere, total


def summarize(path: Path, top: int, budget: int | None) -> str:
    own, anywhere, total = read_folded(path)
    head = f"== {path.name}: {total} samples"
    if budget:
        head += f" ({total / budget:.0%} of {budget}: the share of the time this process held the GIL)"
    if not total:
        return head
    lines = [head, "-- own"]
    lines += [f"{c / total:6.1%}  {f[:140]}" for f, c in own.most_common(top)]
    lines.append("-- inclusive")
    lines += [f"{c / total:6.1%}  {f[:140]}" for f, c in anywhere.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="a raw profile, or a folder of them (searched recursively)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--rate", type=int, default=50, help="py-spy's sampling rate (-r)")
    ap.add_argument("--seconds", type=int, default=8, help="py-spy's duration (-d)")
    args = ap.parse_args(argv)
    root = Path(args.path)
    files = sorted(root.rglob("*.txt")) if root.is_dir() else [root]
    if not files:
        sys.exit(f"summarize_pyspy: no profiles under {root}")
    for f in files:
        print(summarize(f, args.top, args.rate * args.seconds), flush=True)


if __name__ == "__main__":
    main()
