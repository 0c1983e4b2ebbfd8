"""`kvray stress` at CI size (configs/stress-local.yaml: 2 replicas, a tiny KV pool, 100 requests, 2 worker
kills; the pool is tight enough that 100 requests preempt as 200 did, in half the time): every end check
passes, the JSON report is the last line, and the PNG is written. Also: the verdict itself counts lost,
duplicated and mismatched requests and leaked blocks (no Ray needed), and a kill count past the restart
budget is refused before anything starts."""

import json
import os
import subprocess
import sys
import time

from cluster.stress.report import evaluate
from cluster.stress.run import Observed, Outcome
from cluster.stress.workload import WorkloadShape, make_workload, max_total_tokens
from kvcore.request import SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kvray(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)  # the CPU engine uses torch attention; nothing to interpret
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_stress_local_passes_every_check_with_two_kills(tmp_path):
    t0 = time.monotonic()
    r = kvray(
        "stress",
        "--config",
        "configs/stress-local.yaml",
        "--requests",
        "100",
        "--kill-workers",
        "2",
        "--abort-rate",
        "0.1",
        "--seed",
        "0",
        "--report",
        str(tmp_path),
    )
    elapsed = time.monotonic() - t0
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert lines, r.stderr[-4000:]
    report = json.loads(lines[-1])
    assert r.returncode == 0, (report, r.stderr[-4000:])
    assert report["checks_failed"] == [], report
    assert report["requests"] == 100
    assert report["lost"] == 0 and report["duplicated"] == 0 and report["mismatched"] == 0, report
    assert report["leaked_blocks"] == 0 and report["pool_errors"] == [], report
    assert report["worker_restarts"] == 2 and report["kills"] == 2, report
    assert report["completed"] + report["aborted"] == report["requests"], report
    assert report["aborted"] > 0, report  # some aborts really landed mid-flight
    assert report["preemptions"] > 0, report  # the pool is tight enough to preempt
    for key in ("latency_p50_s", "latency_p99_s", "output_tok_per_s"):
        assert isinstance(report[key], float) and report[key] > 0, (key, report)
    png = tmp_path / "stress.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"stress run: {elapsed:.1f}s, {report}")


