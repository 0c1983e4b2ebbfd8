"""`kvray`: the command line.

  kvray [-v] run  --config C [--input FILE|DIR|GLOB|-] [--output out.jsonl] [--set k=v ...] [--summary-json P]
  kvray [-v] info --config C [--set k=v ...] [--json]
  kvray [-v] stress --config C [--requests N] [--duration S] [--kill-workers K] [--kill-nodes K]
                    [--abort-rate R] [--seed X] [--report DIR]
                    (the last line printed is the JSON report; exit 1 when a check fails)
  kvray [-v] serve --config C [--host 127.0.0.1] [--port 8000] [--set k=v ...]   (OpenAI-compatible, Ray Serve)
  kvray --version

All of them work unchanged under `ray job submit --working-dir . -- kvray ...` (RAY_ADDRESS is set there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:  # imported where used: a Ctrl-C while importing must reach main()'s handler (see main)
    from cluster.config import EngineConfig

log = logging.getLogger("kvray")

EXIT_OK = 0  # every line answered
EXIT_FAILED = 1  # the engine or the cluster failed (or the output could not be written): rerun to resume
EXIT_USAGE = 2  # a bad config, argument, input or output path, or a model path that does not exist
EXIT_LINE_ERRORS = 3  # the job finished, but some lines got error records (the count is on the last line)
EXIT_INTERRUPTED = 130  # Ctrl-C
EXIT_CLOSED_OUTPUT = 141  # the reader of stdout went away (`--output - | head`): 128 + SIGPIPE, as Unix tools

EXIT_CODES = f"""exit codes: {EXIT_OK} every line answered; {EXIT_FAILED} the engine or cluster failed \
(rerun to resume);
{EXIT_USAGE} bad config, arguments, input/output path or model path (checked before Ray starts);
{EXIT_LINE_ERRORS} finished, some lines got error records; {EXIT_INTERRUPTED} interrupted (rerun to resume);
{EXIT_CLOSED_OUTPUT} the reader of stdout went away (--output - | head)"""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvray")
    except PackageNotFoundError:
        return "0.1.0 (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvray",
        description="Ray-distributed, tensor-parallel LLM inference",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"kvray {_version()}")
    p.add_argument("-v", "--verbose", action="store_true", help="Ray's and kvray's detail logs, tracebacks")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a batch of prompts (JSON lines) through the engines")
    _common(run)
    run.add_argument(
        "-i",
        "--input",
        help="JSON lines (kvray's {id?, prompt | prompt_token_ids, sampling fields?} or "
        "OpenAI Batch API lines): a file, a directory of *.jsonl shards, a glob, "
        "or - for stdin; without it, a built-in synthetic workload",
    )
    run.add_argument(
        "-o",
        "--output",
        help="JSON lines, appended as requests finish; a rerun skips ids answered "
        "there and retries failed ones (default: kvray-<timestamp>.out.jsonl); - for stdout "
        "(records only: the progress bar and the summary go to stderr)",
    )
    run.add_argument("--summary-json", help="also write the summary as JSON to this path")
    run.add_argument("--num-requests", type=int, default=32, help="size of the synthetic workload")
    run.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="max_tokens for input lines without one (default: the model's generation_config.json, else 16, "
        "as LLM.generate; OpenAI chat lines: the rest of the context, as kvray serve)",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument(
        "--profile",
        metavar="DIR",
        help="write a torch profiler trace (Chrome trace JSON) of a few steps of every worker "
        "into DIR (on each worker's node)",
    )
    run.add_argument("--profile-steps", type=int, default=5, help="steps to trace with --profile")
    run.add_argument(
        "--profile-skip",
        type=int,
        default=8,
        help="steps to let pass before tracing with --profile (past the first prefills)",
    )
    info = sub.add_parser("info", help="what the cluster has, and where the config would place each engine")
    _common(info)
    info.add_argument("--json", action="store_true", help="the whole report as JSON instead of a table")
    st = sub.add_parser(
        "stress",
        help="drive every replica with a hostile workload, kill workers, check "
        "nothing is lost, duplicated or corrupted",
    )
    _common(st)
    st.add_argument("--requests", type=int, default=200, help="number of requests")
    st.add_argument(
        "--duration", type=float, default=0.0, help="spread the arrivals over this many seconds (0: all at once)"
    )
    st.add_argument(
        "--kill-workers",
        type=int,
        default=0,
        help="kill this many random worker actors at random times (within max_worker_restarts)",
    )
    st.add_argument(
        "--kill-nodes",
        type=int,
        default=0,
        help="kill this many whole nodes (their raylets) under the engines at random times; needs a "
        "multi-node cluster (ray.address), never the client's node",
    )
    st.add_argument("--abort-rate", type=float, default=0.1, help="share of requests aborted mid-flight")
    st.add_argument("--seed", type=int, default=0, help="seed of the workload, aborts and kills")
    st.add_argument("--report", help="also write DIR/stress.png: latency CDF, KV usage, running requests")
    sv = sub.add_parser("serve", help="an OpenAI-compatible server (Ray Serve) over the engine replicas")
    _common(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    sv.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    return p


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        help="YAML config (default: the built-in defaults of actors/config/engine.py: CPU, tiny-random, TP=1)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override a config field, e.g. --set cache.block_size=32 (repeatable)",
    )


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C before _main's own handler is in place (importing the job's modules, parsing the
        # arguments, setting up the console: the first ~0.5 s of a start): the same one line, no traceback.
        # This module imports only the standard library at the top, so what is left before this handler
        # is the interpreter's own start-up (Python prints a traceback there; nothing of kvray has run).
        return _fail(EXIT_INTERRUPTED, "interrupted")


def _main(argv: list[str] | None) -> int:
    from cluster import console
    from cluster.config import ConfigError, load_config
    from cluster.job.input import JobError

    args = build_parser().parse_args(argv)
    console.configure(args.verbose)
    try:
        config = load_config(args.config, args.overrides)
        _import_ray_whole()
        check_model(config)
        if not _embedded(config):
            connect_interruptibly(config)
        if args.command == "stress":
            return cmd_stress(config, args)
        if args.command == "serve":
            return cmd_serve(config, args)
        return cmd_run(config, args) if args.command == "run" else cmd_info(config, args)
    except (ConfigError, JobError) as e:
        return _fail(EXIT_USAGE, str(e))
    except KeyboardInterrupt:  # Ctrl-C while connecting or starting up: one line, no traceback
        return _fail(EXIT_INTERRUPTED, "interrupted")
    except BrokenPipeError:  # `kvray info | head`: the reader went away
        _silence_stdout()
        return EXIT_CLOSED_OUTPUT
    except Exception as e:  # the message is the interface: one clear line, then exit 1
        if args.verbose:
            log.exception("failed")
        return _fail(EXIT_FAILED, f"{type(e).__name__}: {e}")


def _import_ray_whole() -> None:
    """Every command talks to Ray. Interrupted in the middle of `import ray`, a half-imported ray's exit
    handler (registered by then) failed at exit with a traceback after the one line: Ctrl-C is held until
    the import is done (it takes ~1 s), then ends the command as anywhere else."""
    from actors.interrupts_held import interrupts_held

    with interrupts_held():
        import ray  # noqa: F401


def _fail(code: int, message: str) -> int:
    print(f"kvray: {message.splitlines()[0] if message else 'failed'}", file=sys.stderr)
    return code


def _embedded(config: EngineConfig) -> bool:
    from cluster.replicas.placement import ray_address

    return ray_address(config) is None


def connect_interruptibly(config: EngineConfig) -> None:
    """Join the cluster at ray.address / RAY_ADDRESS with Ctrl-C ending the command at once (exit 130,
    one line): ray.init waits on the GCS inside C++, where Python's SIGINT handler cannot run until it
    returns (10-27 s). The signal's wakeup byte reaches a watcher thread at once instead. Only here,
    where no local Ray process has started yet, is ending without clean-up safe."""
    import signal
    import threading

    from cluster.replicas.placement import connect

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def watch() -> None:
        while byte := os.read(read_fd, 1):
            if byte[0] == signal.SIGINT:
                os.write(2, b"kvray: interrupted\n")
                os._exit(EXIT_INTERRUPTED)
        os.close(read_fd)

    threading.Thread(target=watch, name="kvray-ctrl-c", daemon=True).start()
    previous = signal.set_wakeup_fd(write_fd)
    try:
        connect(config)
    finally:
        signal.set_wakeup_fd(previous)
        os.close(write_fd)  # the watcher reads the end and leaves


def check_model(config: EngineConfig) -> None:
    """The model must exist here before Ray starts, when Ray runs here too (cluster.llm.check_model_here);
    config.json's rules are checked wherever it is readable."""
    from actors.models.architectures import UnsupportedArchitectureError
    from cluster.config import ConfigError
    from cluster.llm import check_client_model, check_model_here, load_client_model

    check_model_here(config)
    try:
        _, hf_config = load_client_model(config)
        if hf_config is not None:
            check_client_model(config, hf_config)
    except UnsupportedArchitectureError as e:
        raise ConfigError(str(e)) from None


