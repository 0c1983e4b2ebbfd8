"""Bounded waits for tests: a call that must not hang gets a generous limit, and only a hang fails.

Tests never assert how long something took (a loaded CI machine makes any tight figure flaky); they
assert that it ends at all, with a limit far above what it needs, or far below a timeout that a wrong
behaviour would have to wait out.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import pytest


def within(limit_s: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs)'s result (or its exception), failing the test if it is still running after limit_s."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not return within {limit_s:g}s: it hangs")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def wait_until(
    cond: Callable[[], bool],
    limit_s: float,
    step: Callable[[], Any] = lambda: time.sleep(0.1),
    what: str = "the condition",
) -> None:
    """Run `step` until `cond()` holds; fail the test if it still does not after limit_s."""
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not hold within {limit_s:g}s")
        step()
