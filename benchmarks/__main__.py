"""Run a named suite of benchmarks/suites.yaml: `python -m benchmarks SUITE [--part P ...]`, `--list`.

Each step runs as `python -m MODULE ARGS` from the repo root in its own process under its time limit; its
output goes to <logs>/<step>.log, and the lines that matter (RESULT records, PASS / FAIL, tracebacks) are
echoed. With $OUT set (a device call), the logs are also packed into $OUT/<suite>-logs.tgz after every
step, so that a call cut off at its limit still brings back what ran; the records themselves go to
benchmarks/results/ and $OUT through common.record. A step fails on a non-zero exit, a timeout, a smoke
that recorded something or lacks its expected text; metrics it declared but did not record are reported.

  python -m benchmarks --list
  python -m benchmarks smoke                      # every script's CPU smoke
  python -m benchmarks e2e                        # on the GPU machine, after `source .gpu/bootstrap.sh`
  python -m benchmarks vs-vllm --part kvray       # one part of a suite (benchmarks/README.md: vs-vllm)
  python -m benchmarks e2e --dry-run              # the commands, not run
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.suites import Step, Suite, load_suites

ROOT = Path(__file__).resolve().parent.parent
MODELS = "/tmp/kvray-models"
ECHO = ("RESULT", "PASS", "FAIL", "Traceback", "Error", "tok/s", "kvray [", "vLLM", "ratio")


@dataclass
class StepResult:
    step: Step
    rc: int
    seconds: float
    problems: list[str]

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.problems


def command(step: Step, out: Path, tmp: Path, dry_run: bool = False) -> list[str]:
    """The step's argv: this interpreter (or $VLLM_PY) -m module, placeholders filled in."""
    if step.python == "vllm":
        vllm_py = os.environ.get("VLLM_PY") or ("$VLLM_PY" if dry_run else "")
        if not vllm_py:
            raise SystemExit(f"step {step.name}: VLLM_PY is not set: `source .gpu/vllm/install.sh` first")
        python = shlex.split(vllm_py)
    else:
        python = [sys.executable]
    fill = {"{models}": MODELS, "{out}": str(out), "{tmp}": str(tmp)}
    args = []
    for a in step.args:
        for key, value in fill.items():
            a = a.replace(key, value)
        args.append(a)
    return [*python, "-m", step.module, *args]


def recorded_metrics(output: str) -> list[str]:
    return [json.loads(line[len("RESULT ") :])["metric"] for line in output.splitlines() if line.startswith("RESULT ")]


def check_output(step: Step, suite: Suite, output: str) -> list[str]:
    """What is wrong with a finished step's output: a smoke that recorded or lacks its text; missing metrics."""
    problems = []
    if suite.name == "smoke" and "RESULT" in output:
        problems.append("a smoke recorded a result")
    problems += [f"expected text not in the output: {t!r}" for t in step.expect if t not in output]
    got = recorded_metrics(output)
    missing = [m for m in step.metrics if not fnmatch.filter(got, m)]
    if missing:
        print(f"   metrics not recorded: {missing}", flush=True)
    return problems


def run_step(step: Step, suite: Suite, logs: Path, out: Path) -> StepResult:
    with tempfile.TemporaryDirectory(prefix=f"kvray-{step.name}-") as tmp:
        cmd = command(step, out, Path(tmp))
        print(f"== {step.name} ({step.part}), limit {step.limit_s} s, {time.strftime('%H:%M:%S')}", flush=True)
        print("   " + " ".join(shlex.quote(c) for c in cmd), flush=True)
        env = {**os.environ, **step.env, "KVRAY_SUITE": suite.name}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        if suite.mirror:
            env["KVRAY_RESULTS_MIRROR"] = suite.mirror
        log = logs / f"{step.name}.log"
        t0 = time.perf_counter()
        with open(log, "w") as f:
            try:
                rc = subprocess.run(
                    cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=step.limit_s
                ).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        seconds = time.perf_counter() - t0
    output = log.read_text(errors="replace")
    problems = (["timed out"] if rc == 124 else []) + check_output(step, suite, output)
    lines = [ln for ln in output.splitlines() if any(k in ln for k in ECHO) and "pid=" not in ln]
    for ln in lines[-14:] if rc == 0 else output.splitlines()[-30:]:
        print("   " + ln[:300], flush=True)
    print(f"   rc={rc} {seconds:.0f} s" + (f"  PROBLEMS: {problems}" if problems else ""), flush=True)
    return StepResult(step, rc, seconds, problems)


def pack_logs(logs: Path, out: Path, suite: str) -> None:
    """$OUT/<suite>-logs.tgz from the logs so far (a device call returns few files: one archive, not a file
    per step)."""
    with tarfile.open(out / f"{suite}-logs.tgz", "w:gz") as tar:
        tar.add(logs, arcname=f"{suite}-logs")


def list_suites(suites: dict[str, Suite]) -> None:
    for s in suites.values():
        where = f"GPU x{s.gpus}" if s.gpu else "CPU"
        parts = "" if s.parts == ["main"] else "; parts " + ", ".join(f"{p} ({s.limit_s(p)} s)" for p in s.parts)
        print(f"{s.name:<14} {where:<7} {len(s.steps):>2} steps, limits {s.limit_s()} s{parts}")
        print(f"{'':<14} {' '.join(s.description.split())}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("suite", nargs="?", help="a suite of benchmarks/suites.yaml")
    ap.add_argument("--list", action="store_true", help="the suites, their steps and limits")
    ap.add_argument("--part", action="append", help="run only these parts, in the suite's order (repeatable)")
    ap.add_argument("--only", action="append", help="run only these steps (repeatable)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands; run nothing")
    ap.add_argument("--logs", help="folder of the step logs (default: $OUT/<suite>-logs or a temporary one)")
    args = ap.parse_args(argv)
    suites = load_suites()
    if args.list or not args.suite:
        list_suites(suites)
        return 0
    if args.suite not in suites:
        ap.error(f"suite {args.suite!r}: not in benchmarks/suites.yaml ({', '.join(suites)})")
    suite = suites[args.suite]
    for part in args.part or []:
        if part not in suite.parts:
            ap.error(f"--part {part!r}: suite {suite.name} has parts {suite.parts}")
    steps = [
        s for s in suite.steps if (not args.part or s.part in args.part) and (not args.only or s.name in args.only)
    ]
    if args.only and len(steps) < len(set(args.only)):
        ap.error(f"--only: suite {suite.name} has steps {[s.name for s in suite.steps]}")
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="kvray-suite-out-"))
    if args.dry_run:
        for s in steps:
            print(f"[{s.part}] {s.name} ({s.limit_s} s): {' '.join(command(s, out, Path('{tmp}'), dry_run=True))}")
        return 0
    if suite.gpu:
        import torch

        if torch.cuda.device_count() < suite.gpus:
            print(f"suite {suite.name} needs {suite.gpus} GPU(s); this machine has {torch.cuda.device_count()}")
            return 2
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(args.logs or tempfile.mkdtemp(prefix=f"kvray-{suite.name}-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    results = []
    for step in steps:
        results.append(run_step(step, suite, logs, out))
        if os.environ.get("OUT"):
            pack_logs(logs, out, suite.name)
    failed = [r.step.name for r in results if not r.ok]
    print(
        f"{suite.name}: {len(results) - len(failed)}/{len(results)} steps passed"
        + (f"; failed: {failed}" if failed else "")
    )
    print(f"logs: {logs}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
