"""Ctrl-C in the middle of `import torch` (the client imports it only to write the built-in tiny-random
model) is held until the import is done, then raised as KeyboardInterrupt. Raised inside it, it could land
in torch's C++ start-up and abort the process (SIGABRT, exit 134, seen in benchmarks/checks/
check_ctrl_c_startup.py). The child process sends itself SIGINT as torch imports torch.distributed, so the
interrupt lands mid-import every time, not by timing luck."""

import os
import signal
import subprocess
import sys

import pytest

from actors.interrupts_held import interrupts_held
from tests.terminal_signals import sigint_as_in_a_terminal

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import importlib.abc, os, signal, sys

class CtrlCMidImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch.distributed":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlCMidImport())
from actors.models.model_dir import resolve_model_dir
try:
    resolve_model_dir("tiny-random")
    print("NOT INTERRUPTED")
except KeyboardInterrupt:
    print("INTERRUPTED, torch imported:", "torch.distributed" in sys.modules, flush=True)
"""


def test_ctrl_c_during_torchs_import_is_raised_after_it():
    env = dict(os.environ, PYTHONPATH=REPO)
    r = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=sigint_as_in_a_terminal,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "INTERRUPTED, torch imported: True", r.stdout + r.stderr[-3000:]


def test_a_held_interrupt_goes_to_the_handler_in_place_and_none_is_invented():
    calls = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            assert calls == []  # held
        assert calls == [signal.SIGINT]  # then the process's own handler, once
        with interrupts_held():
            pass
        assert calls == [signal.SIGINT]
        # Python's default handler (a pytest in the background may have SIGINT ignored: set it here).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with pytest.raises(KeyboardInterrupt):
            with interrupts_held():
                os.kill(os.getpid(), signal.SIGINT)
                done = True
        assert done  # the block ran to its end first
    finally:
        signal.signal(signal.SIGINT, previous)
