"""Applies a block-table delta on the device: table.flat[index[i]] = value[i] for i < n.

The host resolves every row operation since the last commit (appends, overwrites, clears, moves,
swaps) into the final value of each touched cell, read from the CPU table (the source of truth).
A cell listed twice carries the same value both times, so the scatter has no ordering constraints
and the whole delta lands with one fully parallel launch; its cost follows the cells written, not
max_model_len. Index and value travel in one packed buffer, [index[0:n], value[0:n]], which the
kernel reads straight from pinned host memory on CUDA (or after one contiguous copy).
"""

from __future__ import annotations

from array import array

import numpy as np
import torch
import triton
import triton.language as tl

ENTRY_TILE = 1024


# n changes every step: no variant per value class (1, multiples of 16), or the first steps compile them.
@triton.jit(do_not_specialize=["n"])
def _apply_delta_kernel(table_ptr: tl.tensor, packed_ptr: tl.tensor, n: tl.tensor, TILE: tl.constexpr) -> None:
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    mask = offs < n
    index = tl.load(packed_ptr + offs, mask=mask, other=0)
    value = tl.load(packed_ptr + n + offs, mask=mask, other=0)
    tl.store(table_ptr + index, value.to(tl.int32), mask=mask)


def apply_block_table_delta(table: torch.Tensor, packed: torch.Tensor, n: int, use_triton: bool) -> None:
    """`packed` holds [index[0:n], value[0:n]] (int32, or int64 for tables of 2**31+ cells), on
    the table's device or, for the Triton kernel on CUDA, in pinned host memory the device can
    read; `table` is the contiguous int32 device table."""
    if n == 0:
        return
    if use_triton:
        _apply_delta_kernel[(triton.cdiv(n, ENTRY_TILE),)](table, packed, n, TILE=ENTRY_TILE)
    else:
        apply_block_table_delta_ref(table, packed, n)


def apply_block_table_delta_ref(table: torch.Tensor, packed: torch.Tensor, n: int) -> None:
    """Plain-torch reference of the kernel."""
    table.view(-1)[packed[:n].to(torch.int64)] = packed[n : 2 * n].to(torch.int32)


# Entries one delta upload may carry; beyond it a full copy is cheaper anyway for the table sizes
# this serves (256 rows x 12,500 blocks is 3.2 M cells; 256 K entries is a 2 MiB upload).
MAX_DELTA_ENTRIES = 1 << 18
# Tables with this many cells or more need int64 flat indices.
INDEX32_LIMIT = 2**31


class DirtyCells:
    """The cells of one table written since the last commit, as flat indices row * cols + col.

    Appends (the hot path: one per running request per decode step) record their cells one index
    each; whole-row operations (overwrite, clear, move, swap) record one span [lo, hi) per row,
    merged into the row's hull. A cell may be recorded more than once: the upload reads every
    cell's final value from the CPU table, so repeated entries carry the same value and the
    scatter stays order-free.
    """

    def __init__(self, cols: int) -> None:
        self.cols = cols
        self._cells = array("q")  # np.frombuffer reads it without a copy
        self._span_lo: dict[int, int] = {}
        self._span_hi: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self._cells) or bool(self._span_lo)

    def add_cells(self, row: int, start: int, end: int) -> None:
        base = row * self.cols
        if end - start == 1:
            self._cells.append(base + start)
        else:
            self._cells.extend(range(base + start, base + end))

    def add_span(self, row: int, lo: int, hi: int) -> None:
        if lo >= hi:
            return
        old_lo = self._span_lo.get(row)
        if old_lo is None:
            self._span_lo[row] = lo
            self._span_hi[row] = hi
        else:
            self._span_lo[row] = min(old_lo, lo)
            self._span_hi[row] = max(self._span_hi[row], hi)

    def indices(self) -> list[np.ndarray]:
        """The recorded flat indices (int64), in one or two arrays. Valid until clear()."""
        parts = [np.frombuffer(self._cells, dtype=np.int64)] if self._cells else []
        if self._span_lo:
            k = len(self._span_lo)
            rows = np.fromiter(self._span_lo.keys(), dtype=np.int64, count=k)
            lo = np.fromiter(self._span_lo.values(), dtype=np.int64, count=k)
            hi = np.fromiter(self._span_hi.values(), dtype=np.int64, count=k)
            lens = hi - lo
            starts = np.cumsum(lens) - lens
            parts.append(np.arange(int(lens.sum())) + np.repeat(rows * self.cols + lo - starts, lens))
        return parts

    def clear(self) -> None:
        self._cells = array("q")  # a new array: views handed out by indices() may still exist
        self._span_lo.clear()
        self._span_hi.clear()

    def drop_rows_below(self, num_rows: int) -> None:
        """Forgets the cells of rows [0, num_rows), which a full copy has just brought up to date."""
        if self._cells:
            cells = np.frombuffer(self._cells, dtype=np.int64)
            rest = array("q")
            rest.frombytes(cells[cells >= num_rows * self.cols].tobytes())
            self._cells = rest
        for row in [r for r in self._span_lo if r < num_rows]:
            del self._span_lo[row]
            del self._span_hi[row]


