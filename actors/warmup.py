"""Start-up warm-up outside the CUDA graphs: the sampler's kernel variants compile before the first
request (graph capture already compiles everything the forward launches; see actors/cuda_graphs.py)."""
from __future__ import annotations

import torch

from actors.sampler import Sampler, SamplingMetadata


def dummy_sampling(rows: int, filters: bool, num_logprobs: int, device: torch.device) -> SamplingMetadata:
    """Random rows (temperature 1), with top-k 8 / top-p 0.9 when `filters`."""
    ones = torch.ones(rows, device=device)
    ids = torch.zeros(rows, dtype=torch.int64, device=device)
    return SamplingMetadata(temperature=ones, top_k=ids.to(torch.int32) + (8 if filters else 0),
                            top_p=ones * (0.9 if filters else 1.0), seeds=ids, positions=ids,
                            all_greedy=False, need_filter=filters, num_logprobs=num_logprobs)


@torch.inference_mode()
def warm_sampler(sampler: Sampler, vocab: int, device: torch.device, max_rows: int) -> None:
    """Run the greedy, plain random and filtered variants on random logits, for row counts that hit each
    of Triton's integer specialisations (1, a multiple of 16, any other): measured on the H200, the
    first timed run otherwise compiled them on its first steps (TTFT p50 960 ms against 292 warm)."""
    if device.type != "cuda":
        return
    for rows in sorted({1, min(8, max_rows), min(16, max_rows)}):
        logits = torch.randn(rows, vocab, device=device)
        sampler(logits, SamplingMetadata(None, None, None, None, None, all_greedy=True, need_filter=False))
        for filters in (False, True):
            sampler(logits, dummy_sampling(rows, filters, -1, device))
    torch.cuda.synchronize(device)
