"""How a paged KV cache lies in memory.

Every kernel (cache write, fused rotary write, paged attention) and the torch references address the
cache as one logical tensor, [2, num_blocks, block_size, num_kv_heads, head_size], through its
strides, so the physical order of a page is free:

- NHD (vLLM's FlashAttention layout): a page is [block_size, num_kv_heads, head_size]. A token's heads
  are adjacent, so the page of one KV head, which is what one attention program reads, is block_size
  runs of one head row (256 bytes at head 128 in bf16), strided by the other heads.
- HND (FlashInfer's option): a page is [num_kv_heads, block_size, head_size], so the page of one KV
  head is one contiguous run (4 KiB at block 16, head 128, bf16), and a token's write touches one row
  in each head's run.

NHD stays the default because HND measured no faster: on an H100 (2026-12-07) decode at the nano
recipe's shape (256 sequences, contexts 100-2,048) took 386.2 us in NHD and 385.9 us in HND, 97% of the
device's copy bandwidth either way, and the nano recipe ran 19,344 against 19,364 tok/s. 256-byte head
rows already fill whole 128-byte lines, and the resident programs keep enough of them in flight.
KVRAY_KV_LAYOUT=NHD|HND picks the layout at cache allocation (the workers inherit the environment): the
A/B switch, and the layout a kernel that wants head-major pages would take.
"""

from __future__ import annotations

import os

import torch

KV_LAYOUT_ENV = "KVRAY_KV_LAYOUT"
KV_LAYOUTS = ("NHD", "HND")
DEFAULT_KV_LAYOUT = "NHD"


def kv_layout() -> str:
    """The layout $KVRAY_KV_LAYOUT names (the default when unset)."""
    value = os.environ.get(KV_LAYOUT_ENV, DEFAULT_KV_LAYOUT).upper()
    if value not in KV_LAYOUTS:
        raise ValueError(f"{KV_LAYOUT_ENV}={value!r}: must be one of {', '.join(KV_LAYOUTS)}")
    return value


def paged_kv_view(
    memory: torch.Tensor, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, layout: str
) -> torch.Tensor:
    """The logical [2, num_blocks, block_size, num_kv_heads, head_size] cache over `memory`, a flat
    tensor of the cache's dtype holding exactly that many elements, laid out as `layout` says."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"layout {layout!r}: must be one of {', '.join(KV_LAYOUTS)}")
    if layout == "NHD":
        return memory.view(2, num_blocks, block_size, num_kv_heads, head_size)
    return memory.view(2, num_blocks, num_kv_heads, block_size, head_size).transpose(2, 3)
