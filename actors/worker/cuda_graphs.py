"""CUDA graphs for every step: buckets, padding, static attention metadata, capture and replay.

A step launches a few hundred kernels; at small batches, and in any step on a slow host, launching
them costs more than running them. A captured graph launches them all at once. Every step, decode or
mixed (prefill chunks with decodes), is padded to a bucket and replays that bucket's graph:

- Buckets. Uniform decode steps (every row one token) are padded by row count to `decode_sizes`
  (1, 2, 4, 8, ... max_num_seqs): tokens = sequences = the bucket, max_query_len 1, so the attention
  runs its one-launch decode path with the split-KV count of that batch size. Every other step is
  padded by token count to `token_sizes` (8 ... max_num_batched_tokens), with room for
  min(max_num_seqs, tokens) sequences and max_query_len = the token count (an upper bound: the
  attention's grid over query tiles is sized from the token count, so any mix of lengths fits).
- Padding. Padding sequences hold no tokens (their query_start_loc entries equal the token count) and
  padding tokens belong to no sequence: input id 0, position 0, slot -1 (no KV write); attention
  programs of padding sequences return at once, and nothing reads the padding rows' outputs.
- Static metadata. The graph reads only device buffers whose addresses never change: the staged input
  record, the input and feed buffers (actors/worker/input_prep.py), every KV-cache group's block table and
  slot mapping. Host ints baked into the graph are the bucket's (sequences, tokens, max_query_len,
  max_seq_len = max_model_len); per-sequence lengths are read on the device.
- What runs outside: staging the step's record (one copy), the block-table delta commit, and, after
  the replay, logits of the sampling rows and the sampler.

Capture runs once at start-up, largest bucket first into one memory pool, with the garbage collector
frozen (as vLLM does: torch.cuda.graph collects garbage at every capture otherwise, seconds in all).
Any failure while capturing logs a warning naming it and leaves the runner eager: graphs are an
optimisation, never a reason to stop serving. A step without a graph runs eagerly; its reason is
counted (see GraphStats).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator
from unittest import mock

import torch

from actors.models.stage import StageActivations

logger = logging.getLogger(__name__)

GRAPH_MODES = ("all", "decode", "none")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets up to max_num_seqs (always included): 1, 2, 4, then steps of 8 to 32, of 16
    to 128, of 32 beyond. Padding wastes at most ~20% of a step above 32 requests."""
    if max_num_seqs < 1:
        raise ValueError(f"capture_sizes: max_num_seqs={max_num_seqs} must be >= 1")
    sizes = [1, 2, 4] + list(range(8, 33, 8)) + list(range(48, 129, 16))
    sizes += list(range(160, max_num_seqs + 1, 32))
    sizes = [s for s in sizes if s < max_num_seqs] + [max_num_seqs]
    return sorted(set(sizes))


def token_sizes(max_num_tokens: int) -> list[int]:
    """Token-count buckets of mixed steps up to max_num_tokens (always included): powers of two from
    8 to 512, then alternating x1.5 / x1.33 steps (768, 1024, 1536, 2048, ...): at most ~50% padding
    on tiny steps, where it costs little, at most ~33% from 512 tokens on."""
    if max_num_tokens < 1:
        raise ValueError(f"token_sizes: max_num_tokens={max_num_tokens} must be >= 1")
    sizes, s = [], 8
    while s <= 512:
        sizes.append(s)
        s *= 2
    s = 768
    while s < max_num_tokens:
        sizes.append(s)
        s = s * 4 // 3 if (s & (s - 1)) else s * 3 // 2
    return sorted({x for x in sizes if x < max_num_tokens} | {max_num_tokens})


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding n, or None when n exceeds every bucket."""
    for s in sizes:
        if s >= n:
            return s
    return None


@dataclass(frozen=True, order=True)
class Bucket:
    num_tokens: int
    num_seqs: int
    decode: bool  # uniform decode: one token a sequence

    @property
    def max_query_len(self) -> int:
        return 1 if self.decode else self.num_tokens


class BucketPlan:
    """Which buckets exist for a configuration, and which one a step pads to."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, mode: str, max_graph_tokens: int | None = None) -> None:
        if mode not in GRAPH_MODES:
            raise ValueError(f"model.cudagraph_mode={mode!r}: must be one of {GRAPH_MODES}")
        self.mode = mode
        self.max_num_reqs = max_num_reqs
        graph_tokens = min(max_num_tokens, max_graph_tokens or max_num_tokens)
        self.decode_sizes = capture_sizes(min(max_num_reqs, graph_tokens)) if mode != "none" else []
        self.token_sizes = token_sizes(graph_tokens) if mode == "all" else []

    def buckets(self) -> list[Bucket]:
        decode = [Bucket(s, s, True) for s in self.decode_sizes]
        mixed = [Bucket(t, min(self.max_num_reqs, t), False) for t in self.token_sizes]
        return decode + mixed

    def select(self, num_reqs: int, num_tokens: int, max_query_len: int) -> tuple[Bucket | None, str]:
        """The bucket of a step, or None and why not."""
        if max_query_len == 1 and num_tokens == num_reqs and self.decode_sizes:
            size = bucket_for(num_reqs, self.decode_sizes)
            if size is not None:
                return Bucket(size, size, True), ""
        if not self.token_sizes:
            return (
                None,
                "mixed step without mixed-step graphs (model.cudagraph_mode)"
                if self.decode_sizes
                else "cudagraph_mode is none",
            )
        t = bucket_for(num_tokens, self.token_sizes)
        if t is None:
            return None, f"{num_tokens} tokens exceed every bucket (model.cudagraph_max_tokens)"
        return Bucket(t, min(self.max_num_reqs, t), False), ""