def cmd_run(config: EngineConfig, args: Any) -> int:
    from cluster.job.input import JobError, count_lines, resolve_shards
    from cluster.job.output import OutputFile, StdoutOutput, check_not_an_input, default_output_path, is_stdout

    shards = resolve_shards(args.input) if args.input is not None else []
    output_path = args.output or default_output_path()
    out: Any
    if is_stdout(output_path):
        out = StdoutOutput()  # records only; the bar, the logs and the summary go to stderr
    else:
        check_not_an_input(output_path, args.input, shards)
        output_path = os.path.abspath(output_path)  # said in full: under `ray job submit` it is on the head
        _say_where_the_output_is(args.output, output_path)
        out = OutputFile(output_path)  # opened and locked before any engine starts
    try:
        _warn_oversubscribed(config)
        total = count_lines(shards) if shards else args.num_requests
        return _run_engines(config, args, shards, out, total)
    except KeyboardInterrupt:
        where = (
            f"the records so far are in {output_path}; run the same command with --output {output_path} to resume"
            if isinstance(out, OutputFile)
            else "the records so far went to stdout"
        )
        print(f"\nkvray: interrupted; {where}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader of stdout went away (`| head`): end quietly
        _silence_stdout()
        return EXIT_CLOSED_OUTPUT
    except JobError as e:
        return _fail(EXIT_FAILED, str(e))
    finally:
        out.close()


def _say_where_the_output_is(given: str | None, path: str) -> None:
    """Under `ray job submit` the command runs in a copy of the working directory on the head node: a
    relative --output lands there, never in the directory it was submitted from."""
    if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") and given and not os.path.isabs(given):
        log.warning(
            "--output %r is relative: under `ray job submit` it is written on the node running the job, "
            "as %s (the submitting machine's directory cannot be reached from here); give a path on "
            "storage both can reach to read it from there",
            given,
            path,
        )


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that Python's own flush at exit does not fail a second time."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def _warn_oversubscribed(config: EngineConfig) -> None:
    from cluster.info import machine_shortfall

    p = config.parallel
    if _embedded(config):
        _, note = machine_shortfall(config)
        if note:
            log.warning(
                "%s (parallel.tensor_parallel_size=%d x data_parallel_size=%d): expect it to be slow",
                note,
                p.tensor_parallel_size,
                p.data_parallel_size,
            )
    if p.device == "cuda" and p.gpus_per_worker < 1.0:
        log.warning(
            "parallel.gpus_per_worker=%g: %d ranks share each GPU", p.gpus_per_worker, round(1 / p.gpus_per_worker)
        )


def _run_engines(config: EngineConfig, args: Any, shards: list, out: Any, total: int | None) -> int:
    from cluster.client.sampling_defaults import default_sampling_params
    from cluster.job.input import InputReader, Item
    from cluster.job.runner import Job, format_summary, summarize, synthetic_items
    from cluster.llm import client_model_dir, load_client_model
    from cluster.replicas.engine_group import EngineFailure, EngineGroup

    tokenizer, hf_config = load_client_model(config)
    # Every field a line leaves out takes the default LLM.generate and kvray serve take.
    defaults = default_sampling_params(client_model_dir(config) if hf_config is not None else None)
    if args.max_tokens is not None:
        defaults = dataclasses.replace(defaults, max_tokens=args.max_tokens)
    engines = EngineGroup(config)
    try:
        info = engines.info
        items: Iterable[Item]
        if shards:
            items = InputReader(shards, defaults, chat_to_context_end=args.max_tokens is None)
        else:
            items = synthetic_items(
                args.num_requests, config.model.seed, int(info["vocab_size"]), int(info["max_model_len"])
            )
        job = Job(config, engines, tokenizer, out.path, progress=not args.no_progress, total=total, output=out)
        traces = _start_profile(engines, args)
        try:
            stats = job.run(items)
        except EngineFailure as e:
            return _fail(
                EXIT_FAILED,
                f"EngineFailure: {e}; {job.stats.completed + job.stats.errors} record(s) "
                f"are in {out.path}: rerun with --output {out.path} to resume",
            )
        summary = summarize(stats, engines.stats())
        if traces is not None:
            summary["profile_traces"] = _stop_profile(engines)
    finally:
        engines.shutdown()
    # With the records on stdout, everything else goes to stderr.
    report = sys.stderr if out.path == "<stdout>" else sys.stdout
    print(format_summary(summary), file=report)
    if not args.output:
        for rid, text in stats.samples:
            print(f"  {rid}: {text[:100]!r}", file=report)
    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary), file=report, flush=True)
    if stats.errors:
        print(
            f"kvray: {stats.errors} of {stats.completed + stats.errors} line(s) got error records "
            f"(exit {EXIT_LINE_ERRORS}); see {out.path}",
            file=sys.stderr,
        )
        return EXIT_LINE_ERRORS
    return EXIT_OK


