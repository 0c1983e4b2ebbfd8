"""`kvray`: the command line.

  kvray run  --config C [--input prompts.jsonl] [--output out.jsonl] [--set k=v ...] [--summary-json P]
  kvray info --config C [--set k=v ...]
  kvray stress --config C [--requests N] [--duration S] [--kill-workers K] [--abort-rate R] [--seed X]
               [--report DIR]   (the last line printed is the JSON report; exit 1 when a check fails)

All three work unchanged under `ray job submit --working-dir . -- kvray ...` (RAY_ADDRESS is set there).
Exit codes: 0 done, 1 the engine or the cluster failed, 2 bad config or arguments.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from cluster.config import ConfigError, EngineConfig, load_config, resolved_max_model_len

log = logging.getLogger("kvray")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvray", description="Ray-distributed, tensor-parallel LLM inference")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a batch of prompts (JSON lines) through the engines")
    _common(run)
    run.add_argument("--input", help="JSON lines: {id?, prompt | prompt_token_ids, sampling fields?}; "
                                     "without it, a built-in synthetic workload")
    run.add_argument("--output", help="JSON lines, appended as requests finish; a rerun skips ids already there")
    run.add_argument("--summary-json", help="also write the summary as JSON to this path")
    run.add_argument("--num-requests", type=int, default=32, help="size of the synthetic workload")
    run.add_argument("--max-tokens", type=int, default=16, help="default max_tokens for input lines without one")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--profile", metavar="DIR",
                     help="write a torch profiler trace (Chrome trace JSON) of a few steps of every worker "
                          "into DIR (on each worker's node)")
    run.add_argument("--profile-steps", type=int, default=5, help="steps to trace with --profile")
    run.add_argument("--profile-skip", type=int, default=8,
                     help="steps to let pass before tracing with --profile (past the first prefills)")
    info = sub.add_parser("info", help="what the cluster has, and what the config would place where")
    _common(info)
    st = sub.add_parser("stress", help="drive every replica with a hostile workload, kill workers, check "
                                       "nothing is lost, duplicated or corrupted")
    _common(st)
    st.add_argument("--requests", type=int, default=200, help="number of requests")
    st.add_argument("--duration", type=float, default=0.0,
                    help="spread the arrivals over this many seconds (0: all at once)")
    st.add_argument("--kill-workers", type=int, default=0,
                    help="kill this many random worker actors at random times (within max_worker_restarts)")
    st.add_argument("--abort-rate", type=float, default=0.1, help="share of requests aborted mid-flight")
    st.add_argument("--seed", type=int, default=0, help="seed of the workload, aborts and kills")
    st.add_argument("--report", help="also write DIR/stress.png: latency CDF, KV usage, running requests")
    return p


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config (default: the built-in defaults of actors/engine_config.py: CPU, tiny-random, TP=1)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field, e.g. --set cache.block_size=32 (repeatable)")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"kvray: {e}", file=sys.stderr)
        return 2
    try:
        if args.command == "stress":
            return cmd_stress(config, args)
        return cmd_run(config, args) if args.command == "run" else cmd_info(config)
    except ConfigError as e:
        print(f"kvray: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the message is the interface: one clear line, then exit 1
        from cluster.job import JobError

        print(f"kvray: {type(e).__name__}: {e}", file=sys.stderr)
        return 2 if isinstance(e, JobError) else 1


def cmd_run(config: EngineConfig, args: Any) -> int:
    from cluster.engines import EngineGroup
    from cluster.job import (Job, JobError, check_output_writable, format_summary, read_items, summarize,
                             synthetic_items)
    from cluster.llm import check_client_model, load_client_model
    from kvcore.request import SamplingParams

    if args.input is not None:
        import os

        if not os.path.isfile(args.input):
            raise JobError(f"--input {args.input!r}: no such file")
    check_output_writable(args.output)  # before any engine starts
    tokenizer, hf_config = load_client_model(config)
    if hf_config is not None:
        check_client_model(config, hf_config)
    engines = EngineGroup(config)
    try:
        info = engines.info
        if args.input is not None:
            items = read_items(args.input, SamplingParams(max_tokens=args.max_tokens))
        else:
            mml = info.get("max_model_len") or resolved_max_model_len(config, hf_config or {})
            items = synthetic_items(args.num_requests, config.model.seed, int(info["vocab_size"]), mml)
        job = Job(config, engines, tokenizer, args.output, progress=not args.no_progress)
        traces = _start_profile(engines, args)
        stats = job.run(items)
        summary = summarize(stats, engines.stats())
        if traces is not None:
            summary["profile_traces"] = _stop_profile(engines)
    finally:
        engines.shutdown()
    print(format_summary(summary))
    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary))
    return 0


def _start_profile(engines: Any, args: Any) -> str | None:
    """With --profile, every replica's workers trace a few steps; the trace directory, else None."""
    if not args.profile:
        return None
    import os

    import ray

    if args.profile_steps < 1 or args.profile_skip < 0:
        raise ConfigError(f"--profile-steps={args.profile_steps} must be >= 1 and --profile-skip="
                          f"{args.profile_skip} >= 0")
    trace_dir = os.path.abspath(args.profile)
    ray.get([d.start_profile.remote(trace_dir, args.profile_steps, args.profile_skip) for d in engines.drivers])
    return trace_dir