@dataclass
class GraphStats:
    """Steps that replayed a graph, and the eager ones by reason."""

    replayed: int = 0
    eager: Counter = field(default_factory=Counter)

    def count_eager(self, reason: str) -> None:
        if reason not in self.eager:
            logger.info("a step runs eagerly: %s (logged once per reason)", reason)
        self.eager[reason] += 1


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """Collect once, then freeze the heap and make the per-capture gc.collect / empty_cache calls of
    torch.cuda.graph no-ops for the duration (vLLM's start-up fix)."""
    gc.collect()
    gc.freeze()
    try:
        with mock.patch("gc.collect", lambda *a, **k: 0), mock.patch("torch.cuda.empty_cache", lambda: None):
            yield
    finally:
        gc.unfreeze()


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    # hidden states [bucket tokens, H] (a stage before the last: its activations), rewritten by every replay
    output: torch.Tensor | StageActivations


class StepGraphs:
    """Captured graphs by bucket. `forward(bucket)` runs the whole step on the runner's static buffers
    (input kernels, slot mapping, model) and returns the hidden states; `prepare(bucket)` stages a
    dummy step (no rows: every slot -1) so the warm-up and the capture write no KV."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._graphs: dict[Bucket, _Captured] = {}

    @property
    def captured(self) -> list[Bucket]:
        return sorted(self._graphs)

    def __contains__(self, bucket: Bucket) -> bool:
        return bucket in self._graphs

    def capture(
        self,
        buckets: list[Bucket],
        prepare: Callable[[Bucket], None],
        forward: Callable[[Bucket], torch.Tensor | StageActivations],
    ) -> bool:
        """Capture every bucket, largest first, into one shared pool. True when all were captured; on
        any error nothing is kept."""
        pool = torch.cuda.graph_pool_handle()
        try:
            with frozen_gc():
                for bucket in sorted(buckets, key=lambda b: (b.num_tokens, b.num_seqs), reverse=True):
                    prepare(bucket)
                    # Warm-up outside the capture: Triton compiles each kernel variant here, and cuBLAS
                    # picks its algorithms; neither may happen while capturing.
                    forward(bucket)
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        output = forward(bucket)
                    self._graphs[bucket] = _Captured(graph, output)
                for bucket, captured in self._graphs.items():
                    # A graph's first launch also uploads it to the device: paid here, not by the
                    # first requests (the dummy step of prepare() writes no KV).
                    prepare(bucket)
                    captured.graph.replay()
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - any capture problem: warn and run eagerly
            logger.warning("CUDA graph capture failed (%s: %s); steps run eagerly", type(e).__name__, e)
            self.clear()
            try:
                torch.cuda.synchronize(self.device)
            except Exception as e2:  # noqa: BLE001 - report, the eager path will surface real errors
                logger.warning("after the failed capture, synchronize raised %s", e2)
            return False
        return True

    def replay(self, bucket: Bucket) -> torch.Tensor | StageActivations:
        captured = self._graphs[bucket]
        captured.graph.replay()
        return captured.output

    def clear(self) -> None:
        for captured in self._graphs.values():
            captured.graph.reset()
        self._graphs.clear()
