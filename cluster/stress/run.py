"""`kvray stress`: drive every data-parallel replica at once with a hostile workload, kill worker actors
at random times, then check that nothing was lost, duplicated or corrupted, and that every KV pool is
whole again.

The workload (cluster/stress/workload.py) has long-tailed lengths, prompt families sharing long prefixes,
greedy and seeded sampling and mid-flight aborts; the config's pool is meant to be small enough that
preemption never stops. The run turns on the scheduler's per-step invariant checks (a broken invariant
takes the replica down, so it shows up as lost requests and a `fatal` entry).

Checks at the end (any failure -> exit code 1):
  1. every request ends exactly once; a completed one with the reference's token count;
  2. every output (an aborted one: the part received) equals the reference: each request run alone on
     a roomy engine without prefix caching (in one batch: a request's tokens never depend on its
     neighbours, the sampler draws per request);
  3. every replica's block pool is whole: free + cached-free = usable, no reference count left;
  4. no replica went down (a broken per-step invariant does that), and every kill was recovered.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.messages import RequestSpec
from cluster.client.stream import Stalled, Stream
from cluster.config import EngineConfig
from cluster.replicas.engine_group import EngineFailure, EngineGroup
from cluster.stress.workload import StressRequest, WorkloadShape, make_workload, max_total_tokens
from kvcore.messages import EngineCoreOutput

log = logging.getLogger("kvray.stress")

STATS_PERIOD_S = 0.25


@dataclass
class StressOptions:
    requests: int = 200
    duration_s: float = 0.0
    kill_workers: int = 0
    kill_nodes: int = 0
    abort_rate: float = 0.1
    seed: int = 0
    report_dir: str | None = None


@dataclass
class Outcome:
    """What the client saw of one request."""

    tokens: list[int] = field(default_factory=list)
    submitted_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_finished: int = 0  # > 1 is a duplicate
    late_outputs: int = 0  # outputs after its end: a duplicate too
    abort_sent: bool = False


@dataclass
class Observed:
    """Everything the run recorded, for the checks and the report."""

    outcomes: dict[str, Outcome]
    unknown_outputs: int = 0
    kill_times: list[float] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    node_kills: list[dict[str, Any]] = field(default_factory=list)  # {"t", "node", "replicas"}
    timeline: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    stalled: bool = False
    failure: str | None = None


class StatsSampler(threading.Thread):
    """Polls every driver's stats: KV usage and running requests over time, for the report."""

    def __init__(self, drivers: list[Any], t0: float) -> None:
        super().__init__(name="kvray-stress-stats", daemon=True)
        self.drivers, self.t0 = drivers, t0
        self.samples: list[dict[str, Any]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(STATS_PERIOD_S):
            try:
                stats = ray.get([d.stats.remote() for d in self.drivers], timeout=10)
            except ray.exceptions.RayError as e:  # a dead or stuck driver ends the series, not the run
                log.debug("stats: %s", e)
                continue
            t = time.monotonic() - self.t0
            for s in stats:
                self.samples.append(
                    {
                        "t": t,
                        "replica": s.get("replica"),
                        "kv_usage": s.get("kv_cache_usage", 0.0),
                        "running": s.get("running", 0),
                        "waiting": s.get("waiting", 0),
                    }
                )

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=15)


