"""Where a worker's start-up time goes: wall-clock marks taken inside the worker process, turned into
phases relative to the moment the executor asked Ray for the actor.

The phases are what the engine stats call `worker_*_s`: the process's spawn (Ray starting a Python
worker, or handing over an idle one), the worker's Python and Ray boot up to the import of
actors.worker.actor, that import (torch, triton, the model code), the construction, the device and the
process group, and the ModelRunner. Wall clock (time.time) because the marks come from two processes.
"""

from __future__ import annotations

import os
import time


def process_start_epoch() -> float | None:
    """This process's start as a Unix time (Linux /proc; None elsewhere). /proc/uptime and the start
    tick are both 10 ms resolution, where /proc/stat's btime would only give whole seconds."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        start_s = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5)
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime_s - start_s)


# Taken when this module is first imported: actors.worker.actor imports it before torch.
IMPORT_STARTED = time.time()
PROCESS_STARTED = process_start_epoch()


def worker_phases(requested: float, marks: dict[str, float]) -> dict[str, float]:
    """Seconds per phase, named as the engine stats print them. `requested` is the executor's time.time()
    before `.remote()`; `marks` the worker's: imported, constructed, device, tp_group, runner."""
    points = [("spawn", PROCESS_STARTED), ("boot", IMPORT_STARTED)]
    points += [
        (name, marks[name]) for name in ("imported", "constructed", "device", "tp_group", "runner") if name in marks
    ]
    out: dict[str, float] = {}
    prev = requested
    for name, at in points:
        if at is None:
            continue
        out[f"worker_{name}_s"] = round(max(at - prev, 0.0), 2)
        prev = at
    return out
