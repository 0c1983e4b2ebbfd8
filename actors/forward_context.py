"""Per-step attention metadata, visible to every attention layer during one forward pass.

The model runner builds one AttentionMetadata per KV-cache group (all layers of a group share the
block table and the slot mapping) and installs them with `set_forward_context` around the forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class AttentionMetadata:
    num_actual_tokens: int  # tokens of real requests; rows beyond are padding (slot -1)
    num_reqs: int
    max_query_len: int  # host ints, so kernels need no device sync to size their grids
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], device
    seq_lens: torch.Tensor  # int32 [num_reqs], device: context length after this step
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req], device
    slot_mapping: torch.Tensor  # int64 [num_tokens], device; -1 = write nothing
    seq_order: torch.Tensor | None = None  # int32 [num_reqs], device: longest first (launch order only)


@dataclass
class ForwardContext:
    attn_metadata: dict[int, AttentionMetadata] | None  # by KV-cache group id; None in a profile run
    layer_to_group: dict[str, int]


_CONTEXT: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[None]:
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield
    finally:
        _CONTEXT = prev


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside set_forward_context()")
    return _CONTEXT