class StressDriver(Stream):
    """Submits on schedule, streams outputs, sends aborts and kills, until every request has ended."""

    poll_s = 0.2

    def __init__(
        self, engines: EngineGroup, workload: list[StressRequest], opts: StressOptions, config: EngineConfig
    ) -> None:
        super().__init__(engines)
        self.workload = workload
        self.config = config
        self.rng = random.Random(opts.seed + 1)
        self.obs = Observed({r.request_id: Outcome() for r in workload})
        n = len(workload)
        # Kill when a random share of the requests has ended: a random time while work is in flight.
        self.kill_at = sorted(int(self.rng.uniform(0.1, 0.7) * n) for _ in range(opts.kill_workers))
        self.kills_on: Counter[int] = Counter()
        self.node_kill_at = sorted(int(self.rng.uniform(0.1, 0.7) * n) for _ in range(opts.kill_nodes))
        self.stall_s = max(120.0, 2 * config.parallel.step_timeout_s)
        self.queue: list[StressRequest] = []
        self.t0 = 0.0
        self.submitted = 0
        self.ended = 0

    def run(self) -> Observed:
        self.t0 = time.monotonic()
        self.queue = list(self.workload)
        sampler = StatsSampler(self.engines.drivers, self.t0)
        sampler.start()
        try:
            self.loop()
        except Stalled as e:
            log.error("%s: giving up", e)
            self.obs.stalled = True
        except EngineFailure as e:
            self.obs.failure = str(e)
        finally:
            sampler.stop()
            self.obs.wall_s = time.monotonic() - self.t0
            self.obs.timeline = sampler.samples
        return self.obs

    # ---- the stream's hooks (cluster/client/stream.py) ------------------------------------------------------
    def due(self) -> list[RequestSpec] | None:
        if not self.queue:
            return None
        now = time.monotonic()
        due = [r for r in self.queue if r.arrival_s <= now - self.t0]
        self.queue = self.queue[len(due) :]
        for r in due:
            self.obs.outcomes[r.request_id].submitted_at = now
        self.submitted += len(due)
        return [RequestSpec(r.request_id, list(r.prompt_token_ids), r.sampling) for r in due]

    def in_flight(self) -> int:
        return self.submitted - self.ended

    def refused(self, errors: dict[str, str]) -> None:
        now = time.monotonic()
        for rid, err in errors.items():
            o = self.obs.outcomes[rid]
            o.num_finished, o.finish_reason, o.error, o.finished_at = 1, "error", err, now
            self.ended += 1

    def take(self, out: EngineCoreOutput) -> None:
        o = self.obs.outcomes.get(out.request_id)
        if o is None:
            self.obs.unknown_outputs += 1
            return
        if o.num_finished:
            o.late_outputs += 0 if out.finished else 1
        else:
            o.tokens.extend(out.new_token_ids)
        if out.finished:
            o.num_finished += 1
            if o.num_finished == 1:
                o.finished_at, o.finish_reason, o.error = time.monotonic(), out.finish_reason, out.error
                self.ended += 1

    def aborts(self) -> list[str]:
        todo = [
            r.request_id
            for r in self.workload
            if r.abort_after is not None
            and not self.obs.outcomes[r.request_id].abort_sent
            and self.obs.outcomes[r.request_id].submitted_at is not None
            and not self.obs.outcomes[r.request_id].num_finished
            and len(self.obs.outcomes[r.request_id].tokens) >= r.abort_after
        ]
        for rid in todo:
            self.obs.outcomes[rid].abort_sent = True
        return todo

    def between_polls(self) -> None:
        self._maybe_kill(self.ended, self.t0)
        self._maybe_kill_node(self.ended, self.t0)

    def _maybe_kill(self, ended: int, t0: float) -> None:
        if not self.kill_at or ended < self.kill_at[0]:
            return
        budget = self.config.parallel.max_worker_restarts
        stats = self.engines.stats()
        # A replica with work in flight (so the death is noticed at its next step), budget left, and
        # its previous restart done (a kill during a rebuild would hit the old, already dead group).
        ok = [
            r
            for r, s in enumerate(stats)
            if self.engines.outstanding[r] > 2
            and self.kills_on[r] < budget
            and int(s.get("worker_restarts", 0)) == self.kills_on[r]
            and s.get("fatal") is None
        ]
        if not ok:
            return
        replica = self.rng.choice(ok)
        rank = self.rng.randrange(self.config.parallel.ranks_per_engine)  # any stage's ranks
        try:
            ray.get(self.engines.drivers[replica].kill_worker.remote(rank), timeout=30)
        except ray.exceptions.RayError as e:  # the group is being rebuilt right now: try again soon
            log.info("kill of replica %d rank %d deferred: %s", replica, rank, str(e).splitlines()[0])
            return
        t = time.monotonic() - t0
        log.warning(
            "stress: killed worker rank %d of replica %d at t=%.1fs (%d requests ended)", rank, replica, t, ended
        )
        self.kill_at.pop(0)
        self.kills_on[replica] += 1
        self.obs.kill_times.append(t)
        self.obs.kills.append({"t": round(t, 3), "replica": replica, "rank": rank})

    def _maybe_kill_node(self, ended: int, t0: float) -> None:
        if not self.node_kill_at or ended < self.node_kill_at[0]:
            return
        from cluster.stress.node_kill import engine_nodes, kill_node

        budget = self.config.parallel.max_worker_restarts
        stats = self.engines.stats()
        me = ray.get_runtime_context().get_node_id()
        # A node whose replicas are all up with work in flight and restart budget left.
        ok = [
            (node, reps)
            for node, reps in sorted(engine_nodes(self.engines.pgs).items())
            if node != me
            and all(
                self.engines.state[r] == "up"
                and self.engines.outstanding[r] > 0
                and int(stats[r].get("worker_restarts", 0)) < budget
                for r in reps
            )
        ]
        if not ok:
            return
        node, reps = self.rng.choice(ok)
        kill_node(node)
        t = time.monotonic() - t0
        log.warning("stress: killed node %s (replica(s) %s) at t=%.1fs (%d requests ended)", node[:12], reps, t, ended)
        self.node_kill_at.pop(0)
        self.obs.kill_times.append(t)
        self.obs.node_kills.append({"t": round(t, 3), "node": node, "replicas": reps})