def _start_profile(engines: Any, args: Any) -> str | None:
    """With --profile, every replica's workers trace a few steps; the trace directory, else None."""
    if not args.profile:
        return None
    import ray

    if args.profile_steps < 1 or args.profile_skip < 0:
        from cluster.config import ConfigError

        raise ConfigError(
            f"--profile-steps={args.profile_steps} must be >= 1 and --profile-skip={args.profile_skip} >= 0"
        )
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

    from cluster.replicas.placement import connect
    from cluster.stress.run import StressOptions, check_options, run_stress

    opts = StressOptions(
        requests=args.requests,
        duration_s=args.duration,
        kill_workers=args.kill_workers,
        kill_nodes=args.kill_nodes,
        abort_rate=args.abort_rate,
        seed=args.seed,
        report_dir=args.report,
    )
    try:
        check_options(config, opts)
    except ValueError as e:
        return _fail(EXIT_USAGE, str(e))
    _warn_oversubscribed(config)
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


def cmd_serve(config: EngineConfig, args: Any) -> int:
    from cluster.serve.app import PortInUse, run_server

    if not 0 < args.port < 65536:
        return _fail(EXIT_USAGE, f"--port={args.port}: must be in [1, 65535]")
    _warn_oversubscribed(config)
    try:
        run_server(config, args.host, args.port)
    except PortInUse as e:
        return _fail(EXIT_FAILED, str(e))
    return EXIT_OK


def cmd_info(config: EngineConfig, args: Any) -> int:
    """Exit 0 when the config fits (or only oversubscribes CPU cores), 1 with a one-line reason when not."""
    from cluster.info import info_report, table

    report, why = info_report(config, _embedded(config))
    print(json.dumps(report, indent=2) if args.json else table(report))
    if why:
        return _fail(EXIT_FAILED, f"the config does not fit: {why}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
