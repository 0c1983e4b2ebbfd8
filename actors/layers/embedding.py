"""Vocab-parallel embedding and LM head.

The vocabulary is split into equal contiguous ranges, one per rank (padded up to a multiple of the
TP size; padding rows are zero). The embedding looks up the ids that fall in this rank's range and
zeroes the rest, so one all-reduce assembles the full rows. The LM head computes this rank's slice
of the logits and all-gathers them, so every rank ends with the full-vocabulary logits and samples
identically without sending tokens to its peers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from actors import parallel_state as ps
from actors.layers.weight_utils import check_full_shape, copy_into, narrow, new_param


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = ps.tp_rank(), ps.tp_size()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.num_embeddings_padded = self.num_embeddings_per_partition * self.tp_size
        self.vocab_start = min(self.tp_rank * self.num_embeddings_per_partition, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.weight = new_param((self.num_embeddings_per_partition, embedding_dim), params_dtype, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        check_full_shape(loaded, (self.num_embeddings, self.embedding_dim))
        n = self.vocab_end - self.vocab_start
        with torch.no_grad():
            param[n:].zero_()  # padding rows: never looked up, and must give finite (dropped) logits
        if n:
            copy_into(param[:n], narrow(loaded, 0, self.vocab_start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = F.embedding(local_ids, self.weight)
        out = out * in_range.unsqueeze(-1).to(out.dtype)
        return ps.all_reduce(out)

    def logits(self, hidden: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
        """Full-vocabulary logits on every rank, in the model dtype: local GEMM (as HF does), then
        all-gather over the vocab dimension, dropping the padding columns. `softcap` (Gemma) applies
        cap * tanh(logits / cap) in the model dtype, as HF does. No float32 copy: the sampler and the
        logprobs read them as float32 (HF's cast, exact), which a [256, 151,936] cast had cost 105 us a
        step on the H200."""
        local = F.linear(hidden, self.weight)
        full = ps.all_gather(local, dim=-1)[..., : self.num_embeddings]
        if softcap is not None:
            full = torch.tanh(full / softcap) * softcap
        return full


class ParallelLMHead(VocabParallelEmbedding):
    """An untied output projection: same sharding as the embedding, used only through logits()."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)
