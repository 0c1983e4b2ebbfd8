"""Per-request additive logit rows on the device: vLLM's logit_bias, allowed_token_ids and one-token bad words.

A request that uses any of them holds a slot (a float32 row over the vocabulary) from its first
schedule until it finishes, keyed by request id so rows of the batch may move freely: 0 where nothing
applies, the bias where logit_bias names the token, -inf outside allowed_token_ids and at a one-token
bad word (vLLM masks before it adds the bias: -inf stays -inf). The sample kernel adds the row to the
logits as it reads them (actors/sample/kernel_ops.py), one coalesced load per tile, so a request's
thousand biased or allowed ids cost the same per step as one. The row is built once, on the device,
when the request arrives: no per-step host work. Memory grows by doubling with the requests using it
at once (4 bytes x vocabulary a slot). Longer bad words depend on the output and are banned per step
(actors/sample/inputs.py).
"""

from __future__ import annotations

import torch

from kvcore.request import SamplingParams


class LogitRows:
    def __init__(self, vocab_size: int, device: torch.device, initial_slots: int = 4) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._capacity = 0
        self.rows = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self._slot_of: dict[str, int] = {}
        self._free: list[int] = []
        self._initial = initial_slots

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._slot_of

    def slot(self, req_id: str) -> int:
        return self._slot_of.get(req_id, -1)

    def _grow(self) -> None:
        new_cap = max(self._initial, 2 * self._capacity)
        rows = torch.zeros(new_cap, self.vocab_size, dtype=torch.float32, device=self.device)
        rows[: self._capacity] = self.rows[: self._capacity]
        self.rows = rows
        self._free.extend(range(new_cap - 1, self._capacity - 1, -1))
        self._capacity = new_cap

    def add(self, req_id: str, sp: SamplingParams) -> int:
        """The request's slot with its row built, or -1 when it needs none."""
        if not sp.has_logit_row:
            return -1
        slot = self._slot_of.get(req_id)
        if slot is None:
            if not self._free:
                self._grow()
            slot = self._free.pop()
            self._slot_of[req_id] = slot
        row = self.rows[slot]
        if sp.allowed_token_ids is not None:
            row.fill_(float("-inf"))
            row.index_fill_(0, self._ids(sp.allowed_token_ids), 0.0)
        else:
            row.zero_()
        single = [seq[0] for seq in sp.bad_words_token_ids or () if len(seq) == 1]
        if single:
            row.index_fill_(0, self._ids(single), float("-inf"))
        if sp.logit_bias:
            ids = [t for t in sp.logit_bias if t < self.vocab_size]
            bias = torch.tensor([sp.logit_bias[t] for t in ids], dtype=torch.float32)
            row.index_add_(0, self._ids(ids), bias.to(self.device, non_blocking=True))
        return slot

    def _ids(self, ids: list[int]) -> torch.Tensor:
        # The engine refuses ids outside the vocabulary (kvcore.request.check_vocab_fields); a row never
        # indexes past it even so.
        kept = [t for t in ids if 0 <= t < self.vocab_size]
        return torch.tensor(kept, dtype=torch.int64).to(self.device, non_blocking=True)

    def clear(self) -> None:
        """Forget every request (the runner's reset after a failed step); the memory stays for reuse."""
        self._slot_of.clear()
        self._free = list(range(self._capacity - 1, -1, -1))

    def remove(self, req_id: str) -> None:
        slot = self._slot_of.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)
