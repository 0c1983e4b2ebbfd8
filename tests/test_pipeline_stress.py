"""`kvray stress` with two pipeline stages per replica (configs/stress-local.yaml, PP=2): worker kills pick any
rank of either stage, and every end check passes (nothing lost, duplicated or mismatched, no leaked
blocks) with the engine's group rebuilt after each kill; also with async scheduling, where a kill loses the
output the workers held for the lagging step."""

import json

import pytest
from test_stress import kvray


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
def test_stress_with_two_stages_survives_worker_kills(tmp_path, async_on):
    r = kvray(
        "stress",
        "--config",
        "configs/stress-local.yaml",
        "--set",
        "parallel.pipeline_parallel_size=2",
        "--set",
        f"scheduler.async_scheduling={'true' if async_on else 'false'}",
        "--requests",
        "60",
        "--kill-workers",
        "2",
        "--abort-rate",
        "0.1",
        "--seed",
        "0",
        "--report",
        str(tmp_path),
        timeout=600,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert lines, r.stderr[-4000:]
    report = json.loads(lines[-1])
    assert r.returncode == 0, (report, r.stderr[-4000:])
    assert report["checks_failed"] == [], report
    assert report["lost"] == 0 and report["duplicated"] == 0 and report["mismatched"] == 0, report
    assert report["leaked_blocks"] == 0 and report["pool_errors"] == [], report
    assert report["worker_restarts"] == 2 and report["kills"] == 2, report
    assert report["completed"] + report["aborted"] == report["requests"], report
