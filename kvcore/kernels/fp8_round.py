"""Rounding onto an fp8 grid inside Triton kernels (the fp8 KV-cache write, the fp8 activation quantizer).

The value is rounded in fp32 arithmetic onto the fp8 grid before the cast, so the cast itself is exact:
the interpreter's fp32 -> fp8 cast does not carry a rounded-up mantissa into the exponent (7.8 became 4.0
instead of 8.0), while the GPU's cvt rounds correctly. With the value already on the grid both give the
GPU's answer, so the CPU tests check what the GPU computes. The formats' constants: kvcore/kernels/fp8.py.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_fp8_grid(x: tl.tensor, MANT: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr) -> tl.tensor:
    """fp32 x saturated to +-FMAX and rounded (nearest, ties to even) to a multiple of the fp8
    quantum at its magnitude, 2^(max(exponent, EMIN) - MANT); returned as fp32, exactly representable
    in the fp8 format."""
    bits = x.to(tl.uint32, bitcast=True)
    a = tl.minimum((bits & 0x7FFFFFFF).to(tl.float32, bitcast=True), FMAX)  # |x|, saturated
    exp = (a.to(tl.int32, bitcast=True) >> 23) - 127
    q = tl.maximum(exp, EMIN) - MANT
    up = ((127 - q) << 23).to(tl.float32, bitcast=True)  # 2^-q: exact scaling, |x| * up < 2^(MANT+1)
    down = ((127 + q) << 23).to(tl.float32, bitcast=True)
    # Adding and taking away 1.5 * 2^23 leaves the fp32 add's own round-to-nearest-even integer.
    r = ((a * up + 12582912.0) - 12582912.0) * down
    # The sign goes back on as a bit, so values that round to zero keep it (-0.0, as the GPU's cvt).
    return (r.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
