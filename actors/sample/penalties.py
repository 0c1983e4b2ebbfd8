"""Per-request token statistics on the device, for the presence, frequency and repetition penalties.

A request with a penalty holds a slot (a row of `counts` and `prompt_mask`) from its first schedule
until it finishes. The slot is keyed by request id, not by batch row, so rows may move freely. Output
counts grow on the device right after each sampling launch (`record`), from the sampled tokens
themselves: nothing is rebuilt from the host per step, and the in-flight token of an async step is
already counted when the next step samples. The arrays grow by doubling, so memory stays proportional
to the penalised requests alive at once (int32 counts + uint8 mask: 5 bytes x vocab per slot).
"""

from __future__ import annotations

import torch


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device, initial_slots: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._capacity = 0
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.uint8, device=device)
        self._slot_of: dict[str, int] = {}
        self._free: list[int] = []
        self._initial = initial_slots

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._slot_of

    def slot(self, req_id: str) -> int:
        return self._slot_of.get(req_id, -1)

    def _grow(self) -> None:
        new_cap = max(self._initial, 2 * self._capacity)
        # The last row is a scratch row: `record` sends the tokens of unpenalised rows there.
        counts = torch.zeros(new_cap + 1, self.vocab_size, dtype=torch.int32, device=self.device)
        mask = torch.zeros(new_cap + 1, self.vocab_size, dtype=torch.uint8, device=self.device)
        counts[: self._capacity] = self.counts[: self._capacity]
        mask[: self._capacity] = self.prompt_mask[: self._capacity]
        self.counts, self.prompt_mask = counts, mask
        self._free.extend(range(new_cap - 1, self._capacity - 1, -1))
        self._capacity = new_cap

    def add(self, req_id: str, prompt_token_ids: list[int], output_token_ids: list[int]) -> int:
        """(Re)build the request's slot from its tokens: on first schedule, and on resumption after a
        preemption (its outputs may have been cut back since the device counted them)."""
        slot = self._slot_of.get(req_id)
        if slot is None:
            if not self._free:
                self._grow()
            slot = self._free.pop()
            self._slot_of[req_id] = slot
        self.counts[slot].zero_()
        self.prompt_mask[slot].zero_()
        if prompt_token_ids:
            ids = torch.tensor(prompt_token_ids, dtype=torch.int64).to(self.device, non_blocking=True)
            self.prompt_mask[slot].index_fill_(0, ids, 1)
        if output_token_ids:
            ids = torch.tensor(output_token_ids, dtype=torch.int64).to(self.device, non_blocking=True)
            self.counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return slot

    def remove(self, req_id: str) -> None:
        slot = self._slot_of.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each row's sampled token in its slot (-1: the scratch row). Device only, no sync."""
        rows = torch.where(slots >= 0, slots.to(torch.int64), self._capacity)
        self.counts.index_put_(
            (rows, tokens.to(torch.int64)), torch.ones_like(rows, dtype=torch.int32), accumulate=True
        )
