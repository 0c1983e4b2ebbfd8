"""Prometheus metrics of one engine replica, through ray.util.metrics (exported by every Ray node).

Recorded by the driver actor after each step. Names carry the `kvray_` prefix and a `replica` tag.
"""
from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


class EngineMetrics:
    def __init__(self, replica: int) -> None:
        from ray.util import metrics as m

        tags = ("replica",)
        self._tags = {"replica": str(replica)}
        self.kv_usage = m.Gauge("kvray_kv_cache_usage", "Share of KV-cache blocks in use (0-1)", tag_keys=tags)
        self.running = m.Gauge("kvray_num_running", "Requests running", tag_keys=tags)
        self.waiting = m.Gauge("kvray_num_waiting", "Requests waiting", tag_keys=tags)
        self.tokens_per_s = m.Gauge("kvray_output_tokens_per_s", "Output tokens per second (last window)",
                                    tag_keys=tags)
        self.step_ms = m.Histogram("kvray_step_time_ms", "Engine step time (ms)",
                                   boundaries=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000], tag_keys=tags)
        self.preemptions = m.Counter("kvray_preemptions_total", "Requests preempted", tag_keys=tags)
        self.output_tokens = m.Counter("kvray_output_tokens_total", "Output tokens generated", tag_keys=tags)
        self.worker_restarts = m.Counter("kvray_worker_restarts_total", "TP groups rebuilt after a failure",
                                         tag_keys=tags)
        self._last_preemptions = 0
        self._window_start = time.monotonic()
        self._window_tokens = 0

    def record_step(self, stats: dict, step_time_s: float, new_output_tokens: int) -> None:
        try:
            t = self._tags
            self.kv_usage.set(float(stats.get("kv_cache_usage", 0.0)), tags=t)
            self.running.set(int(stats.get("running", 0)), tags=t)
            self.waiting.set(int(stats.get("waiting", 0)), tags=t)
            self.step_ms.observe(step_time_s * 1e3, tags=t)
            preemptions = int(stats.get("num_preemptions", 0))
            if preemptions > self._last_preemptions:
                self.preemptions.inc(preemptions - self._last_preemptions, tags=t)
            self._last_preemptions = preemptions
            if new_output_tokens:
                self.output_tokens.inc(new_output_tokens, tags=t)
            self._window_tokens += new_output_tokens
            elapsed = time.monotonic() - self._window_start
            if elapsed >= 1.0:  # a rate over a short window, not a lifetime average
                self.tokens_per_s.set(self._window_tokens / elapsed, tags=t)
                self._window_start, self._window_tokens = time.monotonic(), 0
        except Exception as e:  # noqa: BLE001 - metrics must never stop the engine
            logger.debug("metrics: %s", e)

    def record_restart(self) -> None:
        try:
            self.worker_restarts.inc(1, tags=self._tags)
        except Exception as e:  # noqa: BLE001
            logger.debug("metrics: %s", e)
