"""Ctrl-C held through a stretch that must not be interrupted in the middle, then delivered.

`import torch` runs C++ (torch._C._c10d_init, through pybind11) that calls back into Python. A Ctrl-C
whose KeyboardInterrupt is raised there escapes as a C++ exception and the process aborts: "terminate
called after throwing an instance of 'pybind11::error_already_set' / KeyboardInterrupt", SIGABRT, exit
134 (once in 30 Ctrl-C during `kvray run`'s start-up: benchmarks/checks/check_ctrl_c_startup.py). The
client imports torch only to write the built-in tiny-random model (actors/models/model_dir.py).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """SIGINT during the block is recorded, and handed to the process's own handler after it (for Python's
    default one: KeyboardInterrupt, raised where the block ends). Only the main thread can set a handler;
    elsewhere, or where SIGINT is ignored or not handled by Python, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN, SIG_DFL (the process ends, no Python code runs) or a C handler
        yield
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        previous(signal.SIGINT, None)
