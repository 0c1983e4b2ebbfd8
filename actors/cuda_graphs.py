"""CUDA graphs for decode steps: capture the model forward once per batch-size bucket, replay it per step.

A decode step (every scheduled request runs exactly one token) launches a few hundred small kernels
whose launch cost rivals their run time at small batches; replaying a captured graph launches them
all at once. What makes a step replayable:

- Shapes: the batch is padded up to the next captured size ("bucket"). Padding rows run token 0 at
  position 0 with seq_len 1: their slot is -1 (the slot-mapping kernel, launched with the real request
  count, writes -1 for every token past the real ones), so they write no KV, and they read one position
  of whatever block their block-table row names (a valid block id: row cells are block ids or 0, the
  null block), so they stay finite. Their outputs are never read.
- Addresses: the graph reads the runner's persistent device buffers (input ids, positions,
  query_start_loc, seq_lens, each group's block table and slot mapping) through views taken at capture
  time; per-step preparation copies into the same storage, and the block-table commit and the
  slot-mapping kernel run eagerly on the same stream before the replay.
- Host ints: attention metadata is captured with max_query_len = 1 and max_seq_len = max_model_len, so
  the paged-attention grid and its split-KV count are those of any decode batch of that size; the
  kernel computes each split's share of the context from seq_lens on the device.

Logits and sampling stay outside the graph and run eagerly on the graph's output rows.
Any failure while capturing logs a warning and leaves the runner eager: graphs are an optimisation,
never a reason to stop serving.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets up to max_num_seqs (always included): 1, 2, 4, then steps of 8 to 32, of 16
    to 128, of 32 beyond. Padding wastes at most ~20% of a step above 32 requests."""
    if max_num_seqs < 1:
        raise ValueError(f"capture_sizes: max_num_seqs={max_num_seqs} must be >= 1")
    sizes = [1, 2, 4] + list(range(8, 33, 8)) + list(range(48, 129, 16))
    sizes += list(range(160, max_num_seqs + 1, 32))
    sizes = [s for s in sizes if s < max_num_seqs] + [max_num_seqs]
    return sorted(set(sizes))


def bucket_for(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding num_reqs requests, or None when the batch exceeds every bucket."""
    for s in sizes:
        if s >= num_reqs:
            return s
    return None


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # the forward's hidden states [size, H], rewritten by every replay


class DecodeGraphs:
    """Captured decode graphs by bucket size. `forward(size)` must run the model on the runner's static
    buffers under the size's attention metadata (the runner prepares them) and return hidden states."""

    def __init__(self, sizes: list[int], device: torch.device) -> None:
        self.sizes = sorted(sizes)
        self.device = device
        self._graphs: dict[int, _Captured] = {}

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def __contains__(self, size: int) -> bool:
        return size in self._graphs

    def capture(self, prepare: Callable[[int], None], forward: Callable[[int], torch.Tensor]) -> bool:
        """Capture every bucket, largest first, into one shared memory pool (the small graphs reuse the
        large one's activation memory). `prepare(size)` fills the static buffers with a dummy decode
        batch. Returns True when every bucket was captured; on any error nothing is kept."""
        pool = torch.cuda.graph_pool_handle()
        try:
            for size in sorted(self.sizes, reverse=True):
                prepare(size)
                # Warm-up outside the capture: Triton compiles each kernel variant (split count, grid)
                # here, and cuBLAS picks its algorithms; neither may happen while capturing.
                forward(size)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    output = forward(size)
                self._graphs[size] = _Captured(graph, output)
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - any capture problem: warn and run eagerly
            logger.warning("CUDA graph capture failed (%s: %s); decode steps run eagerly",
                           type(e).__name__, e)
            self.clear()
            try:
                torch.cuda.synchronize(self.device)
            except Exception as e2:  # noqa: BLE001 - report, the eager path will surface real errors
                logger.warning("after the failed capture, synchronize raised %s", e2)
            return False
        return True

    def replay(self, size: int) -> torch.Tensor:
        """Run the bucket's graph on the current contents of the static buffers; its hidden states."""
        captured = self._graphs[size]
        captured.graph.replay()
        return captured.output

    def clear(self) -> None:
        for captured in self._graphs.values():
            captured.graph.reset()
        self._graphs.clear()