class BlockTableDeltaUploader:
    """Packs recorded cells with their CPU values into a pinned staging buffer, then one launch
    scatters them into the device table.

    On CUDA the kernel reads the pinned buffer in place (zero-copy: pinned memory is mapped into
    the device's address space), so a step costs one launch and no separate copy; where the
    launcher refuses the host pointer, a non-blocking copy to a device buffer comes first.
    Two staging buffers alternate, and each remembers the CUDA event recorded after the work that
    read it, so the host never overwrites staging memory the device may still read. The CPU table
    itself is never read by the device in this mode, so the host may mutate it at any time.
    """

    def __init__(self, cpu_table: np.ndarray, gpu_table: torch.Tensor, pin_memory: bool, use_triton: bool) -> None:
        rows, cols = cpu_table.shape
        self.capacity = max(1, min(rows * cols, MAX_DELTA_ENTRIES))
        self.np_dtype = np.int32 if rows * cols < INDEX32_LIMIT else np.int64
        torch_dtype = torch.int32 if self.np_dtype == np.int32 else torch.int64
        self._flat_cpu = cpu_table.reshape(-1)  # a view: the table is contiguous
        self._gpu_table = gpu_table
        self._use_triton = use_triton
        self._cuda = gpu_table.device.type == "cuda"
        pin = pin_memory and torch.cuda.is_available()
        self._staging = [torch.empty(2 * self.capacity, dtype=torch_dtype, pin_memory=pin) for _ in range(2)]
        self._staging_np = [s.numpy() for s in self._staging]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._next = 0
        self.zero_copy = self._cuda and pin and use_triton and self._launcher_maps_host()
        self._device_buf = torch.empty(2 * self.capacity, dtype=torch_dtype, device=gpu_table.device)

    def _launcher_maps_host(self) -> bool:
        """Whether the Triton launcher accepts the pinned buffer as a device pointer (it asks the
        driver and raises ValueError when the memory is not mapped). n = 0: nothing is read."""
        try:
            _apply_delta_kernel[(1,)](self._gpu_table, self._staging[0], 0, TILE=ENTRY_TILE)
        except ValueError:
            return False
        return True

    def upload(self, parts: list[np.ndarray]) -> bool:
        """Writes the cells at the flat indices in `parts` from the CPU table into the device
        table. Returns False, doing nothing, when they exceed the staging capacity."""
        n = sum(len(p) for p in parts)
        if n == 0:
            return True
        if n > self.capacity:
            return False
        k = self._next
        self._next ^= 1
        done = self._events[k]
        if done is not None:
            done.synchronize()  # normally long done: it is two commits old
        buf = self._staging_np[k]
        at = 0
        for p in parts:
            buf[at : at + len(p)] = p
            at += len(p)
        if buf.dtype == self._flat_cpu.dtype:
            np.take(self._flat_cpu, buf[:n], out=buf[n : 2 * n], mode="clip")  # in range anyway
        else:
            buf[n : 2 * n] = self._flat_cpu[buf[:n]]
        if self.zero_copy:
            source = self._staging[k]
        else:
            source = self._device_buf[: 2 * n]
            source.copy_(self._staging[k][: 2 * n], non_blocking=True)
        apply_block_table_delta(self._gpu_table, source, n, self._use_triton)
        if self._cuda:
            event = self._events[k]
            if event is None:
                event = self._events[k] = torch.cuda.Event()
            event.record()
        return True
