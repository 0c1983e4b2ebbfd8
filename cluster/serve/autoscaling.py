"""Ray Serve autoscaling of the engine replicas on the engine requests they hold.

Ray Serve's default policy counts the requests that reach a deployment through Serve; the ingress talks to
the engine drivers directly (each ingress replica through its own outbox), so Serve sees none. Each
engine replica reports its driver's live requests instead (EngineReplica.record_autoscaling_stats, Ray
Serve 2.5x's custom metrics), and this policy asks for total / target_ongoing_requests replicas. Ray Serve
wraps it with the rest of its machinery: min_replicas / max_replicas, upscale_delay_s / downscale_delay_s,
metrics_interval_s and look_back_period_s (the average over the window). Which replica goes on a
scale-down is Ray Serve's choice; it drains before it stops (cluster/serve/engine_replica.py).
"""

from __future__ import annotations

from typing import Any

from actors.config.engine import AutoscalingConfig

OUTSTANDING_METRIC = "kvray_outstanding_requests"
POLICY = "cluster.serve.autoscaling:outstanding_requests_policy"


def outstanding_requests_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Ray Serve's custom policy (ctx: its AutoscalingContext): the replicas that would hold
    target_ongoing_requests each; the current number while no replica has reported yet."""
    metrics = (ctx.aggregated_metrics or {}).get(OUTSTANDING_METRIC) or {}
    target = ctx.config.target_ongoing_requests
    if not metrics or not target:
        return ctx.current_num_replicas, {}
    return sum(metrics.values()) / target, {}


def serve_autoscaling_config(a: AutoscalingConfig, initial_replicas: int) -> dict[str, Any]:
    """serve.autoscaling as Ray Serve's autoscaling_config for the engine replicas' deployment."""
    return {
        "min_replicas": a.min_replicas,
        "max_replicas": a.max_replicas,
        "initial_replicas": min(max(initial_replicas, a.min_replicas), a.max_replicas),
        "target_ongoing_requests": a.target_ongoing_requests,
        "upscale_delay_s": a.upscale_delay_s,
        "downscale_delay_s": a.downscale_delay_s,
        "metrics_interval_s": a.metrics_interval_s,
        "look_back_period_s": a.look_back_period_s,
        "policy": {"policy_function": POLICY},
    }
