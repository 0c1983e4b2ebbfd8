"""Programmatic dependent launch (PDL): the Triton kernels of a decode step start before the kernel in
front of them has finished, so a layer's chain of short launches stops paying each one's ramp-up in full.

Why: a batch-1 decode step of Llama-3.1-8B is ~9 launches a layer, 32 layers. Between two kernels on a
stream the GPU drains the first (its last programs finish one by one while SMs go idle), then schedules
the second's programs, which start their loads from nothing. With PDL (Hopper and newer) the second
kernel's programs are scheduled while the first still runs, and may do whatever does not depend on it.

How (CUDA programming guide, "Programmatic Dependent Launch"; Triton's `launch_pdl`):
- A kernel launched with `launch_pdl=True` may begin once every program of the kernel before it has
  called `gdc_launch_dependents` or exited. Its `gdc_wait` then blocks until that kernel has completed
  and its memory is visible. CUDA-graph capture keeps the edge.
- The rule every kernel here follows: `wait_for_previous` comes before any global load or store of data
  another kernel of the step writes or reads. Only the weights, which no step writes, are touched before
  it: the small-M GEMM asks the L2 for its first weight bytes (`prefetch_rows_l2`), so they stream in
  while the previous kernel (attention, a norm) leaves the memory bus idle.
- `wait_for_previous` signals the dependents right after the wait: the next kernel's programs can then
  occupy SMs during this kernel's run, and their own wait keeps the order. Completion is transitive (a
  kernel completes only after its own wait), so a kernel that reads what an older one wrote is safe too.
- A kernel launched without the attribute (cuBLAS, torch ops, copies) waits for full completion as
  always; `gdc_wait` in a kernel launched without it returns at once.

KVRAY_PDL=1 (read in the workers' environment at import) turns it on; it is off by default until a GPU
has checked it (CUDA graphs, greedy = HF fp32) and timed it against the plain launches. The CPU tests run
under TRITON_INTERPRET=1, where PDL is off (the interpreter runs no PTX); benchmarks/checks/
check_sm90_compile.py compiles every kernel's PDL variant for sm_90.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kvcore.kernels import interpreting

PDL_ENV = "KVRAY_PDL"
ENABLED = os.environ.get(PDL_ENV, "0") == "1"


@lru_cache(maxsize=16)
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: switched on by KVRAY_PDL=1, CUDA compute capability
    >= 9.0, compiled (not interpreted)."""
    if not ENABLED or device.type != "cuda" or interpreting():
        return False
    return _hopper_or_newer(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr) -> None:
    """Blocks until the kernel before this one has completed and its writes are visible, then lets the
    next kernel's programs start. A no-op without USE_PDL."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_rows_l2(row_ptrs: tl.tensor, nbytes: tl.tensor) -> None:
    """Asks the L2 for `nbytes` (a multiple of 16, > 0) from each 16-byte-aligned address in row_ptrs:
    one bulk prefetch instruction a row (sm_90), no registers filled, nothing waited for."""
    tl.inline_asm_elementwise(
        "mov.u32 $0, 0; cp.async.bulk.prefetch.L2.global [$1], $2;",
        "=r,l,r",
        [row_ptrs, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
