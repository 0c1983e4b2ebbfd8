"""Batched sampling: greedy, temperature, top-k, top-p, one torch.Generator per sampling request.

Every tensor-parallel rank holds the same full-vocabulary logits and the same generators, so every rank
draws the same tokens and no token ever travels between ranks. A random row is sampled with the
exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d. picks i with probability p_i. Only the
noise E is drawn per row (each row from its own generator, so a seeded request's tokens do not depend
on what else is in the batch); everything else is one batched pass.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    """Per-row parameters of the rows to sample (device tensors) and host-side summaries."""

    # The four per-row tensors are None when every row is greedy (all_greedy).
    temperature: torch.Tensor | None   # float32 [N]; ignored on greedy rows
    greedy: torch.Tensor | None        # bool [N]
    top_k: torch.Tensor | None         # int32/int64 [N]; 0 = disabled
    top_p: torch.Tensor | None         # float32 [N]; 1.0 = disabled
    generators: list[torch.Generator | None]  # one per row; None only on greedy rows
    all_greedy: bool                   # host flags: skip work without reading device tensors
    need_top_k: bool
    need_top_p: bool


def request_generator(seed: int | None, engine_seed: int, req_id: str, device: torch.device) -> torch.Generator:
    """The generator of one sampling request: its own seed, else one derived from (engine seed, req_id).

    The derivation uses a stable hash (not Python's per-process `hash`) so every rank builds the same one.
    """
    if seed is None:
        digest = hashlib.blake2b(f"{engine_seed}:{req_id}".encode(), digest_size=8).digest()
        seed = int.from_bytes(digest, "little") & ((1 << 63) - 1)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p (nucleus) set to -inf; one sort for the batch.

    top-p keeps the smallest prefix of the descending order whose probability reaches p (the first
    token is always kept). Ties at the cut-off are broken by the sort order.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.to(torch.int64), torch.full_like(top_k, vocab, dtype=torch.int64))
        drop |= ranks >= k.unsqueeze(1)
    if top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def draw_exponential(shape: torch.Size, generators: list[torch.Generator | None], device: torch.device,
                     rows: list[int]) -> torch.Tensor:
    """Exp(1) noise [N, V]; row r drawn from generators[r] for r in `rows` (the random rows), 1 elsewhere."""
    noise = torch.ones(shape, dtype=torch.float32, device=device)
    for r in rows:
        noise[r].exponential_(generator=generators[r])
    return noise


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """logits float [N, V] -> sampled token ids int64 [N]."""
        logits = logits.float()
        greedy_tokens = logits.argmax(dim=-1)
        if md.all_greedy:
            return greedy_tokens
        # Greedy rows get temperature 1 so the division is harmless; their result is taken from argmax.
        temp = torch.where(md.greedy, torch.ones_like(md.temperature), md.temperature)
        scaled = logits / temp.unsqueeze(1)
        if md.need_top_k or md.need_top_p:
            scaled = apply_top_k_top_p(scaled, md.top_k if md.need_top_k else None,
                                       md.top_p if md.need_top_p else None)
        probs = scaled.softmax(dim=-1)
        random_rows = [i for i, g in enumerate(md.generators) if g is not None]
        noise = draw_exponential(probs.shape, md.generators, probs.device, random_rows)
        random_tokens = (probs / noise).argmax(dim=-1)
        return torch.where(md.greedy, greedy_tokens, random_tokens)
