"""Which row (request) each token of a flat step belongs to, inside a Triton kernel: a binary search
over the rows' start offsets, shared by the kernels that expand per-row data to per-token data
(slot_mapping, input_prep)."""

from __future__ import annotations

import triton
import triton.language as tl


def search_steps(num_rows: int) -> int:
    """Iterations that a binary search over num_rows + 1 starts needs to converge."""
    return max(1, (num_rows + 1).bit_length())


@triton.jit
def token_rows(
    starts_ptr: tl.tensor,  # int32 [num_rows + 1]: each row's first token, then the token count
    num_rows: tl.tensor,
    offs: tl.tensor,  # [TILE] token indices
    is_token: tl.tensor,  # [TILE] which of offs are tokens of this step (the rest are not searched)
    steps: tl.tensor,  # search_steps(num_rows) or more
    TILE: tl.constexpr,
) -> tl.tensor:
    """[TILE] int32: for each token, the last row whose start is <= the token (the upper bound in
    starts[0..num_rows], minus one), so rows with no tokens this step (equal starts) are skipped;
    -1 where is_token is false."""
    lo = tl.zeros([TILE], dtype=tl.int32)
    hi = tl.zeros([TILE], dtype=tl.int32) + (num_rows + 1)
    for _ in range(steps):
        active = is_token & (lo < hi)
        mid = (lo + hi) // 2
        start = tl.load(starts_ptr + mid, mask=active, other=0)
        right = start <= offs
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & (~right), mid, hi)
    return lo - 1
