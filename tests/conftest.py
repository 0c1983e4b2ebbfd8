"""Test-wide settings: Triton kernels run on CPU tensors through the interpreter, so CI tests the
kernels themselves; Ray usage stats stay off; no test ever talks to anything but this machine."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
