"""Which data-parallel replica takes a request: the one whose prefix cache holds the longest prefix of
its prompt, unless that replica is overloaded; then the least outstanding.

KV-aware routing across DP replicas: the engines publish what their prefix caches hold (cache events on
the poll path), the ingress keeps an approximate index of it (cluster/serve/kv_index.py). Policy:
  - the replica holding the longest run of the prompt's leading full blocks, when that covers at least
    MATCH_RATE_THRESHOLD of the prompt (ties: the least loaded), unless it holds more than
    imbalance_threshold requests beyond the least-loaded eligible replica (overloaded);
  - else the least-loaded replica (ties: the one holding the fewest cached blocks, so new prefixes
    spread over the replicas' caches).
Replicas without room (back-pressure), down or rebuilding are never chosen. `prefix_affinity` off:
plain least outstanding, as EngineGroup.submit spreads `kvray run`'s requests.
"""

from __future__ import annotations

from cluster.serve.kv_index import KVIndex, prompt_keys
from kvcore.kv_cache.block_pool import CacheEvents

MATCH_RATE_THRESHOLD = 0.1  # Ray Serve LLM's default match_rate_threshold


class KVAwareRouter:
    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        max_blocks_per_replica: int,
        imbalance_threshold: int,
        prefix_affinity: bool = True,
    ) -> None:
        self.block_size = block_size
        self.imbalance_threshold = imbalance_threshold
        self.prefix_affinity = prefix_affinity
        self.index = KVIndex(num_replicas, max_blocks_per_replica)
        self.num_cache_routes = 0  # requests sent where their prefix was cached
        self.num_overloaded = 0  # requests whose cached prefix sat on an overloaded replica

    def choose(self, prompt_token_ids: list[int], outstanding: list[int], eligible: list[bool]) -> int | None:
        """The replica for this prompt among the eligible ones (None: no replica can take it); the index
        then counts the prompt's blocks as that replica's."""
        candidates = [r for r, ok in enumerate(eligible) if ok]
        if not candidates:
            return None
        if not self.prefix_affinity:
            return min(candidates, key=lambda r: (outstanding[r], r))
        index = self.index
        least = min(candidates, key=lambda r: (outstanding[r], index.size(r), r))
        keys = prompt_keys(prompt_token_ids, self.block_size)
        chosen = least
        if keys and len(candidates) > 1:
            matched = {r: index.match(r, keys) for r in candidates}
            best = max(matched.values())
            if best > 0 and best * self.block_size >= MATCH_RATE_THRESHOLD * len(prompt_token_ids):
                holder = min((r for r in candidates if matched[r] == best), key=lambda r: (outstanding[r], r))
                if outstanding[holder] - outstanding[least] > self.imbalance_threshold:
                    self.num_overloaded += 1
                else:
                    self.num_cache_routes += 1
                    chosen = holder
        index.note_routed(chosen, keys)
        return chosen

    def apply(self, replica: int, events: list[CacheEvents]) -> None:
        """A replica's cache events (from its poll)."""
        self.index.apply(replica, events)

    def add_replica(self) -> int:
        """A replica joined: -> its index."""
        return self.index.add_replica()

    def forget(self, replica: int) -> None:
        """A replica restarted or went down: its cache is empty."""
        self.index.forget(replica)
