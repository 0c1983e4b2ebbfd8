"""Per-request block tables of the persistent batch, and the slot mapping computed from them.

The CPU table is the source of truth: every row operation edits it through numpy and records which
cells it touched. `commit_block_table` brings the device table up to date either by copying whole
rows (`commit_mode="full"`) or by uploading only the touched cells (`"delta"`, see
kernels/block_table_delta.py), whose cost follows the number of changes, not `max_model_len`.

Invariant kept by every operation: cells at or beyond a row's count are 0, so a row reused by
another request never shows the previous request's block ids.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcore.buffers import CpuGpuBuffer
from kvcore.kernels.block_table_delta import BlockTableDeltaUploader, DirtyCells
from kvcore.kernels.slot_mapping import SlotMappingLaunch, slot_mapping_ref, triton_runs_on

COMMIT_MODES = ("full", "delta")


def _check_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


def default_commit_mode(device: torch.device) -> str:
    """Delta on CUDA, where a full copy costs PCIe bandwidth per step; full on the CPU, where the
    'copy' is a memcpy and needs no kernel."""
    return "delta" if device.type == "cuda" else "full"


def check_slot_mapping_inputs(
    owner: str,
    num_reqs: int,
    max_num_reqs: int,
    device: torch.device,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    if not 0 <= num_reqs <= max_num_reqs:
        raise ValueError(f"{owner}: num_reqs must be in [0, max_num_reqs={max_num_reqs}], got {num_reqs}")
    if query_start_loc.dim() != 1 or query_start_loc.numel() < num_reqs + 1:
        raise ValueError(
            f"{owner}: query_start_loc must be 1-D with at least num_reqs + 1 = "
            f"{num_reqs + 1} entries, got shape {tuple(query_start_loc.shape)}"
        )
    for name, t in (("query_start_loc", query_start_loc), ("positions", positions)):
        if t.device != device:
            raise ValueError(f"{owner}: {name} must be on {device}, got {t.device}")
        if t.dtype not in (torch.int32, torch.int64) or not t.is_contiguous():
            raise ValueError(f"{owner}: {name} must be a contiguous int32/int64 tensor, got {t.dtype}")


class BlockTable:
    """Block ids of one KV-cache group for every row of the persistent batch."""

    def __init__(
        self,
        block_size: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        pin_memory: bool,
        device: torch.device,
        commit_mode: str | None = None,
    ) -> None:
        _check_positive(
            "BlockTable",
            block_size=block_size,
            max_num_reqs=max_num_reqs,
            max_num_blocks_per_req=max_num_blocks_per_req,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self.device = torch.device(device)
        self.block_size = int(block_size)
        self.max_num_reqs = int(max_num_reqs)
        self.max_num_blocks_per_req = int(max_num_blocks_per_req)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.block_table = CpuGpuBuffer(
            max_num_reqs, max_num_blocks_per_req, dtype=torch.int32, device=self.device, pin_memory=pin_memory
        )
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        self.slot_mapping = CpuGpuBuffer(
            max_num_batched_tokens, dtype=torch.int64, device=self.device, pin_memory=pin_memory
        )
        self.device = self.block_table.gpu.device  # resolved: "cuda" becomes "cuda:<index>"
        self.slot_mapping.cpu.fill_(-1)
        self.slot_mapping.gpu.fill_(-1)
        self.commit_mode = commit_mode or default_commit_mode(self.device)
        # In delta mode, copy whole rows instead when that moves fewer bytes (tests turn it off to
        # drive the delta path on tiny tables).
        self.full_copy_fallback = True
        # Cells written since the last commit: tracked in both modes, so the mode may change
        # between commits.
        self._dirty = DirtyCells(self.max_num_blocks_per_req)
        self.use_triton = triton_runs_on(self.device)
        self.delta_uploader = BlockTableDeltaUploader(
            self.block_table.np, self.block_table.gpu, pin_memory, self.use_triton
        )
        self._launch = SlotMappingLaunch(
            [self.block_table.gpu], [self.slot_mapping.gpu], [self.block_size], self.max_num_reqs
        )

    @property
    def commit_mode(self) -> str:
        return self._commit_mode

    @commit_mode.setter
    def commit_mode(self, mode: str) -> None:
        if mode not in COMMIT_MODES:
            raise ValueError(f"BlockTable: commit_mode must be one of {COMMIT_MODES}, got {mode!r}")
        self._commit_mode = mode

    # ---- row operations (CPU side) -------------------------------------------------------------

    def append_row(self, block_ids: list[int], row_idx: int) -> None:
        self._write_append(block_ids, row_idx, self._check_append(block_ids, row_idx))

    def add_row(self, block_ids: list[int], row_idx: int) -> None:
        self._check_add(block_ids, row_idx)
        self._write_add(block_ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        self._check_row("clear_row", "row_idx", row_idx)
        old = int(self.num_blocks_per_row[row_idx])
        self.block_table.np[row_idx, :old] = 0
        self.num_blocks_per_row[row_idx] = 0
        self._mark(row_idx, 0, old)

    def move_row(self, src: int, tgt: int) -> None:
        """Copies row src into row tgt (src keeps its blocks, as in vLLM's condense)."""
        self._check_row("move_row", "src", src)
        self._check_row("move_row", "tgt", tgt)
        if src == tgt:
            return
        table = self.block_table.np
        n = int(self.num_blocks_per_row[src])
        old = int(self.num_blocks_per_row[tgt])
        table[tgt, :n] = table[src, :n]
        if old > n:
            table[tgt, n:old] = 0
        self.num_blocks_per_row[tgt] = n
        self._mark(tgt, 0, max(n, old))

    def swap_row(self, src: int, tgt: int) -> None:
        self._check_row("swap_row", "src", src)
        self._check_row("swap_row", "tgt", tgt)
        if src == tgt:
            return
        table = self.block_table.np
        counts = self.num_blocks_per_row
        m = int(max(counts[src], counts[tgt]))  # beyond both counts both rows are 0 already
        table[[src, tgt], :m] = table[[tgt, src], :m]
        counts[src], counts[tgt] = counts[tgt], counts[src]
        self._mark(src, 0, m)
        self._mark(tgt, 0, m)

    # ---- device side ---------------------------------------------------------------------------

    def commit_block_table(self, num_reqs: int) -> None:
        """Brings device rows [0, num_reqs) up to date without blocking the host. In delta mode
        every touched row is brought up to date, so the whole device table equals the CPU table."""
        if not 0 <= num_reqs <= self.max_num_reqs:
            raise ValueError(
                f"BlockTable.commit_block_table: num_reqs must be in "
                f"[0, max_num_reqs={self.max_num_reqs}], got {num_reqs}"
            )
        if self._commit_mode == "delta":
            self._commit_delta(num_reqs)
        else:
            self._commit_full(num_reqs)

    def compute_slot_mapping(self, num_reqs: int, query_start_loc: torch.Tensor, positions: torch.Tensor) -> None:
        """Fills slot_mapping.gpu[:len(positions)] on the current stream (the step's entries; the rest
        is left as it was); tokens from query_start_loc[num_reqs] on get -1. Reads the device table,
        so commit first."""
        check_slot_mapping_inputs(
            "BlockTable.compute_slot_mapping", num_reqs, self.max_num_reqs, self.device, query_start_loc, positions
        )
        if self.use_triton:
            self._launch(num_reqs, query_start_loc, positions)
            return
        n = min(positions.numel(), self.max_num_batched_tokens)
        self.slot_mapping.gpu[:n].copy_(
            slot_mapping_ref(self.block_table.gpu, self.block_size, query_start_loc, positions, num_reqs, n)
        )

    # ---- internals -----------------------------------------------------------------------------

    def _commit_delta(self, num_reqs: int) -> None:
        if not self._dirty:
            return
        parts = self._dirty.indices()
        n = sum(len(p) for p in parts)
        last_row = max(int(p.max()) for p in parts) // self.max_num_blocks_per_req
        full_rows = max(num_reqs, last_row + 1)
        # Two words (index, value) per delta cell against one word per cell of a full copy.
        delta_too_big = self.full_copy_fallback and 2 * n > full_rows * self.max_num_blocks_per_req
        if delta_too_big or not self.delta_uploader.upload(parts):
            self._commit_full(full_rows)
            return
        self._dirty.clear()

    def _commit_full(self, num_rows: int) -> None:
        self.block_table.copy_to_gpu(num_rows)
        if self._dirty:
            self._dirty.drop_rows_below(num_rows)

    # Validation is split from writing so that MultiGroupBlockTable can check every group before
    # touching any: a bad call then leaves all groups unchanged.
    def _check_append(self, block_ids: list[int], row_idx: int) -> int:
        self._check_row("append_row", "row_idx", row_idx)
        start = int(self.num_blocks_per_row[row_idx])
        self._check_ids("append_row", block_ids, row_idx, start + len(block_ids))
        return start

    def _write_append(self, block_ids: list[int], row_idx: int, start: int) -> None:
        if len(block_ids) == 0:
            return
        end = start + len(block_ids)
        self.block_table.np[row_idx, start:end] = block_ids
        self.num_blocks_per_row[row_idx] = end
        self._dirty.add_cells(row_idx, start, end)

    def _check_add(self, block_ids: list[int], row_idx: int) -> None:
        self._check_row("add_row", "row_idx", row_idx)
        self._check_ids("add_row", block_ids, row_idx, len(block_ids))

    def _write_add(self, block_ids: list[int], row_idx: int) -> None:
        new = len(block_ids)
        old = int(self.num_blocks_per_row[row_idx])
        row = self.block_table.np[row_idx]
        if new:
            row[:new] = block_ids
        if old > new:
            row[new:old] = 0
        self.num_blocks_per_row[row_idx] = new
        self._mark(row_idx, 0, max(old, new))

    def _mark(self, row: int, lo: int, hi: int) -> None:
        self._dirty.add_span(row, lo, hi)

    def _check_row(self, op: str, name: str, row: int) -> None:
        if not 0 <= row < self.max_num_reqs:
            raise ValueError(f"BlockTable.{op}: {name} must be in [0, max_num_reqs={self.max_num_reqs}), got {row}")

    def _check_ids(self, op: str, block_ids: list[int], row: int, end: int) -> None:
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"BlockTable.{op}: row {row} would hold {end} blocks, more than "
                f"max_num_blocks_per_req={self.max_num_blocks_per_req}"
            )
        if len(block_ids) and min(block_ids) < 0:
            raise ValueError(f"BlockTable.{op}: block_ids must be >= 0, got {min(block_ids)}")


