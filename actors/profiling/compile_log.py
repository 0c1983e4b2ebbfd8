"""Which Triton kernel variants a worker compiled (or loaded from Triton's disk cache), and when.

A request that waits for a compile is what the start-up warm-up exists to prevent; this log says
which variant was missed. It hooks Triton's runtime (knobs.runtime.jit_cache_hook, called before a
variant is built, and jit_post_compile_hook, after), so it costs nothing between compiles.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class CompileEvent:
    kernel: str  # the @triton.jit function's qualified name
    signature: str  # Triton's repr of the variant: options and argument specialisations
    started_s: float  # seconds since the log was installed
    took_s: float


class CompileLog:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[CompileEvent] = []
        # The variants being built, by Triton's key: compiles on a pool (actors/worker/compile_ahead.py)
        # start in one thread and finish together when the pool is drained.
        self._pending: dict[Any, tuple[str, str, float]] = {}
        self._lock = threading.Lock()

    def before_compile(self, *, repr: str, fn: Any, key: Any = None, **_: Any) -> bool:  # noqa: A002 (Triton's keyword)
        # The key holds the argument specialisations (dtypes, alignment, ints equal to 1 or a multiple of
        # 16) and the constexprs: what tells two variants of one kernel apart. Some Triton versions'
        # repr lists none of them.
        sig = repr if key is None else f"{repr} key={key}"
        with self._lock:
            self._pending[_variant(fn, key)] = (getattr(fn, "name", "?"), sig, time.perf_counter())
        return False  # False: go on and compile

    def after_compile(self, *, repr: str, fn: Any, key: Any = None, **_: Any) -> None:  # noqa: A002 (Triton's keyword)
        now = time.perf_counter()
        with self._lock:
            name, sig, started = self._pending.pop(_variant(fn, key), (getattr(fn, "name", "?"), repr, now))
            self.events.append(CompileEvent(name, sig, round(started - self.t0, 4), round(now - started, 4)))

    def since(self, index: int) -> list[dict]:
        """The events after the first `index` (a mark taken with len(self.events))."""
        with self._lock:
            return [asdict(e) for e in self.events[index:]]


def _variant(fn: Any, key: Any) -> tuple[str, str, str]:
    """A variant's identity across its two hooks (Triton hands each hook a new JitFunctionInfo)."""
    return getattr(fn, "module", ""), getattr(fn, "name", "?"), str(key)


def install() -> CompileLog | None:
    """Hook this process's Triton compiles into a new log; None where this Triton has no such hooks."""
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return None
    log = CompileLog()
    runtime.jit_cache_hook = log.before_compile
    runtime.jit_post_compile_hook = log.after_compile
    return log
