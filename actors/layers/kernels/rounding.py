"""Rounding an fp32 value to a narrower float dtype and back, inside Triton kernels.

The layer kernels compute in fp32 but must round wherever the torch code they replace rounds (HF
materialises every intermediate in the activation dtype), so the results match bit for bit.

bf16 is rounded with integer arithmetic (round to nearest, ties to even) rather than `.to()`,
because the Triton interpreter truncates fp32 -> bf16 casts while the GPU rounds them; the bit
trick gives the GPU's answer in both places, so the CPU tests check what the GPU computes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x: tl.tensor, DTYPE: tl.constexpr) -> tl.tensor:
    """fp32 `x` rounded to DTYPE (nearest, ties to even), returned as fp32."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
