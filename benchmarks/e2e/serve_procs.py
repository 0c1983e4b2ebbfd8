"""The serving path's processes and what each costs during a run: for bench_serve.py (on the GPU) and
bench_serve_ceiling.py (the no-op worker on the CPU).

At saturation the serving path is CPU-bound, and which process saturates decides what to build next:
Serve's proxy, the ingress replica, the driver, or the client. `ProcessMeter` reads each one's CPU
seconds from /proc around a run: CPU per output token, and its utilisation (CPU s / wall s, 1.0 = one
core; a GIL-bound Python process tops out near 1). `py_spy` records the Python stacks of each one
(GIL holders only) when py-spy is on PATH; `benchmarks/tools/summarize_pyspy.py` reads them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

# Actor classes, as Ray titles their processes (`ray::<Class>` idle, `ray::<Class>.<method>` busy, Serve's
# replica `ray::ServeReplica:<app>:<deployment>`): Serve's proxy, the ingress, the driver, its workers.
TAGS = ("ProxyActor", "ServeReplica", "EngineDriver", "NoopWorker", "PacedNoopWorker", "Worker")


def serve_processes(tags: tuple[str, ...] = TAGS) -> dict[str, int]:
    """{class: pid} of the server's processes among this process's descendants (the Ray it started; other
    Rays on the machine are not ours); "client": this one. The first process of each class."""
    ps = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    rows = [line.split(None, 2) for line in ps]
    children: dict[int, list[int]] = {}
    for pid, ppid, *_ in rows:
        children.setdefault(int(ppid), []).append(int(pid))
    ours: set[int] = set()
    todo = [os.getpid()]
    while todo:
        p = todo.pop()
        ours.add(p)
        todo.extend(children.get(p, []))
    out = {"client": os.getpid()}
    for pid, _, *args in rows:
        title = args[0].split()[0] if args and args[0].split() else ""
        if int(pid) not in ours or not title.startswith("ray::"):
            continue
        cls = re.split(r"[.:]", title[5:])[0]
        if cls in tags and cls not in out:
            out[cls] = int(pid)
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ProcessMeter:
    """CPU seconds of each process between start() and stop()."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._before: dict[str, float] = {}

    def start(self) -> None:
        self._before = {tag: cpu_s(pid) for tag, pid in self.pids.items()}

    def stop(self, wall_s: float, output_tokens: float) -> dict[str, dict[str, float]]:
        """{tag: {"cpu_s", "util" (CPU s / wall s), "us_per_token"}}."""
        out = {}
        for tag, pid in self.pids.items():
            used = cpu_s(pid) - self._before.get(tag, 0.0)
            out[tag] = {
                "cpu_s": round(used, 3),
                "util": round(used / wall_s, 3) if wall_s > 0 else 0.0,
                "us_per_token": round(used / output_tokens * 1e6, 1) if output_tokens else 0.0,
            }
        return out


def format_costs(costs: dict[str, dict[str, float]]) -> str:
    return ", ".join(f"{t} {c['us_per_token']:.0f} us/token ({c['util']:.2f} cores)" for t, c in costs.items())


def py_spy(out_dir: str, seconds: int, pids: dict[str, int]) -> list[subprocess.Popen]:
    """py-spy record (GIL holders only: the Python work) of each server process, for `seconds`; none
    when py-spy is not on PATH (the GPU bundle brings it: benchmarks/tools/gpu_bundle_extras.sh)."""
    if shutil.which("py-spy") is None:
        print("py-spy is not on PATH: no profiles", flush=True)
        return []
    os.makedirs(out_dir, exist_ok=True)
    return [
        subprocess.Popen(
            ["py-spy", "record", "-p", str(pid), "-d", str(seconds), "-f", "raw", "-r", "50", "--gil"]
            + ["-o", f"{out_dir}/{tag}-{pid}.txt"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for tag, pid in pids.items()
        if tag != "client"
    ]
