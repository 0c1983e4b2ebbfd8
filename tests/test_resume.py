"""Resumable `kvray run`: a job killed at any point and run again ends with every input answered exactly
once, with the same content as an uninterrupted run (greedy).

Kills: the client process (SIGKILL at random points, two rounds; it is the Ray job's driver, so its
engine actors go with it) and a kill mid-write (a half-written last line, which the rerun cuts off and
answers again). A killed driver actor needs no rerun: the job starts a new driver for the replica,
sends it every request that has no output yet, and finishes with exit 0.
The runs join a local Ray that the test starts (RAY_ADDRESS), so the test can reach their actors."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import ray

from cluster.job.runner import load_done
from cluster.replicas.driver_names import DRIVER_NAME_PREFIX
from cluster.replicas.placement import local_address, start_local_ray

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 24


@pytest.fixture(scope="module")
def ray_address():
    start_local_ray(num_cpus=4, namespace="kvray-test-resume", include_dashboard=False)
    try:
        yield local_address()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def job_input(tmp_path_factory):
    rng = random.Random(5)
    path = tmp_path_factory.mktemp("resume") / "in.jsonl"
    lines = []
    for i in range(N):
        # Short outputs: each run's time is mostly its engine's start; max_num_seqs=2 makes the waves.
        rec = {"max_tokens": rng.randint(4, 20), "ignore_eos": True}
        if i % 3 == 0:
            rec["prompt"] = f"prompt number {i}: " + "abc" * rng.randint(1, 20)
        else:
            rec["prompt_token_ids"] = [rng.randrange(256) for _ in range(rng.randint(3, 60))]
        if i % 5 != 4:  # every fifth line has no id: its id is its line number
            rec["id"] = f"req-{i}"
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return path


def start_run(address, inp, out):
    env = {
        **os.environ,
        "RAY_ADDRESS": address,
        "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("TRITON_INTERPRET", None)
    # max_num_seqs=2 spreads the 24 requests over many waves, so kills land mid-run.
    cmd = [
        sys.executable,
        "-m",
        "cluster.cli",
        "run",
        "--config",
        "configs/local.yaml",
        "--no-progress",
        "--set",
        "scheduler.max_num_seqs=2",
        "--input",
        str(inp),
        "--output",
        str(out),
    ]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_to_end(address, inp, out):
    p = start_run(address, inp, out)
    stdout, stderr = p.communicate(timeout=240)
    assert p.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def count_lines(path):
    return path.read_bytes().count(b"\n") if path.exists() else 0


def wait_for_lines(p, out, n, limit_s=120):
    t0 = time.monotonic()
    while p.poll() is None and count_lines(out) < n and time.monotonic() - t0 < limit_s:
        time.sleep(0.02)


def records(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def check_exactly_once(out, baseline):
    recs = records(out)
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)), f"duplicated ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    assert set(ids) == set(baseline), f"missing: {set(baseline) - set(ids)}"
    for r in recs:
        assert r["error"] is None and r["finish_reason"] == "length", r
        assert r["output_token_ids"] == baseline[r["id"]]["output_token_ids"], r["id"]
        assert r["line"] == baseline[r["id"]]["line"]


@pytest.fixture(scope="module")
def baseline(ray_address, job_input, tmp_path_factory):
    out = tmp_path_factory.mktemp("baseline") / "out.jsonl"
    summary = run_to_end(ray_address, job_input, out)
    assert summary["completed"] == N and summary["errors"] == 0
    recs = {r["id"]: r for r in records(out)}
    assert len(recs) == N and "5" in recs and "req-0" in recs  # line 5 has no id: "5"
    return recs


def test_client_killed_at_random_points_then_rerun_answers_each_id_once(ray_address, job_input, baseline, tmp_path):
    out = tmp_path / "out.jsonl"
    rng = random.Random(11)
    kills = 0
    for _ in range(2):  # each round a fresh client, killed after a random share of what is left
        before = count_lines(out)
        if before >= N:
            break
        p = start_run(ray_address, job_input, out)
        wait_for_lines(p, out, before + rng.randint(1, max(1, (N - before) // 2)))
        time.sleep(rng.uniform(0.0, 0.3))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.communicate(timeout=60)
        done_ids, _ = load_done(str(out))  # (successful keys, error records)
        assert len(done_ids) == count_lines(out)  # whole lines only, no id twice
    assert kills == 2, "a run finished before it could be killed"
    # A kill in the middle of a write: the last record is only half there.
    text = out.read_text()
    kept, last = text.splitlines(keepends=True)[:-1], text.splitlines(keepends=True)[-1]
    out.write_text("".join(kept) + last[: len(last) // 2])
    summary = run_to_end(ray_address, job_input, out)
    assert summary["skipped_already_done"] == len(kept)
    assert summary["completed"] == N - len(kept)
    check_exactly_once(out, baseline)


def test_driver_actor_killed_mid_run_is_replaced_and_the_job_finishes(ray_address, job_input, baseline, tmp_path):
    out = tmp_path / "out.jsonl"
    p = start_run(ray_address, job_input, out)
    wait_for_lines(p, out, N // 3)
    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(DRIVER_NAME_PREFIX)]
    assert len(named) == 1, named
    ray.kill(ray.get_actor(named[0]["name"], namespace=named[0]["namespace"]), no_restart=True)
    stdout, stderr = p.communicate(timeout=240)
    assert p.returncode == 0, stderr[-3000:]
    assert "driver actor of engine replica 0 died" in stderr and "starting a new driver" in stderr, stderr[-3000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["completed"] == N and summary["errors"] == 0 and summary["driver_restarts"] == 1, summary
    check_exactly_once(out, baseline)
