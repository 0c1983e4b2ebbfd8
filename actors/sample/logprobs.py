"""Log-probabilities of sampled and prompt tokens, computed on the device in the step.

As vLLM's default (logprobs_mode="raw_logprobs"), they come from the raw logits' float32 log_softmax:
before penalties, temperature and top-k/top-p. Each position yields 1 + k entries: the position's own
token first (sampled, or the prompt token), then the top-k by logprob; plus the token's rank, vLLM's
count of entries whose logprob is >= the token's (1 = the most likely).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from actors.sample.logprobs_kernel import topk_logprobs
from kvcore.messages import Logprobs, LogprobsBatch

MAX_LOGPROBS = 20


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor  # int32 [N, 1 + k]
    logprobs: torch.Tensor  # float32 [N, 1 + k]
    ranks: torch.Tensor  # int32 [N]

    def to_host(self, non_blocking: bool) -> "LogprobsTensors":
        """Copies on the host (pinned when non_blocking: valid once the step's readback event passed)."""
        if not non_blocking:
            return LogprobsTensors(self.token_ids.cpu(), self.logprobs.cpu(), self.ranks.cpu())
        return LogprobsTensors(
            *(
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for t in (self.token_ids, self.logprobs, self.ranks)
            )
        )

    def to_batch(self, req_ids: list[str] | None = None, ks: np.ndarray | None = None) -> LogprobsBatch:
        """The host copies as one message batch: one numpy copy per field per step, owned by the batch
        (no view of a buffer the runner reuses); req_ids and ks name the rows' requests and their k."""
        return LogprobsBatch(
            self.token_ids.numpy().copy(), self.logprobs.numpy().copy(), self.ranks.numpy().copy(), req_ids, ks
        )


def kernel_runs(device: torch.device, use_triton: bool | None = None) -> bool:
    """The one rule for the sampler's and the logprobs' Triton kernels: use_triton when given, else the
    kernel on CUDA and the torch reference on the CPU, interpreter or not (as a CPU deployment runs; the
    tests hold each kernel to its reference under the interpreter, where a kernel step costs seconds)."""
    return use_triton if use_triton is not None else device.type == "cuda"


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_topk: int, use_triton: bool | None = None
) -> LogprobsTensors:
    """logits [N, V] (raw), token_ids [N] -> the tokens' logprobs and ranks and the top num_topk, by the
    Triton kernel (actors/sample/logprobs_kernel.py) or the torch reference as kernel_runs decides. Sampled and
    prompt logprobs both come through here. Ties in the top-k: the kernel names the lowest token ids,
    torch.topk any of them (the values agree)."""
    if kernel_runs(logits.device, use_triton):
        return LogprobsTensors(*topk_logprobs(logits, token_ids, num_topk))
    return logprobs_reference(logits, token_ids, num_topk)


def logprobs_reference(logits: torch.Tensor, token_ids: torch.Tensor, num_topk: int) -> LogprobsTensors:
    """The torch path: a float32 log_softmax over the vocabulary, a >= count and a topk."""
    lp = logits.float().log_softmax(dim=-1)
    tok = token_ids.to(torch.int64).unsqueeze(1)
    tok_lp = lp.gather(1, tok)
    # Counted straight into int32: a bool tensor's default int64 sum is several times slower on the CPU.
    ranks = (lp >= tok_lp).sum(dim=-1, dtype=torch.int32)
    if num_topk > 0:
        top_lp, top_ids = lp.topk(num_topk, dim=-1)
        ids = torch.cat([tok, top_ids], dim=1)
        lps = torch.cat([tok_lp, top_lp], dim=1)
    else:
        ids, lps = tok, tok_lp
    return LogprobsTensors(ids.to(torch.int32), lps, ranks)


def concat(parts: list[Logprobs]) -> Logprobs:
    """Chunks of one request's positions (the same k) in order, as one."""
    if len(parts) == 1:
        return parts[0]
    return Logprobs(
        np.concatenate([p.token_ids for p in parts]),
        np.concatenate([p.logprobs for p in parts]),
        np.concatenate([p.ranks for p in parts]),
    )


@dataclass
class StepLogprobs:
    """A step's logprobs on their way to the host (copied before the step's readback event).

    sample: one row per sampled row of the step, sample_k[i] the k its request asked (-1: none).
    prompt: the prompt positions computed this step, request by request as in prompt_segments
    (req_id, number of rows, k).
    """

    sample: LogprobsTensors | None = None
    sample_k: np.ndarray | None = None
    prompt: LogprobsTensors | None = None
    prompt_segments: list[tuple[str, int, int]] | None = None