def _stop_profile(engines: Any) -> list[str]:
    import ray

    paths = [p for ps in ray.get([d.stop_profile.remote() for d in engines.drivers]) for p in ps]
    for p in paths:
        print(f"kvray: profiler trace {p}", file=sys.stderr)
    return paths


def cmd_stress(config: EngineConfig, args: Any) -> int:
    import ray

    from cluster.llm import check_client_model, load_client_model
    from cluster.placement import connect
    from cluster.stress import StressOptions, check_options, run_stress

    opts = StressOptions(requests=args.requests, duration_s=args.duration, kill_workers=args.kill_workers,
                         abort_rate=args.abort_rate, seed=args.seed, report_dir=args.report)
    try:
        check_options(config, opts)
    except ValueError as e:
        print(f"kvray: {e}", file=sys.stderr)
        return 2
    _, hf_config = load_client_model(config)
    if hf_config is not None:
        check_client_model(config, hf_config)
    started = connect(config)
    try:
        report, code = run_stress(config, opts)
    finally:
        if started and ray.is_initialized():
            ray.shutdown()
    if report["checks_failed"]:
        print(f"kvray stress: FAILED checks: {', '.join(report['checks_failed'])}", file=sys.stderr)
    print(json.dumps(report), flush=True)
    return code


def cmd_info(config: EngineConfig) -> int:
    import ray

    from cluster.placement import bundles_for, connect, describe_cluster, total_request

    started = connect(config)
    try:
        cluster = describe_cluster()
        need = total_request(config)
        have = cluster["cluster_resources"]
        fits = all(have.get(k, 0.0) + 1e-9 >= v for k, v in need.items())
        p = config.parallel
        report = {
            "config": config.to_dict(),
            "placement": {
                "engines": p.data_parallel_size, "workers_per_engine": p.tensor_parallel_size,
                "bundles_per_engine": bundles_for(config), "strategy": p.placement_strategy,
                "collective_backend": p.collective_backend, "transport": config.ray.transport,
                "total_request": need, "fits_cluster_totals": fits,
            },
            "cluster": cluster,
            "kv_cache": _kv_cache_info(config),
        }
        print(json.dumps(report, indent=2))
        return 0 if fits else 1
    finally:
        if started:
            ray.shutdown()


def _kv_cache_info(config: EngineConfig) -> dict:
    """One rank's KV layout and max concurrency at max_model_len (hybrid groups vs all full attention),
    from config.json alone; the pool size is known here only when fixed or on the CPU."""
    from actors.kv_memory import kv_cache_report
    from actors.loader import read_hf_config, resolve_dtype, resolve_model_dir
    try:
        hf_config = read_hf_config(resolve_model_dir(config.model.model))
        c = config.cache
        budget = int(c.cpu_kv_cache_gib * 2**30) if config.parallel.device == "cpu" else None
        return kv_cache_report(hf_config, resolve_dtype(config.model.dtype, hf_config), c.block_size,
                               config.parallel.tensor_parallel_size, resolved_max_model_len(config, hf_config),
                               config.scheduler.max_num_batched_tokens, c.num_gpu_blocks,
                               None if c.num_gpu_blocks else budget)
    except (OSError, ValueError) as e:
        return {"error": str(e)}


if __name__ == "__main__":
    sys.exit(main())
