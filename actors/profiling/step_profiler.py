"""A torch profiler around a few steps of one worker, written as a Chrome trace (chrome://tracing, Perfetto).

Requests arrive on a control thread (`request`, `stop`), but the profiler is started and stepped by the
thread that runs execute_model (with the compiled-graph transport that is Ray's execution thread, not
the one serving plain actor calls), so the trace shows the step's own CPU ops and its CUDA kernels.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


class StepProfiler:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._cv = threading.Condition()
        self._pending: tuple[str, int, int] | None = None  # (trace_dir, steps to skip, steps to record)
        self._prof: torch.profiler.profile | None = None
        self._dir = ""
        self._skip = 0
        self._left = 0  # steps still to record; 0 = until stop()
        self._in_step = False
        self._written: list[str] = []

    @property
    def recording(self) -> bool:
        """A trace is being recorded now."""
        return self._prof is not None

    def request(self, trace_dir: str, num_steps: int, skip_steps: int = 0) -> None:
        """Record `num_steps` steps (0 = until stop) after skipping `skip_steps`."""
        if not isinstance(trace_dir, str) or not trace_dir:
            raise ValueError(f"profile trace_dir={trace_dir!r}: must be a directory path")
        if num_steps < 0 or skip_steps < 0:
            raise ValueError(f"profile num_steps={num_steps}, skip_steps={skip_steps}: must be >= 0")
        os.makedirs(trace_dir, exist_ok=True)
        with self._cv:
            self._pending = (trace_dir, skip_steps, num_steps)

    def before_step(self) -> None:
        with self._cv:
            self._in_step = True
            if self._prof is not None or self._pending is None:
                return
            if self._pending[1] > 0:
                d, skip, n = self._pending
                self._pending = (d, skip - 1, n)
                return
            self._dir, _, self._left = self._pending
            self._pending = None
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self._prof.start()

    def after_step(self) -> None:
        with self._cv:
            self._in_step = False
            if self._prof is not None:
                self._prof.step()
                if self._left > 0:
                    self._left -= 1
                    if self._left == 0:
                        self._finish()
            self._cv.notify_all()

    def stop(self, timeout_s: float = 60.0) -> list[str]:
        """Finish a running profile (after the step in progress, if any); every trace written so far."""
        with self._cv:
            self._pending = None
            self._cv.wait_for(lambda: not self._in_step, timeout=timeout_s)
            if self._prof is not None:
                self._finish()
            written, self._written = self._written, []
            return written

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        assert prof is not None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.stop()
        path = os.path.join(
            self._dir, f"kvray-worker-rank{self.rank}-pid{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        )
        prof.export_chrome_trace(path)
        logger.info("rank %d: profiler trace written to %s", self.rank, path)
        self._written.append(path)


class StepTimer:
    """CUDA events around each step's GPU work, to measure how long the GPU idles between steps.

    `begin` is recorded right before the forward is launched (after the step's host-side preparation,
    whose few small copies are already queued) and `end` after the sampled tokens' copy is queued. For
    consecutive steps i, i+1 the gap end_i -> begin_{i+1} is time the GPU had nothing of this worker's
    to run: the driver's scheduling and the control plane (unless overlapped), and the worker's own
    bookkeeping and input preparation.
    """

    # Host timestamps the runner marks in each execute_model call, in order: entry, its GPU work queued,
    # the tokens it waits for (its own, or the previous step's with lag) read back, return.
    HOST_MARKS = ("enter", "launched", "tokens", "exit")

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._steps: list[tuple[int, int, int, torch.cuda.Event, torch.cuda.Event | None]] = []
        self._calls: list[dict[str, float]] = []
        self._clock = clock

    def mark(self, name: str) -> None:
        if name == "enter":
            self._calls.append({})
        if self._calls:
            self._calls[-1][name] = self._clock()

    def host_phases(self) -> list[dict[str, float]]:
        """Per execute_model call, in ms: prepare (entry -> GPU work queued), wait (-> tokens read back),
        complete (-> return) and outside (return -> next entry: the transport and the driver)."""
        calls = [c for c in self._calls if all(k in c for k in self.HOST_MARKS)]
        out = []
        for prev, c in itertools.pairwise(calls):
            out.append(
                {
                    "prepare_ms": (c["launched"] - c["enter"]) * 1e3,
                    "wait_ms": (c["tokens"] - c["launched"]) * 1e3,
                    "complete_ms": (c["exit"] - c["tokens"]) * 1e3,
                    "outside_ms": (c["enter"] - prev["exit"]) * 1e3,
                }
            )
        return out

    def begin(self, num_reqs: int, num_tokens: int, kv_tokens: int = 0) -> None:
        """kv_tokens: the context tokens the step's attention reads (the sum of its seq_lens), so that a
        benchmark can put each step's time against its KV bytes."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._steps.append((num_reqs, num_tokens, kv_tokens, event, None))

    def end(self) -> None:
        if self._steps and self._steps[-1][4] is None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            n, t, kv, begin, _ = self._steps[-1]
            self._steps[-1] = (n, t, kv, begin, event)

    def collect(self) -> list[dict[str, float | None]]:
        """Per timed step: num_reqs, num_tokens, kv_tokens, busy_ms (begin -> end) and gap_ms (the previous step's
        end -> this begin; None for the first). Clears the record."""
        torch.cuda.synchronize()
        steps = [(n, t, kv, begin, end) for n, t, kv, begin, end in self._steps if end is not None]
        self._steps = []
        out: list[dict[str, float | None]] = []
        prev_end: torch.cuda.Event | None = None
        for n, t, kv, begin, end in steps:
            out.append(
                {
                    "num_reqs": n,
                    "num_tokens": t,
                    "kv_tokens": kv,
                    "busy_ms": begin.elapsed_time(end),
                    "gap_ms": None if prev_end is None else prev_end.elapsed_time(begin),
                }
            )
            prev_end = end
        return out
