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

Decode attention is a gather of pages by many programs at once, and the engine's programs run one KV
head of many sequences side by side: with NHD the programs resident together each read a 256-byte
slice out of 4 KiB pages whose other slices are read much later; with HND each reads whole runs.
KVRAY_KV_LAYOUT=NHD|HND picks the layout at cache allocation (the workers inherit the environment).
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
