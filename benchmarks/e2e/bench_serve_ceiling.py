"""The serve path's host ceiling: the server against LLM.generate with the no-op worker (CPU, no GPU).

The no-op worker (actors/worker/noop.py) answers every step at once, so the engine runs as fast as
its host side can; what the server loses against LLM.generate on the same requests is the cost of the
serving path alone (ingress, Serve's proxy, SSE, the client). bench_serve.py's client, rate inf.
The client model has no tokenizer by default (as the GPU sweep's random-weight models): token ids
only, no detokenization; --detokenize keeps tiny-random's tokenizer.

  python -m benchmarks.e2e.bench_serve_ceiling                       # 256 requests x 64 tokens, ~1 minute
  python -m benchmarks.e2e.bench_serve_ceiling --runs 3 --profile /tmp/prof   # + py-spy of every Ray process
  python -m benchmarks.e2e.bench_serve_ceiling --step-ms 20 --num-prompts 64 --max-tokens 128   # paced engine

Unpaced, the serving path is the bottleneck and coalesces tokens into few large chunks, so per-request
costs dominate. --step-ms paces the engine (every step takes that long, as on a GPU): when the path
keeps up, one chunk a step per request, and its CPU us per token is the per-chunk cost to cut.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from actors.worker.noop import NoopWorker
from benchmarks.e2e.bench_serve import format_row, free_port, run_rate, saturation
from kvcore.messages import ModelRunnerOutput, SchedulerOutput

NOOP = "actors.worker.noop.NoopWorker"
PACED = "benchmarks.e2e.bench_serve_ceiling.PacedNoopWorker"
STEP_ENV = "KVRAY_BENCH_NOOP_STEP_S"


class PacedNoopWorker(NoopWorker):
    """The no-op worker, each step taking KVRAY_BENCH_NOOP_STEP_S seconds (a GPU step's time)."""

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        time.sleep(float(os.environ.get(STEP_ENV, "0")))
        return super().execute_model(so)


def client_model_dir(detokenize: bool) -> str:
    """tiny-random's config, without its tokenizer unless `detokenize`."""
    from actors.models.loader import resolve_model_dir

    src = resolve_model_dir("tiny-random")
    if detokenize:
        return src
    dst = Path(tempfile.gettempdir()) / "kvray-noop-model"
    dst.mkdir(exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(Path(src) / name, dst / name)
    return str(dst)


def offline(config: Any, reqs: Any, worker: str) -> float:
    from cluster import LLM, SamplingParams

    llm = LLM(config=config, worker_cls=worker)
    try:
        sps = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m) for _, m in reqs]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], sps, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    finally:
        llm.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2, help="serve runs (after one warm-up); the median is reported")
    ap.add_argument("--detokenize", action="store_true")
    ap.add_argument("--step-ms", type=float, default=0.0, help="pace every engine step to this many ms")
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="K=V", help="config overrides (serve.x=y)")
    ap.add_argument("--profile", default=None, help="a folder: py-spy raw profiles of the last run")
    args = ap.parse_args(argv)
    from cluster.config import load_config, parse_override
    from cluster.serve.app import start_server, stop_server

    n = args.num_prompts
    worker = NOOP
    if args.step_ms:
        # The worker processes inherit this environment: they find this module, and the pace.
        os.environ[STEP_ENV] = str(args.step_ms / 1e3)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
        )
        worker = PACED
    config = load_config(
        "configs/local.yaml",
        {
            "model.model": client_model_dir(args.detokenize),
            "model.max_model_len": 1024,
            "scheduler.max_num_seqs": 256,
            "scheduler.max_num_batched_tokens": 8192,
            "ray.include_dashboard": False,
            "serve.max_queued_requests": n,
            **dict(parse_override(kv) for kv in args.set),
        },
    )
    rng = random.Random(0)
    reqs = [([rng.randrange(256) for _ in range(rng.randint(8, 32))], args.max_tokens) for _ in range(n)]
    off = None if args.no_offline else offline(config, reqs, worker)
    port = free_port()
    started = start_server(config, "127.0.0.1", port, worker_cls=worker)
    url, sat = f"http://127.0.0.1:{port}", []
    try:
        asyncio.run(run_rate(url, config.model.model, reqs[:16], float("inf"), 1))  # warm-up
        for k in range(args.runs):
            profile = args.profile if k == args.runs - 1 else None
            res = asyncio.run(saturation(url, config.model.model, reqs, 0, profile))
            print(format_row(res), f" tokens per chunk {res['tokens_per_chunk']:.1f}", flush=True)
            if res["failed"]:
                raise SystemExit(f"bench_serve_ceiling: {res['failed']} failed: {res.get('first_error')}")
            sat.append(res["output_tok_s"])
    finally:
        stop_server(started)
    serve_tok_s = statistics.median(sat)
    print(
        json.dumps(
            {"offline_tok_s": off, "serve_tok_s": serve_tok_s, "runs": sat, "ratio": serve_tok_s / off if off else None}
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