def test_stress_with_async_scheduling_recovers_from_kills():
    """With async scheduling the workers hold one step's output when they die: the requests of that
    step are re-queued like any other in-flight request, and every end check still passes. 60 requests:
    both kills still land while each replica has requests in flight (the kill rule waits for that)."""
    r = kvray(
        "stress",
        "--config",
        "configs/stress-local.yaml",
        "--set",
        "scheduler.async_scheduling=true",
        "--requests",
        "60",
        "--kill-workers",
        "2",
        "--abort-rate",
        "0.1",
        "--seed",
        "1",
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert lines, r.stderr[-4000:]
    report = json.loads(lines[-1])
    assert r.returncode == 0 and report["checks_failed"] == [], (report, r.stderr[-4000:])
    assert report["lost"] == 0 and report["duplicated"] == 0 and report["mismatched"] == 0, report
    assert report["worker_restarts"] == 2 and report["leaked_blocks"] == 0, report


def test_kill_count_past_the_restart_budget_is_refused_at_once(capsys):
    """In this process (no interpreter start): refused before Ray or an engine starts."""
    import ray

    from cluster.cli import main as kvray_main

    assert kvray_main(["stress", "--config", "configs/stress-local.yaml", "--kill-workers", "9"]) == 2
    err = capsys.readouterr().err
    assert "--kill-workers=9: exceeds the restart budget" in err
    assert "parallel.max_worker_restarts=4" in err
    assert not ray.is_initialized()


def test_workload_respects_the_limits_and_mixes_everything():
    shape = WorkloadShape(vocab_size=260, max_total_tokens=max_total_tokens(512, 39, 16, 2), eos_token_id=256)
    assert shape.max_total_tokens == 288  # 39 usable blocks over 2 groups, one spare each: 18 x 16
    wl = make_workload(400, 7, shape, abort_rate=0.2, duration_s=5.0)
    assert wl == make_workload(400, 7, shape, abort_rate=0.2, duration_s=5.0)  # one seed, one workload
    assert all(len(r.prompt_token_ids) + r.sampling.max_tokens <= 288 for r in wl)
    assert all(256 not in r.prompt_token_ids and r.prompt_token_ids for r in wl)
    assert 0.1 < sum(r.abort_after is not None for r in wl) / len(wl) < 0.3
    assert {r.sampling.greedy for r in wl} == {True, False}
    assert all(r.sampling.seed is not None for r in wl if not r.sampling.greedy)
    lens = sorted(r.sampling.max_tokens for r in wl)
    assert lens[-1] > 4 * lens[len(lens) // 2]  # long-tailed
    fam = [r for r in wl if r.family is not None]
    assert len(fam) > len(wl) // 2 and len({r.family for r in fam}) >= 2
    assert all(0 <= r.arrival_s <= 5.0 for r in wl) and wl[-1].arrival_s > 2.5


def test_the_verdict_counts_each_kind_of_failure():
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    wl = make_workload(6, 0, WorkloadShape(260, 64))
    for r in wl:
        r.sampling, r.abort_after = greedy, None
    ref = {r.request_id: [1, 2, 3] for r in wl}
    outcomes = {
        "stress-0": Outcome([1, 2, 3], 0.0, 1.0, "length", num_finished=1),  # fine
        "stress-1": Outcome([1, 2, 3], 0.0, 1.0, "length", num_finished=2),  # finished twice
        "stress-2": Outcome([1, 2], 0.0, None, None),  # never finished: lost
        "stress-3": Outcome([1, 9, 3], 0.0, 1.0, "length", num_finished=1),  # wrong tokens
        "stress-4": Outcome([1], 0.0, 1.0, "abort", num_finished=1, abort_sent=True),  # a fine abort
        "stress-5": Outcome([1, 2], 0.0, 1.0, "length", num_finished=1),  # one token short
    }
    obs = Observed(outcomes, wall_s=2.0)
    pools = [
        {
            "replica": 0,
            "usable_blocks": 10,
            "free_uncached": 5,
            "cached_free": 3,
            "held": 1,
            "ref_count_total": 1,
            "idle": True,
            "invariant_error": None,
        }
    ]
    stats = [{"worker_restarts": 1, "num_preemptions": 4, "fatal": None}]
    rep = evaluate(wl, obs, ref, pools, stats, kills_asked=1)
    assert (rep["completed"], rep["aborted"], rep["lost"], rep["duplicated"]) == (4, 1, 1, 1)
    assert rep["mismatched"] == 1 and rep["wrong_token_count"] == 1
    assert rep["leaked_blocks"] == 2  # one held, one missing from the books
    assert set(rep["checks_failed"]) == {
        "lost",
        "duplicated",
        "mismatched",
        "wrong_token_count",
        "completed+aborted==requests",
        "leaked_blocks",
        "kills_done",
        "worker_restarts==kills",
    }
    assert rep["preemptions"] == 4 and rep["latency_p50_s"] == 1.0


def test_the_verdict_counts_node_losses():
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    wl = make_workload(2, 0, WorkloadShape(260, 64))
    for r in wl:
        r.sampling, r.abort_after = greedy, None
    ref = {r.request_id: [1, 2, 3] for r in wl}
    outcomes = {r.request_id: Outcome([1, 2, 3], 0.0, 1.0, "length", num_finished=1) for r in wl}
    # One lost node held bundles of both replicas: each rebuilt once; three requests moved meanwhile.
    obs = Observed(outcomes, wall_s=1.0, node_kills=[{"t": 0.5, "node": "n1", "replicas": [0, 1]}])
    pools = [
        {
            "replica": r,
            "usable_blocks": 10,
            "free_uncached": 10,
            "cached_free": 0,
            "held": 0,
            "ref_count_total": 0,
            "idle": True,
            "invariant_error": None,
        }
        for r in range(2)
    ]
    stats = [{"worker_restarts": 1, "fatal": None}, {"worker_restarts": 1, "fatal": None, "requests_moved_away": 3}]
    rep = evaluate(wl, obs, ref, pools, stats, kills_asked=0, nodes_asked=1)
    assert (rep["node_losses"], rep["replicas_hit_by_node_losses"], rep["requests_moved"]) == (1, 2, 3)
    assert rep["checks_failed"] == [], rep["checks_failed"]
    assert "node_losses_done" in evaluate(wl, obs, ref, pools, stats, kills_asked=0, nodes_asked=2)["checks_failed"]
