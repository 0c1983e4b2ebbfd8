"""Ctrl-C during `kvray run`'s start-up, many times: the exit codes and how long each exit took.

Each try starts `kvray run` (the built-in tiny-random model on the CPU, an embedded Ray in a private temp
dir), waits a delay (cycling through --delays, so the interrupt lands in every phase of start-up: Ray's
start, the driver and worker actors, model load, warm-up, the first steps) and sends SIGINT as a terminal's
Ctrl-C does: to the whole process group. It then waits for the exit (a try still running after --wait-s is
killed and counted as a hang) and stops what the try left behind, by pid: the processes whose command line
names its private Ray temp dir. Run with PYTHONFAULTHANDLER=1, so a crash prints every thread's stack; the
stderr of every try that did not end with 130 (or 0: finished before the interrupt), or printed a traceback,
is kept under --keep.

    PYTHONPATH=$PWD python -m benchmarks.checks.check_ctrl_c_startup --tries 36 [--keep DIR]

Prints one line per try and the distribution at the end; exits 1 when any try crashed, hung or printed a
traceback.
tests/test_job_cli.py's Ctrl-C tests are its CI size.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DELAYS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)
EXPECTED = {130: "interrupted", 0: "finished first"}
TRACEBACK = "Traceback (most recent call last)"


def processes_using(path: str) -> list[int]:
    """Pids of this user's processes whose command line names path (a try's private Ray temp dir)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if path.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def stop_leftovers(ray_tmp: str, group: int) -> int:
    """SIGKILL what a try left running: its process group and whatever names its Ray temp dir."""
    left = 0
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 20
    while (pids := processes_using(ray_tmp)) and time.monotonic() < deadline:
        left = max(left, len(pids))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    return left


def one_try(delay: float, wait_s: float, num_requests: int, group: bool = True) -> tuple[int | None, float, str, int]:
    """-> (exit code or None for a hang, seconds from SIGINT to exit, stderr, leftover processes)."""
    ray_tmp = tempfile.mkdtemp(prefix="kvcc-", dir="/tmp")
    out_dir = tempfile.mkdtemp(prefix="kvcc-out-")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=str(ROOT), RAY_TMPDIR=ray_tmp, PYTHONFAULTHANDLER="1")
    cmd = [sys.executable, "-m", "cluster.cli", "run", "--no-progress", "--num-requests", str(num_requests)]
    cmd += ["--output", os.path.join(out_dir, "out.jsonl")]
    p = subprocess.Popen(
        cmd,
        cwd=out_dir,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the "terminal" this script sends Ctrl-C to
        # A script started in the background inherits SIGINT ignored, and so would the child.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        p.wait(timeout=delay)
        sent = time.monotonic()  # finished before the interrupt
    except subprocess.TimeoutExpired:
        if group:
            os.killpg(p.pid, signal.SIGINT)
        else:
            os.kill(p.pid, signal.SIGINT)  # `kill -INT PID`: kvray alone, not the Ray processes it started
        sent = time.monotonic()
    try:
        _, err = p.communicate(timeout=wait_s)
        rc: int | None = p.returncode
    except subprocess.TimeoutExpired:
        rc = None
        p.kill()
        _, err = p.communicate()
    took = time.monotonic() - sent
    left = stop_leftovers(ray_tmp, p.pid)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    if rc is not None and rc < 0:
        rc = 128 - rc  # killed by a signal: the shell's code (SIGSEGV -> 139)
    return rc, took, err or "", left


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=36)
    ap.add_argument("--delays", type=float, nargs="+", default=list(DEFAULT_DELAYS))
    ap.add_argument("--wait-s", type=float, default=60.0, help="a try still running this long after SIGINT hangs")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--to", choices=["group", "process"], default="group", help="where SIGINT goes (default group)")
    ap.add_argument("--keep", default=None, help="folder for the stderr of every try that crashed or hung")
    args = ap.parse_args(argv)
    keep = Path(args.keep) if args.keep else None
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
    codes: collections.Counter[str] = collections.Counter()
    took_by_code: dict[str, list[float]] = collections.defaultdict(list)
    bad = tracebacks = 0
    for i in range(args.tries):
        delay = args.delays[i % len(args.delays)]
        rc, took, err, left = one_try(delay, args.wait_s, args.num_requests, args.to == "group")
        name = "hang" if rc is None else str(rc)
        codes[name] += 1
        took_by_code[name].append(took)
        last = err.strip().splitlines()[-1] if err.strip() else ""
        traceback = TRACEBACK in err  # Ctrl-C ends with one line, never a traceback
        tracebacks += traceback
        line = f"try {i + 1:3d}  SIGINT at {delay:4.1f}s  exit {name:>4}  {took:5.1f}s after  left {left}"
        print(f"{line}{'  TRACEBACK' if traceback else ''}  | {last[:100]}", flush=True)
        if rc not in EXPECTED or traceback:
            bad += 1
            if keep:
                (keep / f"try{i + 1:03d}-exit{name}-at{delay:g}s.stderr").write_text(err)
    print("\nexit code: tries, seconds from SIGINT to exit (min / median / max)")
    for name, n in sorted(codes.items()):
        t = sorted(took_by_code[name])
        what = EXPECTED.get(int(name), "") if name.isdigit() else ""
        print(f"  {name:>4} {what:15s} {n:3d}   {t[0]:.1f} / {t[len(t) // 2]:.1f} / {t[-1]:.1f}")
    print(f"{tracebacks} of {args.tries} tries printed a traceback")
    print(f"{bad} of {args.tries} tries crashed, hung or printed a traceback")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