class MultiGroupBlockTable:
    """One BlockTable per KV-cache group; block ids travel as tuple[list[int], ...] (one list per
    group). The slot mappings of all groups come from one kernel launch."""

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        pin_memory: bool,
        device: torch.device,
        block_sizes: list[int],
        commit_mode: str | None = None,
    ) -> None:
        _check_positive("MultiGroupBlockTable", max_model_len=max_model_len)
        if len(block_sizes) == 0:
            raise ValueError("MultiGroupBlockTable: block_sizes must name at least one group")
        for i, bs in enumerate(block_sizes):
            _check_positive("MultiGroupBlockTable", **{f"block_sizes[{i}]": bs})
        self.device = torch.device(device)
        self.max_num_reqs = int(max_num_reqs)
        self.block_tables = [
            BlockTable(
                bs, max_num_reqs, -(-max_model_len // bs), max_num_batched_tokens, pin_memory, self.device, commit_mode
            )
            for bs in block_sizes
        ]
        self.device = self.block_tables[0].device
        self.use_triton = self.block_tables[0].use_triton
        self._launch = SlotMappingLaunch(
            [bt.block_table.gpu for bt in self.block_tables],
            [bt.slot_mapping.gpu for bt in self.block_tables],
            [bt.block_size for bt in self.block_tables],
            self.max_num_reqs,
        )

    def __getitem__(self, group_id: int) -> BlockTable:
        return self.block_tables[group_id]

    def __len__(self) -> int:
        return len(self.block_tables)

    @property
    def commit_mode(self) -> str:
        return self.block_tables[0].commit_mode

    @commit_mode.setter
    def commit_mode(self, mode: str) -> None:
        for bt in self.block_tables:
            bt.commit_mode = mode

    def append_row(self, block_ids: tuple[list[int], ...], row_idx: int) -> None:
        self._check_groups("append_row", block_ids)
        starts = [bt._check_append(ids, row_idx) for bt, ids in zip(self.block_tables, block_ids, strict=True)]
        for bt, ids, start in zip(self.block_tables, block_ids, starts, strict=True):
            bt._write_append(ids, row_idx, start)

    def add_row(self, block_ids: tuple[list[int], ...], row_idx: int) -> None:
        self._check_groups("add_row", block_ids)
        for bt, ids in zip(self.block_tables, block_ids, strict=True):
            bt._check_add(ids, row_idx)
        for bt, ids in zip(self.block_tables, block_ids, strict=True):
            bt._write_add(ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        for bt in self.block_tables:
            bt.clear_row(row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        for bt in self.block_tables:
            bt.move_row(src, tgt)

    def swap_row(self, src: int, tgt: int) -> None:
        for bt in self.block_tables:
            bt.swap_row(src, tgt)

    def commit_block_table(self, num_reqs: int) -> None:
        for bt in self.block_tables:
            bt.commit_block_table(num_reqs)

    def compute_slot_mapping(self, num_reqs: int, query_start_loc: torch.Tensor, positions: torch.Tensor) -> None:
        """One launch fills every group's slot_mapping.gpu[:len(positions)]."""
        check_slot_mapping_inputs(
            "MultiGroupBlockTable.compute_slot_mapping",
            num_reqs,
            self.max_num_reqs,
            self.device,
            query_start_loc,
            positions,
        )
        if self.use_triton:
            self._launch(num_reqs, query_start_loc, positions)
            return
        for bt in self.block_tables:
            bt.compute_slot_mapping(num_reqs, query_start_loc, positions)

    def _check_groups(self, op: str, block_ids: tuple[list[int], ...]) -> None:
        if len(block_ids) != len(self.block_tables):
            raise ValueError(
                f"MultiGroupBlockTable.{op}: block_ids must hold one list per group "
                f"({len(self.block_tables)}), got {len(block_ids)}"
            )
