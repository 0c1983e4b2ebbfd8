"""The plain-torch sampler: the same tokens as actors/sample/kernel.py from the same Philox stream.

It serves where Triton cannot run (plain CPU, no interpreter) and is the oracle the kernel is tested
against. Philox4x32-10 is computed in int64 arithmetic on 32-bit lanes, with Triton's constants and
its uint32 -> [0, 1) conversion, so the uniforms are bit-identical; tokens match except where two
candidates' scores tie to within the last bit of a `log` (libm and the GPU's may round differently).
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_SCALE = 4.6566127342e-10  # Triton's: the largest s with (2**31 - 1) * s < 1 in float32


def _umulhi(a: int, b: torch.Tensor) -> torch.Tensor:
    """High 32 bits of a * b for a 32-bit constant a and 32-bit lanes b, without int64 overflow."""
    b_lo, b_hi = b & 0xFFFF, b >> 16
    return (a * b_hi + ((a * b_lo) >> 16)) >> 16


def philox_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms [N, vocab] float32: key = seed (64 bits); entry v is lane v & 3 of counter
    (v >> 2, position, 0, 0)."""
    dev = seeds.device
    seeds = seeds.to(torch.int64)
    k0 = (seeds & _M32).unsqueeze(1)
    k1 = ((seeds >> 32) & _M32).unsqueeze(1)
    groups = (vocab + 3) // 4
    c0 = torch.arange(groups, dtype=torch.int64, device=dev).unsqueeze(0).expand(seeds.shape[0], groups)
    c1 = (positions.to(torch.int64) & _M32).unsqueeze(1).expand_as(c0)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(10):
        p0, p2 = c0, c2
        c0 = _umulhi(_ROUND_B, p2) ^ c1 ^ k0
        c2 = _umulhi(_ROUND_A, p0) ^ c3 ^ k1
        c1 = (_ROUND_B * p2) & _M32
        c3 = (_ROUND_A * p0) & _M32
        k0 = (k0 + _KEY_A) & _M32
        k1 = (k1 + _KEY_B) & _M32
    lanes = torch.stack((c0, c1, c2, c3), dim=2).reshape(seeds.shape[0], 4 * groups)[:, :vocab]
    x = torch.where(lanes >= 2**31, lanes - 2**32, lanes)  # each lane as int32
    x = torch.where(x < 0, -x - 1, x)  # ~x
    return x.to(torch.float32) * torch.tensor(_SCALE, dtype=torch.float32, device=dev)


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM's apply_penalties on float32 logits [N, V]; counts [N, V] of output tokens, prompt_mask [N, V]."""
    output_mask = counts > 0
    penalties = torch.where(prompt_mask.bool() | output_mask, repetition.unsqueeze(1), 1.0)
    logits = logits * torch.where(logits > 0, 1.0 / penalties, penalties)
    logits = logits - frequency.unsqueeze(1) * counts.to(logits.dtype)
    return logits - presence.unsqueeze(1) * output_mask.to(logits.dtype)


def top_k_top_p_mask(
    y: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None = None
) -> torch.Tensor:
    """Kept entries (bool [N, V]) of scaled logits y: values >= the k-th largest (0 disables) and, with
    min_p > 0, >= max + log(min_p) (probability >= min_p x the top one); then those whose strictly larger
    kept values hold less than p of the kept probability (ties all kept)."""
    n, vocab = y.shape
    sorted_y, order = y.sort(dim=-1, descending=True)
    k = top_k.to(torch.int64)
    k = torch.where((k <= 0) | (k > vocab), vocab, k)
    keep = y >= sorted_y.gather(1, (k - 1).unsqueeze(1))
    if min_p is not None:
        floor = sorted_y[:, 0] + min_p.float().clamp(min=1e-30).log()
        keep &= (y >= floor.unsqueeze(1)) | (min_p <= 0).unsqueeze(1)
    if bool((top_p < 1).any()):
        m = sorted_y[:, :1]
        kept_sorted = keep.gather(1, order)
        e = torch.where(kept_sorted, (sorted_y - m).exp(), 0.0)
        total = e.sum(dim=1, keepdim=True)
        before = e.cumsum(dim=1) - e
        # Ties share the mass of what is strictly larger: the exclusive sum at their group's first index.
        idx = torch.arange(vocab, device=y.device).expand(n, vocab)
        new_group = torch.ones_like(kept_sorted)
        new_group[:, 1:] = sorted_y[:, 1:] != sorted_y[:, :-1]
        first = torch.where(new_group, idx, 0).cummax(dim=1).values
        ok_sorted = before.gather(1, first) < top_p.unsqueeze(1) * total
        ok = torch.empty_like(ok_sorted).scatter_(1, order, ok_sorted)
        keep &= ok | (top_p >= 1).unsqueeze(1)
    return keep


def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    penalty_slots: torch.Tensor | None = None,
    penalties: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
    ban_ids: torch.Tensor | None = None,
    ban_prev: torch.Tensor | None = None,
    last_tokens: torch.Tensor | None = None,
    logit_rows: torch.Tensor | None = None,
    logit_slots: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """launch_sample's contract (see actors/sample/kernel.py) in plain torch."""
    n, vocab = logits.shape
    x = logits.float()
    if logit_slots is not None:
        assert logit_rows is not None, "sample_reference: logit_slots needs logit_rows"
        has_row = (logit_slots >= 0).unsqueeze(1)
        x = x + torch.where(has_row, logit_rows[logit_slots.clamp(min=0).long()], 0.0)
    if penalty_slots is not None:
        assert penalties is not None and counts is not None and prompt_mask is not None, (
            "sample_reference: penalty_slots needs penalties, counts and prompt_mask"
        )
        has = penalty_slots >= 0
        slots = penalty_slots.clamp(min=0).long()
        c = torch.where(has.unsqueeze(1), counts[slots], 0)
        pm = prompt_mask[slots].bool() & has.unsqueeze(1)
        pen = penalties[:, :n]
        x = torch.where(has.unsqueeze(1), apply_penalties(x, c, pm, pen[0], pen[1], pen[2]), x)
    if ban_ids is not None and ban_ids.numel():
        rows = torch.arange(n, device=x.device).unsqueeze(1).expand_as(ban_ids)
        valid = ban_ids >= 0
        if ban_prev is not None:
            assert last_tokens is not None, "sample_reference: ban_prev needs last_tokens"
            valid &= (ban_prev < 0) | (ban_prev.long() == last_tokens.long().unsqueeze(1))
        x = x.index_put((rows[valid], ban_ids[valid].long()), torch.tensor(float("-inf"), device=x.device))
    greedy = temperature <= 0
    y = x / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    keep = top_k_top_p_mask(y, top_k, top_p, min_p)
    u = philox_uniform(seeds, positions, vocab)
    score = torch.where(keep, y - (-u.log()).log(), float("-inf"))
    return torch.where(greedy, y.argmax(dim=-1), score.argmax(dim=-1))
