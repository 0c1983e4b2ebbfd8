"""The ingress's approximate index of what each engine replica holds in its prefix cache.

Each engine publishes its prefix cache's changes (kvcore/kv_cache/block_pool.py cache events: prefixes
that became findable, prefixes evicted, or a reset with the whole cache) on the poll path; the index
applies them per replica. A prefix is named by `event_key`, 8 bytes of the engine's chained block hash,
so the ingress computes the same names from a prompt's token ids. Between routing a prompt and its
engine's events, the index records the prompt's blocks for the chosen replica itself, so a family's
requests that arrive together go together; the engine's events later confirm or evict them. Bounded per
replica (LRU past twice the replica's KV pool): approximate, never authoritative.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from kvcore.kv_cache.block_pool import CacheEvents, event_key
from kvcore.kv_cache.hashing import compute_block_hashes


def prompt_keys(token_ids: list[int], block_size: int) -> list[int]:
    """The event keys of the prompt's full blocks, in order (the engine's chained hashes, shortened)."""
    return [event_key(h) for h in compute_block_hashes(token_ids, block_size)]


class KVIndex:
    def __init__(self, num_replicas: int, max_blocks_per_replica: int) -> None:
        self.limit = 2 * max(1, max_blocks_per_replica)
        self.held: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def add_replica(self) -> int:
        """A replica joined (a scale-up): -> its index, with nothing cached."""
        self.held.append(OrderedDict())
        return len(self.held) - 1

    def apply(self, replica: int, events: Iterable[CacheEvents]) -> None:
        """One replica's cache events, in the order it took them."""
        held = self.held[replica]
        for ev in events:
            if ev.reset:
                held.clear()
            for k in ev.removed:
                held.pop(k, None)
            for k in ev.stored:
                held[k] = None
                held.move_to_end(k)
        self._trim(held)

    def note_routed(self, replica: int, keys: list[int]) -> None:
        """A prompt went to this replica: its blocks will be cached there (until its events say more)."""
        held = self.held[replica]
        for k in keys:
            held[k] = None
            held.move_to_end(k)
        self._trim(held)

    def match(self, replica: int, keys: list[int]) -> int:
        """How many of the prompt's leading blocks the replica holds (a chained hash: the first miss ends it)."""
        held = self.held[replica]
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n

    def size(self, replica: int) -> int:
        return len(self.held[replica])

    def forget(self, replica: int) -> None:
        """The replica is down or restarted: its cache is gone."""
        self.held[replica].clear()

    def _trim(self, held: OrderedDict[int, None]) -> None:
        while len(held) > self.limit:
            held.popitem(last=False)
