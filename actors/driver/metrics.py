"""Prometheus metrics of one engine replica, through ray.util.metrics (exported by every Ray node).

Fed by the driver actor after each step and exported once per FLUSH_S window: each ray.util.metrics
call costs tens of microseconds in the step loop (about a tenth of a 256-request step's host time was
spent there), so a window's steps are summed first. Names carry the `kvray_` prefix and a `replica` tag.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

FLUSH_S = 0.25


class EngineMetrics:
    def __init__(self, replica: int) -> None:
        from ray.util import metrics as m

        tags = ("replica",)
        self._tags = {"replica": str(replica)}
        self.kv_usage = m.Gauge("kvray_kv_cache_usage", "Share of KV-cache blocks in use (0-1)", tag_keys=tags)
        self.running = m.Gauge("kvray_num_running", "Requests running", tag_keys=tags)
        self.waiting = m.Gauge("kvray_num_waiting", "Requests waiting", tag_keys=tags)
        self.tokens_per_s = m.Gauge(
            "kvray_output_tokens_per_s", "Output tokens per second (last window)", tag_keys=tags
        )
        self.step_ms = m.Histogram(
            "kvray_step_time_ms",
            "Engine step time (ms), one mean per export window",
            boundaries=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000],
            tag_keys=tags,
        )
        self.preemptions = m.Counter("kvray_preemptions_total", "Requests preempted", tag_keys=tags)
        self.output_tokens = m.Counter("kvray_output_tokens_total", "Output tokens generated", tag_keys=tags)
        self.worker_restarts = m.Counter(
            "kvray_worker_restarts_total", "TP groups rebuilt after a failure", tag_keys=tags
        )
        self._last_preemptions = 0
        self._window_start = time.monotonic()
        self._window_tokens = 0
        self._window_steps = 0
        self._window_step_s = 0.0
        self._latest: dict = {}

    def record_step(self, stats: dict, step_time_s: float, new_output_tokens: int) -> None:
        self._latest = stats
        self._window_tokens += new_output_tokens
        self._window_steps += 1
        self._window_step_s += step_time_s
        if time.monotonic() - self._window_start >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        """Export the window's figures (also when the engine goes idle, so gauges do not go stale)."""
        try:
            t, stats = self._tags, self._latest
            elapsed = time.monotonic() - self._window_start
            self.kv_usage.set(float(stats.get("kv_cache_usage", 0.0)), tags=t)
            self.running.set(int(stats.get("running", 0)), tags=t)
            self.waiting.set(int(stats.get("waiting", 0)), tags=t)
            if self._window_steps:
                self.step_ms.observe(self._window_step_s / self._window_steps * 1e3, tags=t)
            preemptions = int(stats.get("num_preemptions", 0))
            if preemptions > self._last_preemptions:
                self.preemptions.inc(preemptions - self._last_preemptions, tags=t)
            self._last_preemptions = preemptions
            if self._window_tokens:
                self.output_tokens.inc(self._window_tokens, tags=t)
            self.tokens_per_s.set(self._window_tokens / max(elapsed, 1e-9), tags=t)
        except Exception as e:  # noqa: BLE001 - metrics must never stop the engine
            logger.debug("metrics: %s", e)
        self._window_start = time.monotonic()
        self._window_tokens = self._window_steps = 0
        self._window_step_s = 0.0

    def record_restart(self) -> None:
        try:
            self.worker_restarts.inc(1, tags=self._tags)
        except Exception as e:  # noqa: BLE001 - metrics must never stop the engine (as above)
            logger.debug("metrics: %s", e)
