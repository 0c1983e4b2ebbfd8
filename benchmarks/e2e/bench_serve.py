"""Online serving: `kvray serve` under a sweep of request rates, low to saturation, as vLLM's `bench serve`.

The client streams /v1/completions (token-id prompts, greedy, EOS ignored, return_token_ids so that each
step's tokens make a chunk) with Poisson arrivals at each rate, and measures per request TTFT (send ->
first token), TPOT ((last - first token) / (tokens - 1)) and every inter-token latency (ITL), p50 and
p99, with output tok/s and request/s per rate. Rate `inf` sends everything at once: saturation. The
offline figure is LLM.generate on the same workload, measured first in the same run (one GPU: the
offline engine is shut down before the server starts).

Records (not with --smoke): serve_vs_offline_ratio (saturation output tok/s over offline),
serve_ttft_p99_ms_qwen3_rate_half (TTFT p99 at half the saturation request rate), per-rate figures;
with --compare, serve_vs_offline_ratio_<setting> per setting (`default`: serve_vs_offline_ratio).
Every saturation run prints each server process's CPU per output token and its utilisation (cores), to
show which one saturates (benchmarks/e2e/serve_procs.py); --profile DIR adds py-spy stacks of each.

  python -m benchmarks.e2e.bench_serve --shape qwen3-0.6b                     # the H200 sweep (~5 minutes)
  python -m benchmarks.e2e.bench_serve --shape llama-3.1-8b --num-prompts 500
  python -m benchmarks.e2e.bench_serve --compare default serve.stream_interval=4 --profile /tmp/prof
  python -m benchmarks.e2e.bench_serve --smoke                                # CPU, tiny-random, seconds of load
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

TAGS = {"qwen3-0.6b": "qwen3", "llama-3.1-8b": "llama8b"}


@dataclass
class Outcome:
    ok: bool
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    num_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """vLLM's bench serve: (last token's time - first token's) / (output tokens - 1). The mean
        gap between chunks is that only while each chunk holds one token (stream batching packs ~15)."""
        return sum(self.itl_s) / (self.num_tokens - 1) if self.itl_s and self.num_tokens > 1 else None


def sharegpt_like(n: int, vocab: int, seed: int, smoke: bool) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens): log-normal lengths of about 200 in / 180 out (smoke: a few tokens)."""
    if smoke:
        rng = random.Random(seed)
        return [([rng.randrange(vocab) for _ in range(rng.randint(4, 24))], rng.randint(2, 6)) for _ in range(n)]
    from benchmarks.e2e.bench_offline import make_workload

    prompts, params = make_workload("sharegpt", vocab)
    return [(p, sp["max_tokens"]) for p, sp in zip(prompts[:n], params[:n], strict=True)]


