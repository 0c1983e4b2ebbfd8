"""Test-wide settings: Triton kernels run on CPU tensors through the interpreter, so CI tests the
kernels themselves; Ray usage stats stay off; no test ever talks to anything but this machine.

Ray's own metrics are off in the Rays the tests start (collection, and the OpenTelemetry recorder;
with both off no Ray process runs a metrics exporter thread, as gdb shows): that thread crashed a
worker process at start-up once in a loaded CI run (SIGSEGV in Ray's
opentelemetry::sdk::metrics::TemporalMetricStorage::buildMetrics), failing a test that had nothing
to do with metrics. No test reads Ray's metrics; kvray's /metrics page is its own."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_enable_metrics_collection", "0")
os.environ.setdefault("RAY_enable_open_telemetry", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
