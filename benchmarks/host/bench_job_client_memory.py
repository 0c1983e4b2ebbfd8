"""The batch job's own memory and time on N lines, without an engine: the input is read, parsed and
checked, every line goes through the job's window, output processing and writer, against the in-process
engine double of the tests (tests/job_helpers.py, which answers at once); then a rerun skips every line
(the resume pass). Peak RSS of this process before and after: what the job holds, not the model's.

  python -m benchmarks.host.bench_job_client_memory 1000000      # prints one JSON line
  python -m benchmarks.host.bench_job_client_memory --smoke      # 2,000 lines (CI)
"""

import argparse
import json
import os
import resource
import shutil
import tempfile
import time

from cluster.config import EngineConfig
from cluster.job.input import InputReader, resolve_shards
from cluster.job.runner import Job
from kvcore.request import SamplingParams
from tests.job_helpers import FakeEngines


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lines", type=int, nargs="?", default=1_000_000)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="2,000 lines: the script runs")
    args = ap.parse_args(argv)
    measure(2000 if args.smoke else args.lines, args.shards)


def measure(n: int, shards: int) -> None:
    d = tempfile.mkdtemp(prefix="kvray-mem-")
    try:
        os.mkdir(f"{d}/in")
        for s in range(shards):
            with open(f"{d}/in/p{s}.jsonl", "w") as f:
                for i in range(s * n // shards, (s + 1) * n // shards):
                    f.write(json.dumps({"id": f"r{i}", "prompt_token_ids": [i % 200 + 1, 7], "max_tokens": 1}) + "\n")
        base = rss_mib()
        runs = []
        for _ in range(2):
            t0 = time.monotonic()
            st = Job(EngineConfig(), FakeEngines(), None, f"{d}/out.jsonl", progress=False).run(
                InputReader(resolve_shards(f"{d}/in"), SamplingParams(max_tokens=1))
            )
            runs.append((st, time.monotonic() - t0, rss_mib()))
        print(
            json.dumps(
                {
                    "lines": n,
                    "completed": runs[0][0].completed,
                    "run_s": round(runs[0][1], 1),
                    "resume_skipped": runs[1][0].skipped,
                    "resume_s": round(runs[1][1], 1),
                    "rss_before_mib": round(base),
                    "peak_rss_run_mib": round(runs[0][2]),
                    "peak_rss_after_resume_mib": round(runs[1][2]),
                }
            )
        )
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
