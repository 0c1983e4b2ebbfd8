"""Which data-parallel replica takes a request: least outstanding requests, with prefix affinity.

The policy of Ray Serve LLM's PrefixCacheAffinityRouter, on token blocks rather than characters:
  - load imbalanced (busiest - idlest outstanding > imbalance_threshold): the least-loaded replica;
  - else the replica whose past prompts share the longest run of leading full blocks with this one,
    when that covers at least MATCH_RATE_THRESHOLD of the prompt (ties: the least loaded);
  - else the least-loaded replica (ties: the one that has seen the fewest blocks, so new prefixes
    spread over the replicas' caches).
Each replica's record is an LRU of chained block hashes, as the engine's prefix cache keys its blocks
(kvcore/kv_cache/hashing.py), bounded by the replica's KV pool: what the pool can no longer hold is forgotten.
Replicas without room (back-pressure) or down are never chosen.
"""

from __future__ import annotations

from collections import OrderedDict

MATCH_RATE_THRESHOLD = 0.1  # Ray Serve LLM's default match_rate_threshold


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chained hash of each full block: block k's hash covers tokens [0, (k+1) * block_size)."""
    out, prev = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash((prev, tuple(token_ids[start : start + block_size])))
        out.append(prev)
    return out


class PrefixAffinityRouter:
    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        max_blocks_per_replica: int,
        imbalance_threshold: int,
        prefix_affinity: bool = True,
    ) -> None:
        self.block_size = block_size
        self.max_blocks = max(1, max_blocks_per_replica)
        self.imbalance_threshold = imbalance_threshold
        self.prefix_affinity = prefix_affinity
        self.seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.num_affinity_routes = 0

    def choose(self, prompt_token_ids: list[int], outstanding: list[int], eligible: list[bool]) -> int | None:
        """The replica for this prompt among the eligible ones (None: no replica can take it)."""
        candidates = [r for r, ok in enumerate(eligible) if ok]
        if not candidates:
            return None
        # Off: plain least outstanding, as EngineGroup.submit spreads `kvray run`'s requests.
        least = min(candidates, key=lambda r: (outstanding[r], len(self.seen[r]) if self.prefix_affinity else 0, r))
        if not self.prefix_affinity or len(candidates) == 1:
            return least
        loads = [outstanding[r] for r in candidates]
        if max(loads) - min(loads) > self.imbalance_threshold:
            return least
        hashes = block_hashes(prompt_token_ids, self.block_size)
        if not hashes:
            return least
        matched = {r: self._match(r, hashes) for r in candidates}
        best = max(matched.values())
        if best * self.block_size < MATCH_RATE_THRESHOLD * len(prompt_token_ids) or best == 0:
            return least
        self.num_affinity_routes += 1
        return min((r for r in candidates if matched[r] == best), key=lambda r: (outstanding[r], r))

    def _match(self, replica: int, hashes: list[int]) -> int:
        seen = self.seen[replica]
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def record(self, replica: int, prompt_token_ids: list[int]) -> None:
        """The replica now holds (or soon will) this prompt's full blocks in its prefix cache."""
        seen = self.seen[replica]
        for h in block_hashes(prompt_token_ids, self.block_size):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)

    def forget(self, replica: int) -> None:
        """A replica restarted or went down: its cache is empty."""
        self.seen[replica].clear()
