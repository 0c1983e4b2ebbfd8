"""Slot mapping: the flat KV-cache slot every scheduled token writes to, for every KV-cache group.

    slot[g, t] = block_table_g[req(t), pos(t) // bs_g] * bs_g + pos(t) % bs_g     (int64)
    slot[g, t] = -1 for query_start_loc[num_reqs] <= t < len(positions) (padding: "write nothing")

Only the step's own entries are written, t < len(positions): its tokens, padded up to its CUDA-graph
bucket (the step's readers slice the buffer to that length; what lies beyond is never read).

One launch serves all groups: grid axis 1 is the group, whose block-table pointer, row stride,
block size and output pointer come from small device arrays built once when the tables are made
(the tables never move, so their addresses stay valid). Grid axis 0 tiles the step's entries by
tokens, so one 8k-token prefill is spread over many programs instead of one program walking it
serially; each token finds its request by a binary search over query_start_loc. The tile count
comes from len(positions), a host int fixed per bucket, never from a device value, so the host
never synchronises and a captured graph stays valid for every step of its bucket. (Tiling the whole
buffer instead made a 16-token decode step launch 32 programs a group on an 8k buffer, and under the
CPU interpreter most of a small engine step's time.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore.kernels.token_rows import search_steps, token_rows

# Tokens per program. Small enough that a decode batch of 256 tokens in an 8k buffer still spreads
# over 32 programs per group; large enough that the per-program binary search is amortised.
TOKEN_TILE = 256


@triton.jit
def slot_mapping_kernel(
    query_start_loc_ptr: tl.tensor,  # int32 [num_reqs + 1]
    positions_ptr: tl.tensor,  # int64/int32 [>= num_tokens]
    num_reqs: tl.tensor,
    block_table_ptrs: tl.tensor,  # int64 [G]: address of each group's int32 block table
    block_table_strides: tl.tensor,  # int64 [G]: row stride (elements) of each group's table
    block_sizes: tl.tensor,  # int64 [G]
    slot_mapping_ptrs: tl.tensor,  # int64 [G]: address of each group's int64 slot-mapping buffer
    num_out: tl.tensor,  # entries written in each buffer: the step's, len(positions) (<= the buffer's length)
    TILE: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
) -> None:
    tile = tl.program_id(0)
    group = tl.program_id(1)
    offs = tile * TILE + tl.arange(0, TILE)
    in_buffer = offs < num_out
    num_tokens = tl.load(query_start_loc_ptr + num_reqs)
    is_token = in_buffer & (offs < num_tokens)

    req = token_rows(query_start_loc_ptr, num_reqs, offs, is_token, SEARCH_STEPS, TILE).to(tl.int64)

    block_size = tl.load(block_sizes + group)
    stride = tl.load(block_table_strides + group)
    table = tl.load(block_table_ptrs + group).to(tl.pointer_type(tl.int32))
    out = tl.load(slot_mapping_ptrs + group).to(tl.pointer_type(tl.int64))

    pos = tl.load(positions_ptr + offs, mask=is_token, other=0).to(tl.int64)
    block_id = tl.load(table + req * stride + pos // block_size, mask=is_token, other=0)
    slot = block_id.to(tl.int64) * block_size + pos % block_size
    slot = tl.where(is_token, slot, -1)
    tl.store(out + offs, slot, mask=in_buffer)


def triton_runs_on(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, or on CPU tensors when the interpreter was active at import
    (TRITON_INTERPRET=1); otherwise the torch reference must serve (plain CPU runs)."""
    if device.type == "cuda":
        return True
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(slot_mapping_kernel, InterpretedFunction)


class SlotMappingLaunch:
    """The per-group device arrays of one set of block tables, gathered once; `__call__` launches
    the kernel for all groups at once."""

    def __init__(
        self,
        block_tables: list[torch.Tensor],
        slot_mappings: list[torch.Tensor],
        block_sizes: list[int],
        max_num_reqs: int,
    ) -> None:
        if not (len(block_tables) == len(slot_mappings) == len(block_sizes) >= 1):
            raise ValueError(
                "SlotMappingLaunch: block_tables, slot_mappings and block_sizes must have the same non-zero length"
            )
        device = block_tables[0].device
        lengths = {sm.numel() for sm in slot_mappings}
        if len(lengths) != 1:
            raise ValueError(f"SlotMappingLaunch: slot-mapping buffers differ in length: {lengths}")
        for bt, sm in zip(block_tables, slot_mappings, strict=True):
            if bt.dtype != torch.int32 or sm.dtype != torch.int64:
                raise ValueError("SlotMappingLaunch: block tables must be int32, slot mappings int64")
            if bt.stride(1) != 1 or not sm.is_contiguous():
                raise ValueError("SlotMappingLaunch: block-table rows and slot mappings must be contiguous")
        self.buffer_len = lengths.pop()
        self.num_groups = len(block_tables)
        self.search_steps = search_steps(max_num_reqs)
        # Keep the tensors alive: the kernel holds only their addresses.
        self._tensors = (list(block_tables), list(slot_mappings))
        self.table_ptrs = torch.tensor([t.data_ptr() for t in block_tables], dtype=torch.int64, device=device)
        self.table_strides = torch.tensor([t.stride(0) for t in block_tables], dtype=torch.int64, device=device)
        self.block_sizes = torch.tensor(block_sizes, dtype=torch.int64, device=device)
        self.out_ptrs = torch.tensor([s.data_ptr() for s in slot_mappings], dtype=torch.int64, device=device)

    def __call__(self, num_reqs: int, query_start_loc: torch.Tensor, positions: torch.Tensor) -> None:
        num_out = min(positions.numel(), self.buffer_len)
        grid = (max(1, triton.cdiv(num_out, TOKEN_TILE)), self.num_groups)
        slot_mapping_kernel[grid](
            query_start_loc,
            positions,
            num_reqs,
            self.table_ptrs,
            self.table_strides,
            self.block_sizes,
            self.out_ptrs,
            num_out,
            TILE=TOKEN_TILE,
            SEARCH_STEPS=self.search_steps,
        )


def slot_mapping_ref(
    block_table: torch.Tensor,
    block_size: int,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    num_reqs: int,
    buffer_len: int,
) -> torch.Tensor:
    """Plain-torch reference: returns the int64 [buffer_len] slot mapping of one group.
    Reads device values (host sync); for tests and for CPU runs without the Triton interpreter."""
    qsl = query_start_loc[: num_reqs + 1].to(torch.int64)
    num_tokens = int(qsl[-1])
    lens = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(num_reqs, device=qsl.device), lens)
    pos = positions[:num_tokens].to(torch.int64)
    block_ids = block_table[req, pos // block_size].to(torch.int64)
    out = torch.full((buffer_len,), -1, dtype=torch.int64, device=block_table.device)
    out[:num_tokens] = block_ids * block_size + pos % block_size
    return out