# ---- the whole command --------------------------------------------------------------------------------
def check_options(config: EngineConfig, opts: StressOptions) -> None:
    """Raise ValueError naming the option and the rule; runs before Ray is touched."""
    p = config.parallel
    rules = [
        ("--requests", opts.requests, opts.requests >= 1, "must be >= 1"),
        ("--duration", opts.duration_s, opts.duration_s >= 0, "must be >= 0 seconds"),
        ("--abort-rate", opts.abort_rate, 0.0 <= opts.abort_rate <= 1.0, "must be in [0, 1]"),
        ("--kill-workers", opts.kill_workers, opts.kill_workers >= 0, "must be >= 0"),
        (
            "--kill-workers",
            opts.kill_workers,
            opts.kill_workers <= p.max_worker_restarts * p.data_parallel_size,
            f"exceeds the restart budget, parallel.max_worker_restarts={p.max_worker_restarts} per replica x "
            f"{p.data_parallel_size} replica(s); raise it with --set parallel.max_worker_restarts=N",
        ),
        ("--kill-nodes", opts.kill_nodes, opts.kill_nodes >= 0, "must be >= 0"),
        (
            "--kill-nodes",
            opts.kill_nodes,
            opts.kill_nodes == 0 or p.max_worker_restarts >= 1,
            "needs parallel.max_worker_restarts >= 1: a replica rebuilds after its node is lost",
        ),
    ]
    for name, value, ok, rule in rules:
        if not ok:
            raise ValueError(f"{name}={value}: {rule}")


def run_stress(config: EngineConfig, opts: StressOptions) -> tuple[dict[str, Any], int]:
    """-> (the report, exit code). Ray is connected by the caller."""
    from cluster.stress.reference import reference_config, run_reference
    from cluster.stress.report import evaluate, pool_accounting, write_png

    check_options(config, opts)
    p = config.parallel
    config = config.replace(debug_invariants=True)
    engines = EngineGroup(config)
    try:
        info, stats0 = engines.info, engines.stats()[0]
        shape = WorkloadShape(
            int(info["vocab_size"]),
            max_total_tokens(
                int(info["max_model_len"]),
                int(info["num_blocks"]) - 1,
                config.cache.block_size,
                int(stats0.get("num_kv_cache_groups", 1)),
            ),
            info.get("eos_token_id"),
        )
        workload = make_workload(opts.requests, opts.seed, shape, opts.abort_rate, opts.duration_s)
        log.info(
            "stress: %d requests over %d replica(s), %d kill(s), pool of %d blocks, longest request %d tokens",
            len(workload),
            p.data_parallel_size,
            opts.kill_workers,
            info["num_blocks"],
            shape.max_total_tokens,
        )
        obs = StressDriver(engines, workload, opts, config).run()
        pools = pool_accounting(engines)
        engine_stats = engines.stats()
    finally:
        engines.shutdown()
    t_ref = time.monotonic()
    reference = run_reference(
        reference_config(config, workload, config.cache.block_size, int(stats0.get("num_kv_cache_groups", 1))), workload
    )
    report = evaluate(workload, obs, reference, pools, engine_stats, opts.kill_workers, opts.kill_nodes)
    report["reference_wall_s"] = round(time.monotonic() - t_ref, 2)
    if opts.report_dir:
        report["png"] = write_png(opts.report_dir, obs, report)
    report.pop("_latencies")
    return report, 0 if not report["checks_failed"] else 1
