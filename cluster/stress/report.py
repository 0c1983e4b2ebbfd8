"""The stress run's verdict: the end checks turned into one JSON report, and the optional PNG
(latency CDF; KV usage and running requests over time, kill times marked)."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray

from cluster.job.runner import percentile
from cluster.stress.workload import StressRequest

log = logging.getLogger("kvray.stress")

POOL_IDLE_WAIT_S = 15.0


def pool_accounting(engines: Any) -> list[dict[str, Any]]:
    """Every replica's block-pool books, read once its engine has drained (or the wait ran out)."""
    deadline = time.monotonic() + POOL_IDLE_WAIT_S
    while True:
        books = []
        for r, d in enumerate(engines.drivers):
            try:
                books.append(ray.get(d.kv_pool_accounting.remote(), timeout=30))
            except ray.exceptions.RayError as e:  # a dead or stuck driver: its pool cannot be vouched for
                books.append({"replica": r, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"})
        if all(b.get("idle") or "error" in b for b in books) or time.monotonic() > deadline:
            for b in books:
                if b.get("busy"):
                    b["error"] = "its step loop stayed busy: the books could not be read"
            return books
        time.sleep(0.2)


def leaked_blocks(book: dict[str, Any]) -> int:
    """Blocks still held after the drain, plus any the books cannot account for."""
    if "error" in book:
        return 0
    unaccounted = book["usable_blocks"] - book["free_uncached"] - book["cached_free"] - book["held"]
    return book["held"] + abs(unaccounted)


def evaluate(
    workload: list[StressRequest],
    obs: Any,
    reference: dict[str, list[int]],
    pools: list[dict[str, Any]],
    engine_stats: list[dict[str, Any]],
    kills_asked: int,
    nodes_asked: int = 0,
) -> dict[str, Any]:
    c = {
        "completed": 0,
        "aborted": 0,
        "lost": 0,
        "duplicated": obs.unknown_outputs,
        "mismatched": 0,
        "wrong_token_count": 0,
    }
    latencies: list[float] = []
    errors: list[str] = []
    output_tokens = 0
    for r in workload:
        o = obs.outcomes[r.request_id]
        ref = reference[r.request_id]
        output_tokens += len(o.tokens)
        c["duplicated"] += max(0, o.num_finished - 1) + o.late_outputs
        if o.num_finished == 0 or o.finish_reason == "error" or (o.finish_reason == "abort" and not o.abort_sent):
            c["lost"] += 1
            if o.error and len(errors) < 3:
                errors.append(f"{r.request_id}: {o.error}")
        elif o.finish_reason == "abort":
            c["aborted"] += 1
            c["mismatched"] += o.tokens != ref[: len(o.tokens)]
        else:
            c["completed"] += 1
            latencies.append(o.finished_at - o.submitted_at)
            want = r.sampling.max_tokens if r.sampling.ignore_eos else len(ref)
            if len(o.tokens) != len(ref) or len(o.tokens) != want:
                c["wrong_token_count"] += 1
            elif o.tokens != ref:
                c["mismatched"] += 1
    restarts = sum(int(s.get("worker_restarts", 0)) for s in engine_stats)
    fatal = [s["fatal"] for s in engine_stats if s.get("fatal")] + ([obs.failure] if obs.failure else [])
    report = {
        "requests": len(workload),
        **{k: c[k] for k in ("completed", "aborted", "lost", "duplicated", "mismatched")},
        "leaked_blocks": sum(leaked_blocks(b) for b in pools),
        "worker_restarts": restarts,
        "preemptions": sum(int(s.get("num_preemptions", 0)) for s in engine_stats),
        "latency_p50_s": _round(percentile(latencies, 50)),
        "latency_p99_s": _round(percentile(latencies, 99)),
        "output_tok_per_s": round(output_tokens / obs.wall_s, 2) if obs.wall_s > 0 else None,
        "wrong_token_count": c["wrong_token_count"],
        "replayed_after_restart": sum(int(s.get("num_replayed", 0)) for s in engine_stats),
        "kills": len(obs.kills),
        "kill_times_s": [k["t"] for k in obs.kills],
        # A lost node costs each replica with a bundle on it one TP-group rebuild.
        "node_losses": len(obs.node_kills),
        "node_loss_times_s": [k["t"] for k in obs.node_kills],
        "replicas_hit_by_node_losses": sum(len(k["replicas"]) for k in obs.node_kills),
        "requests_moved": sum(int(s.get("requests_moved_away", 0)) for s in engine_stats),
        "driver_restarts": sum(int(s.get("driver_restarts", 0)) for s in engine_stats),
        "wall_s": round(obs.wall_s, 2),
        "pool_errors": [
            b.get("error") or b.get("invariant_error") for b in pools if b.get("error") or b.get("invariant_error")
        ],
        "errors": errors,
        "fatal": fatal,
    }
    report["checks_failed"] = failed_checks(report, kills_asked, obs.stalled, nodes_asked)
    report["_latencies"] = latencies
    return report


def failed_checks(rep: dict[str, Any], kills_asked: int, stalled: bool, nodes_asked: int = 0) -> list[str]:
    rules = [
        ("lost", rep["lost"] == 0),
        ("duplicated", rep["duplicated"] == 0),
        ("mismatched", rep["mismatched"] == 0),
        ("wrong_token_count", rep["wrong_token_count"] == 0),
        ("completed+aborted==requests", rep["completed"] + rep["aborted"] == rep["requests"]),
        ("leaked_blocks", rep["leaked_blocks"] == 0),
        ("pool_invariants", not rep["pool_errors"]),
        ("replica_down", not rep["fatal"]),
        ("stalled", not stalled),
        ("kills_done", rep["kills"] == kills_asked),
        ("node_losses_done", rep.get("node_losses", 0) == nodes_asked),
        ("worker_restarts==kills", rep["worker_restarts"] == rep["kills"] + rep.get("replicas_hit_by_node_losses", 0)),
    ]
    return [name for name, ok in rules if not ok]


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def write_png(report_dir: str, obs: Any, report: dict[str, Any]) -> str:
    """Latency CDF; KV usage and running requests per replica over time, kills as red lines."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--report needs matplotlib: pip install 'matplotlib>=3.6'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(report_dir, exist_ok=True)
    fig, (ax_cdf, ax_kv, ax_run) = plt.subplots(3, 1, figsize=(9, 11))
    lat = sorted(report["_latencies"])
    ax_cdf.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))] if lat else [], drawstyle="steps-post")
    ax_cdf.set(
        title=f"latency CDF ({len(lat)} completed requests)",
        xlabel="seconds from submit to finish",
        ylabel="share of requests",
    )
    replicas = sorted({s["replica"] for s in obs.timeline})
    for rep in replicas:
        pts = [s for s in obs.timeline if s["replica"] == rep]
        ax_kv.plot([s["t"] for s in pts], [s["kv_usage"] for s in pts], label=f"replica {rep}")
        ax_run.plot([s["t"] for s in pts], [s["running"] for s in pts], label=f"replica {rep}")
    ax_kv.set(title="KV-cache usage", xlabel="seconds", ylabel="share of blocks held", ylim=(0, 1.05))
    ax_run.set(title="running requests", xlabel="seconds", ylabel="requests")
    for ax in (ax_kv, ax_run):
        for i, t in enumerate(obs.kill_times):
            ax.axvline(t, color="red", linestyle="--", label="worker killed" if i == 0 else None)
        if replicas or obs.kill_times:
            ax.legend(loc="upper right")
    fig.suptitle(
        f"kvray stress: {report['requests']} requests, {report['kills']} kills, "
        f"{report['preemptions']} preemptions, checks failed: {report['checks_failed'] or 'none'}"
    )
    fig.tight_layout()
    path = os.path.join(report_dir, "stress.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