async def one_request(http: Any, url: str, model: str, prompt: list[int], max_tokens: int) -> Outcome:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    n = 0
    try:
        async with http.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return Outcome(False, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Outcome(False, error=str(chunk["error"].get("message")))
                got = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
                if got:
                    n += got
                    stamps.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        return Outcome(False, error=f"{type(e).__name__}: {e}")
    if not stamps:
        return Outcome(False, error="no tokens")
    return Outcome(True, stamps[0] - t0, [b - a for a, b in itertools.pairwise(stamps)], n)


async def run_rate(url: str, model: str, reqs: list[tuple[list[int], int]], rate: float, seed: int) -> dict:
    """Send `reqs` with Poisson arrivals at `rate` requests/s (inf: all at once); the rate's figures."""
    import aiohttp

    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        tasks = []
        t0 = time.perf_counter()
        for prompt, max_tokens in reqs:
            tasks.append(asyncio.create_task(one_request(http, url, model, prompt, max_tokens)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        outs = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    return summarize(rate, outs, elapsed)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3


def summarize(rate: float, outs: list[Outcome], elapsed: float) -> dict:
    ok = [o for o in outs if o.ok]
    ttft = [o.ttft_s for o in ok]
    tpot = [t for t in (o.tpot_s for o in ok) if t is not None]
    itl = [x for o in ok for x in o.itl_s]
    tokens = sum(o.num_tokens for o in ok)
    chunks = sum(len(o.itl_s) + 1 for o in ok)  # SSE chunks that carried tokens
    res = {
        "rate": rate,
        "completed": len(ok),
        "failed": len(outs) - len(ok),
        "elapsed_s": elapsed,
        "request_s": len(ok) / elapsed,
        "output_tok_s": tokens / elapsed,
        "tokens_per_chunk": tokens / chunks if chunks else None,
    }
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        res[f"{name}_p50_ms"], res[f"{name}_p99_ms"] = _pct(xs, 0.5), _pct(xs, 0.99)
    errors = [o.error for o in outs if not o.ok]
    if errors:
        res["first_error"] = errors[0]
    return res


RATE_WINDOW_S = 30.0  # a finite rate sends at most this many seconds of arrivals (at least MIN_PER_RATE)
MIN_PER_RATE = 20


async def sweep(
    url: str,
    model: str,
    reqs: list[tuple[list[int], int]],
    rates: list[float],
    seed: int = 0,
    profile: str | None = None,
) -> list[dict]:
    """Saturation first (rate inf), then each rate, then half the saturation request rate."""
    out = [await saturation(url, model, reqs, seed, profile)]
    half = out[0]["request_s"] / 2
    for r in [*rates, half]:
        n = min(len(reqs), max(MIN_PER_RATE, int(r * RATE_WINDOW_S)))
        res = await run_rate(url, model, reqs[:n], r, seed)
        res["half_saturation"] = r is half
        out.append(res)
    return out


async def saturation(url: str, model: str, reqs: list[tuple[list[int], int]], seed: int, profile: str | None) -> dict:
    """Rate inf, with each server process's CPU cost ("process_cpu") and, with `profile`, py-spy stacks."""
    from benchmarks.e2e.serve_procs import ProcessMeter, format_costs, py_spy, serve_processes

    meter = ProcessMeter(serve_processes())
    spies = py_spy(profile, 8, meter.pids) if profile else []
    meter.start()
    res = await run_rate(url, model, reqs, float("inf"), seed)
    res["process_cpu"] = meter.stop(res["elapsed_s"], res["output_tok_s"] * res["elapsed_s"])
    for p in spies:
        p.wait()
    print(f"  server processes at saturation: {format_costs(res['process_cpu'])}", flush=True)
    return res


def family_workload(n: int, vocab: int, max_total: int) -> list[tuple[list[int], int]]:
    """The stress run's workload (cluster/stress/workload.py): 75% of prompts open with one of n/20
    shared long prefixes (its families)."""
    from cluster.stress.workload import WorkloadShape, make_workload

    wl = make_workload(n, 0, WorkloadShape(vocab_size=vocab, max_total_tokens=max_total), abort_rate=0.0)
    return [(r.prompt_token_ids, min(r.sampling.max_tokens, 4)) for r in wl]


def cached_share(url: str) -> float:
    """The server's share of prompt tokens that came from the prefix cache (GET /metrics)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=60) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("kvray_serve_prompt_cached_share "):
                return float(line.split()[1])
    raise RuntimeError("GET /metrics: no kvray_serve_prompt_cached_share")


def families(config: Any, n: int, vocab: int, rate: float) -> dict[str, float]:
    """The prefix-cache share that routing buys on the stress workload's families: two replicas,
    prefix affinity on, then off, the same requests at the same Poisson rate."""
    from cluster.serve.app import start_server, stop_server

    reqs = family_workload(n, vocab, min(config.model.max_model_len or 512, 512))
    out = {}
    for affinity in (True, False):
        key = "on" if affinity else "off"
        c = config.replace(data_parallel_size=2, prefix_affinity=affinity)
        port = free_port()
        started = start_server(c, "127.0.0.1", port)
        try:
            res = asyncio.run(run_rate(f"http://127.0.0.1:{port}", c.model.model, reqs, rate, 0))
            if res["failed"]:
                raise SystemExit(f"bench_serve --families: {res['failed']} failed: {res.get('first_error')}")
            out[key] = cached_share(f"http://127.0.0.1:{port}")
        finally:
            stop_server(started)
        print(f"prefix affinity {key}: cached share of prompt tokens {out[key]:.3f} ({format_row(res)})", flush=True)
    return out


def offline_tok_s(config: Any, reqs: list[tuple[list[int], int]]) -> float:
    from cluster import LLM, SamplingParams

    llm = LLM(config=config)
    try:
        llm.generate([{"prompt_token_ids": reqs[0][0][:8]}], SamplingParams(max_tokens=4), use_tqdm=False)
        sps = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m) for _, m in reqs]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], sps, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    finally:
        llm.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def format_row(r: dict) -> str:
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:8.1f}"

    rate = "inf" if r["rate"] == float("inf") else f"{r['rate']:.2f}"
    return (
        f"rate {rate:>7} req/s: {r['completed']:5d} ok {r['failed']:3d} failed  {r['request_s']:7.2f} req/s "
        f"{r['output_tok_s']:9.1f} tok/s  TTFT p50/p99 {f(r['ttft_p50_ms'])}/{f(r['ttft_p99_ms'])} ms  "
        f"TPOT {f(r['tpot_p50_ms'])}/{f(r['tpot_p99_ms'])} ms  ITL {f(r['itl_p50_ms'])}/{f(r['itl_p99_ms'])} ms"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(TAGS), default="qwen3-0.6b")
    ap.add_argument("--model-dir", default="/tmp/kvray-models")
    ap.add_argument("--config", default="configs/gpu.yaml")
    ap.add_argument("--num-prompts", type=int, default=500)
    ap.add_argument(
        "--rates",
        default="2,8,32",
        help="request rates (req/s) besides inf and half saturation; a finite rate sends at most "
        f"{RATE_WINDOW_S:g} s of arrivals",
    )
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--no-offline", action="store_true", help="skip the offline LLM.generate run")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny-random, a few short requests; records nothing")
    ap.add_argument(
        "--families",
        action="store_true",
        help="instead of the sweep: the prefix-cache share with prefix affinity on vs off, two replicas, "
        "on the stress workload's prefix families",
    )
    ap.add_argument(
        "--compare",
        nargs="+",
        metavar="K=V[,K=V]",
        default=None,
        help="instead of the sweep: saturation only, one fresh server per setting ('default' = the "
        "config as it is), each against the offline figure: an A/B of serve settings in one run",
    )
    ap.add_argument("--families-rate", type=float, default=8.0, help="request rate of --families (req/s)")
    ap.add_argument("--profile", default=None, help="a folder: py-spy stacks of each server process at saturation")
    args = ap.parse_args(argv)
    from cluster.config import load_config
    from cluster.serve.app import start_server, stop_server

    if args.smoke:
        config = load_config("configs/local.yaml", {"model.max_model_len": 128, "ray.include_dashboard": False})
        vocab, n = 256, min(args.num_prompts, 16)
    else:
        from benchmarks.common import SHAPES, make_random_model

        model_dir = make_random_model(args.shape, args.model_dir)
        config = load_config(args.config, {"model.model": model_dir, "model.max_model_len": 4096})
        vocab, n = SHAPES[args.shape]["vocab_size"], args.num_prompts
    # Saturation queues every request: the bound per replica must not refuse the benchmark's own burst.
    config = config.replace(max_queued_requests=max(config.serve.max_queued_requests, n))
    if args.families:
        shares = families(config, min(args.num_prompts, 160) if args.smoke else n, vocab, args.families_rate)
        print(json.dumps({"families_cached_share": shares}), flush=True)
        if not args.smoke:
            from benchmarks.common import record

            for key, suffix in (("on", "affinity"), ("off", "no_affinity")):
                record("bench_serve", f"serve_{TAGS[args.shape]}_families_cached_share_{suffix}", shares[key], "share")
        return
    reqs = sharegpt_like(n, vocab, 0, args.smoke)
    offline = None if args.no_offline else offline_tok_s(config, reqs)
    if offline is not None:
        print(f"offline LLM.generate: {offline:.1f} output tok/s", flush=True)
    if args.compare:
        compare(config, reqs, offline, args.compare, args.profile, args.shape, args.smoke)
        return
    port = args.port or free_port()
    started = start_server(config, "127.0.0.1", port)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(run_rate(url, config.model.model, reqs[:4], float("inf"), 1))  # warm-up
        rates = [float(r) for r in args.rates.split(",") if r] if not args.smoke else [4.0]
        results = asyncio.run(sweep(url, config.model.model, reqs, rates, profile=args.profile))
    finally:
        stop_server(started)
    for r in results:
        print(format_row(r), flush=True)
    print(json.dumps({"offline_tok_s": offline, "sweep": results}), flush=True)
    if any(r["failed"] for r in results):
        raise SystemExit(f"bench_serve: failed requests: {[r.get('first_error') for r in results if r['failed']]}")
    if not args.smoke:
        _record(args.shape, offline, results)


def compare(
    config: Any,
    reqs: list[tuple[list[int], int]],
    offline: float | None,
    settings: list[str],
    profile: str | None,
    shape: str,
    smoke: bool = False,
) -> None:
    from benchmarks.common import record
    from cluster.config import apply_overrides
    from cluster.serve.app import start_server, stop_server

    for setting in settings:
        c = config if setting == "default" else apply_overrides(config, setting.split(","))
        port = free_port()
        started = start_server(c, "127.0.0.1", port)
        slug = re.sub(r"[^A-Za-z0-9]+", "_", setting).strip("_")
        try:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(run_rate(url, c.model.model, reqs[:4], float("inf"), 1))  # warm-up
            res = asyncio.run(saturation(url, c.model.model, reqs, 0, f"{profile}/{slug}" if profile else None))
        finally:
            stop_server(started)
        ratio = f"  ratio {res['output_tok_s'] / offline:.3f}" if offline else ""
        print(f"[{setting}] {format_row(res)}  tokens/chunk {res['tokens_per_chunk'] or 0:.1f}{ratio}", flush=True)
        if offline and not res["failed"] and not smoke:
            name = ratio_metric(shape) + ("" if setting == "default" else f"_{slug}")
            record("bench_serve", name, res["output_tok_s"] / offline, "x")


def ratio_metric(shape: str) -> str:
    """serve_vs_offline_ratio names the Qwen3 shape's; the others carry their tag."""
    tag = TAGS[shape]
    return "serve_vs_offline_ratio" + ("" if tag == "qwen3" else f"_{tag}")


def _record(shape: str, offline: float | None, results: list[dict]) -> None:
    from benchmarks.common import record

    tag = TAGS[shape]
    sat, half = results[0], next(r for r in results if r.get("half_saturation"))
    record("bench_serve", f"serve_{tag}_saturation_output_tok_s", sat["output_tok_s"], "tok/s")
    if offline:
        record("bench_serve", ratio_metric(shape), sat["output_tok_s"] / offline, "x")
    record("bench_serve", f"serve_ttft_p99_ms_{tag}_rate_half", half["ttft_p99_ms"], "ms")
    for r in results[1:]:
        name = "half" if r.get("half_saturation") else f"{r['rate']:g}"
        record("bench_serve", f"serve_{tag}_rate_{name}_output_tok_s", r["output_tok_s"], "tok/s")
        record("bench_serve", f"serve_{tag}_rate_{name}_tpot_p50_ms", r["tpot_p50_ms"] or 0.0, "ms")


if __name__ == "__main__":
    main()
