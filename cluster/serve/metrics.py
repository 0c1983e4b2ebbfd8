"""`GET /metrics`: the server's own Prometheus metrics and each replica's engine state, as text.

The server side (requests by endpoint and status, 503s, client disconnects, TTFT and end-to-end
latency) is counted here; the engine side (running, waiting, KV-cache usage, prefix-cache hit rate,
worker restarts) is read from each driver's stats() at scrape time. The drivers also export their
own series through Ray's metrics agent (actors/driver/metrics.py); this page needs no agent.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ENGINE_GAUGES = {
    "running": "requests running in the engine",
    "waiting": "requests waiting in the engine",
    "kv_cache_usage": "share of the KV-cache blocks in use",
    "prefix_cache_hit_rate": "prefix-cache hits / queries since start",
    "num_preemptions": "preemptions since start",
    "worker_restarts": "TP-group rebuilds since start",
    "num_output_tokens": "output tokens since start",
}


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvray_serve_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.rejected = Counter("kvray_serve_rejected", "requests refused with 503 (no replica had room)", registry=r)
        self.disconnects = Counter(
            "kvray_serve_client_disconnects", "requests aborted because the client went away", registry=r
        )
        self.output_tokens = Counter("kvray_serve_output_tokens", "output tokens sent", registry=r)
        self.ttft = Histogram(
            "kvray_serve_time_to_first_token_seconds", "arrival to first token", registry=r, buckets=_LATENCY_BUCKETS
        )
        self.e2e = Histogram(
            "kvray_serve_e2e_request_latency_seconds", "arrival to last token", registry=r, buckets=_LATENCY_BUCKETS
        )
        self.outstanding = Gauge(
            "kvray_serve_replica_outstanding_requests",
            "engine requests a replica holds (running + queued)",
            ["replica"],
            registry=r,
        )
        self.replica_up = Gauge("kvray_serve_replica_up", "1 while the replica serves", ["replica"], registry=r)
        self.replicas = Gauge(
            "kvray_serve_replicas",
            "engine replicas this ingress knows, by state: up (takes requests), draining (being removed), down",
            ["state"],
            registry=r,
        )
        self.replica_draining = Gauge(
            "kvray_serve_replica_draining", "1 while the replica is being removed", ["replica"], registry=r
        )
        self.finished = Gauge(
            "kvray_serve_replica_finished_requests",
            "engine requests that finished on the replica",
            ["replica"],
            registry=r,
        )
        self.migrations = Gauge(
            "kvray_serve_migrations",
            "in-flight engine requests this replica could not go on with, moved to another replica",
            ["replica"],
            registry=r,
        )
        self.engine = {k: Gauge(f"kvray_engine_{k}", doc, ["replica"], registry=r) for k, doc in _ENGINE_GAUGES.items()}
        self.cached_share = Gauge(
            "kvray_serve_replica_prompt_cached_share",
            "prompt tokens served from the prefix cache / prompt tokens (finished requests)",
            ["replica"],
            registry=r,
        )

        self.cached_share_all = Gauge(
            "kvray_serve_prompt_cached_share",
            "prompt tokens served from the prefix cache / prompt tokens, all replicas",
            registry=r,
        )

    def render(self, books: list[Any], engine_stats: list[dict[str, Any]]) -> bytes:
        prompt = sum(b.prompt_tokens for b in books)
        self.cached_share_all.set(sum(b.cached_tokens for b in books) / prompt if prompt else 0.0)
        counts = {"up": 0, "draining": 0, "down": 0}
        for r, b in enumerate(books):
            label = str(r)
            state = "down" if b.down else "draining" if b.draining else "up"
            counts[state] += 1
            self.outstanding.labels(label).set(b.outstanding)
            self.replica_up.labels(label).set(0 if b.down else 1)
            self.replica_draining.labels(label).set(1 if state == "draining" else 0)
            self.finished.labels(label).set(b.finished)
            self.migrations.labels(label).set(b.migrated_away)
            self.cached_share.labels(label).set(b.cached_tokens / b.prompt_tokens if b.prompt_tokens else 0.0)
        for state, n in counts.items():
            self.replicas.labels(state).set(n)
        for s in engine_stats:
            for k, g in self.engine.items():
                v = s.get(k)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    g.labels(str(s["replica"])).set(float(v))
        return generate_latest(self.registry)
