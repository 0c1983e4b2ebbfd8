"""Programmatic dependent launch (PDL): at a few rows, the Triton kernels of a decode step start before the
kernel in front of them has finished, so a layer's chain of short launches stops paying each one's ramp-up.

Why: a batch-1 decode step of Llama-3.1-8B is ~9 launches a layer, 32 layers. Between two kernels on a
stream the GPU drains the first (its last programs finish one by one while SMs go idle), then schedules
the second's programs. With PDL (Hopper and newer) the second kernel's programs are scheduled while the
first still runs, and wait on the device instead.

How (CUDA programming guide, "Programmatic Dependent Launch"; Triton's `launch_pdl`):
- A kernel launched with `launch_pdl=True` may begin once every program of the kernel before it has
  called `gdc_launch_dependents` or exited. Its `gdc_wait` then blocks until that kernel has completed
  and its memory is visible. CUDA-graph capture keeps the edge.
- The rule every kernel here follows: `wait_for_previous` comes before any global load or store (only
  index arithmetic precedes it), so nothing the kernel touches can race with an earlier one.
- `wait_for_previous` signals the dependents right after the wait: the next kernel's programs can then
  occupy SMs during this kernel's run, and their own wait keeps the order. Completion is transitive (a
  kernel completes only after its own wait), so a kernel that reads what an older one wrote is safe too.
- A kernel launched without the attribute (cuBLAS, torch ops, copies, NCCL) waits for full completion as
  always; `gdc_wait` in a kernel launched without it returns at once.

Only launches of at most KVRAY_PDL_MAX_ROWS rows (tokens) use it. Measured (benchmarks/RESULTS.md): a
batch-1 token of Llama-3.1-8B 4.751 -> 4.684 ms on an H200 and 6.070 -> 5.986 ms on an H100, while the nano
recipe's 256-row steps lost ~0.5% with it (H200). Also measured and removed: the small-M GEMMs asking the
L2 for their first weight bytes before the wait (bulk prefetch) gave back most of the gain (4.740 ms).

KVRAY_PDL_MAX_ROWS (read in the workers' environment at import; 0 turns PDL off) is the A/B switch. The
CPU tests run under TRITON_INTERPRET=1, where PDL is off (the interpreter runs no PTX);
benchmarks/checks/check_sm90_compile.py compiles every kernel's PDL variant for sm_90.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kvcore.kernels import interpreting

PDL_ENV = "KVRAY_PDL_MAX_ROWS"
MAX_ROWS = int(os.environ.get(PDL_ENV, "16"))


@lru_cache(maxsize=16)
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device, rows: int) -> bool:
    """Whether a launch of `rows` rows on `device` uses PDL: at most MAX_ROWS rows, CUDA compute capability
    >= 9.0, compiled (not interpreted)."""
    if rows > MAX_ROWS or device.type != "cuda" or interpreting():
        return False
    return _hopper_or_newer(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr) -> None:
    """Blocks until the kernel before this one has completed and its writes are visible, then lets the
    next kernel's programs start. A no-op without USE_PDL."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
