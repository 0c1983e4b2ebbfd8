"""Start-up warm-up outside the CUDA graphs: the sampler's and the logprobs kernel variants compile, and the
LM head's GEMM kernels load, before the first request (graph capture already compiles and loads everything
the forward launches; see actors/worker/cuda_graphs.py)."""

from __future__ import annotations

from typing import Callable

import torch

from actors.sample.sampler import Sampler, SamplingMetadata

DummySampling = Callable[[int, bool, int], SamplingMetadata]  # (rows, filters, num_logprobs) -> metadata
# Above this many rows the LM head is warmed at every 16th count only (cuBLAS's choices are coarse there).
EVERY_COUNT_UP_TO = 256


def logits_row_counts(max_rows: int) -> list[int]:
    """The sampling-row counts whose LM-head GEMM the warm-up runs: every count up to 256, then every 16th."""
    dense = list(range(1, min(max_rows, EVERY_COUNT_UP_TO) + 1))
    return (
        dense + [r for r in range(EVERY_COUNT_UP_TO + 16, max_rows, 16)] + ([max_rows] if max_rows > dense[-1] else [])
    )


@torch.inference_mode()
def warm_logits(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_rows: int,
) -> None:
    """The LM head runs eagerly after the graph, on the step's sampling rows only, and cuBLAS picks its
    kernel by the row count; CUDA loads a kernel's module at its first launch (lazy loading). On the H200
    the first run's first three prefill steps (25, 51 and 77 sampling rows) spent ~20 ms more host time
    each than the same steps of a second run, and the ones after them (102, 125 rows) did not. A TP group
    runs the same counts on every rank (the head gathers across them)."""
    if device.type != "cuda":
        return
    hidden = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
    for rows in logits_row_counts(max_rows):
        compute_logits(hidden[:rows])
    torch.cuda.synchronize(device)


@torch.inference_mode()
def warm_sampler(
    sampler: Sampler, vocab: int, dtype: torch.dtype, device: torch.device, max_rows: int, dummy: DummySampling
) -> None:
    """Run the greedy, plain random and filtered variants on random logits of the model's dtype (the
    kernels specialise on it), at row counts of each of Triton's integer classes (1, a multiple of 16, any
    other; the sample kernel does not specialise on its row count, so they share its variants). `dummy`
    must hand out the metadata views real steps use (SamplingInputs.dummy): on the H200 the variants
    compiled for fresh int32 tensors did not serve the runner's int64 rows, and three compiles landed in
    the timed run."""
    if device.type != "cuda":
        return
    run_sampler_variants(sampler, vocab, dtype, device, max_rows, dummy)
    torch.cuda.synchronize(device)


def run_sampler_variants(
    sampler: Sampler, vocab: int, dtype: torch.dtype, device: torch.device, max_rows: int, dummy: DummySampling
) -> None:
    """warm_sampler's calls, on any device (tests count the variants they compile on a GPU)."""
    for rows in sorted({1, min(8, max_rows), min(16, max_rows)}):
        logits = torch.randn(rows, vocab, device=device).to(dtype)
        sampler(logits, SamplingMetadata(None, None, None, None, None, all_greedy=True, need_filter=False))
        for filters in (False, True):
            sampler(logits, dummy(rows, filters, -1))
    # The logprobs kernels specialise on neither the row count nor k (their lanes fit the largest k a
    # request may ask): one call compiles both.
    sampler(logits[:1], dummy(1, False, 1))
