"""Start-up warm-up outside the CUDA graphs: the sampler's and the logprobs kernel variants compile before
the first request (graph capture already compiles everything the forward launches; see actors/cuda_graphs.py)."""

from __future__ import annotations

from typing import Callable

import torch

from actors.sampler import Sampler, SamplingMetadata

DummySampling = Callable[[int, bool, int], SamplingMetadata]  # (rows, filters, num_logprobs) -> metadata


@torch.inference_mode()
def warm_sampler(sampler: Sampler, vocab: int, device: torch.device, max_rows: int, dummy: DummySampling) -> None:
    """Run the greedy, plain random and filtered variants on random logits, for row counts that hit each
    of Triton's integer specialisations (1, a multiple of 16, any other). `dummy` must hand out the
    metadata views real steps use (SamplingInputs.dummy): on the H200 the variants compiled for fresh
    int32 tensors did not serve the runner's int64 rows, and three compiles landed in the timed run."""
    if device.type != "cuda":
        return
    for rows in sorted({1, min(8, max_rows), min(16, max_rows)}):
        logits = torch.randn(rows, vocab, device=device)
        sampler(logits, SamplingMetadata(None, None, None, None, None, all_greedy=True, need_filter=False))
        for filters in (False, True):
            sampler(logits, dummy(rows, filters, -1))
    # The logprobs kernels specialise on neither the row count nor k: one call compiles both.
    sampler(logits[:1], dummy(1, False, 1))
    torch.cuda.synchronize(device)
