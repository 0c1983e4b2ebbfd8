"""`kvray run` as a Ray job on a real (local) cluster: `ray start --head` with token authentication,
`ray job submit --working-dir . -- kvray run --config configs/local.yaml --input ... --output ...`,
then the output file is checked, a resubmission skips what is done, and the head is stopped."""
import json
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("job")
    token = tmp / "auth_token"
    token.write_text(secrets.token_hex(32))
    path = [BIN]
    if shutil.which("kvray", path=BIN) is None:
        # Not pip-installed here (CI installs it): a shim with the same entry point.
        shim = tmp / "bin"
        shim.mkdir()
        (shim / "kvray").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m cluster.cli "$@"\n')
        (shim / "kvray").chmod(stat.S_IRWXU)
        path.insert(0, str(shim))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.pop("TRITON_INTERPRET", None)  # a plain CPU run, as a user's job would be
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), RAY_USAGE_STATS_ENABLED="0",
               PATH=os.pathsep.join(path + [env.get("PATH", "")]))
    dash = start_head(env)
    try:
        yield env, f"http://127.0.0.1:{dash}", tmp
    finally:
        subprocess.run([f"{BIN}/ray", "stop", "--force"], env=env, capture_output=True, timeout=120)


def start_head(env, attempts: int = 3) -> int:
    """`ray start --head` on fresh free ports; returns the dashboard port. A port found free can be taken
    by another process before the head binds it (seen once in CI on the dashboard port): a failed start
    is stopped and retried on new ports."""
    errors = []
    for _ in range(attempts):
        gcs, dash = free_port(), free_port()
        r = subprocess.run([f"{BIN}/ray", "start", "--head", f"--port={gcs}", "--num-cpus=4",
                            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                            "--disable-usage-stats"], env=env, capture_output=True, text=True, timeout=120)
        if r.returncode == 0:
            return dash
        errors.append(r.stderr[-2000:])
        subprocess.run([f"{BIN}/ray", "stop", "--force"], env=env, capture_output=True, timeout=120)
    raise RuntimeError("ray start --head failed %d times:\n%s" % (attempts, "\n---\n".join(errors)))


def submit(env, address, *args):
    cmd = [f"{BIN}/ray", "job", "submit", "--address", address, "--working-dir", REPO, "--",
           "kvray", "run", "--config", "configs/local.yaml", "--no-progress", *args]
    deadline = time.monotonic() + 120
    while True:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
        # The head's job agent starts some seconds after `ray start` returns, later on a loaded machine;
        # until then the head refuses submissions with this message, and nothing was run.
        if r.returncode == 0 or "No available agent" not in r.stderr + r.stdout or time.monotonic() > deadline:
            return r
        time.sleep(2)


def test_ray_job_submit_runs_kvray_and_resumes(cluster):
    env, address, tmp = cluster
    inp, out, summary = tmp / "in.jsonl", tmp / "out.jsonl", tmp / "summary.json"
    lines = [{"id": "a", "prompt": "Hello, Ray", "max_tokens": 6},
             {"id": "b", "prompt_token_ids": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True},
             {"prompt": "third, id from the line number", "max_tokens": 3, "ignore_eos": True},
             {"id": "bad", "prompt": "x", "top_p": 0}]
    inp.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    r = submit(env, address, "--input", str(inp), "--output", str(out), "--summary-json", str(summary))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = {(x["id"], x["line"]): x for x in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == {("a", 1), ("b", 2), ("3", 3), ("bad", 4), (None, 5)}
    assert recs[("b", 2)]["finish_reason"] == "length" and len(recs[("b", 2)]["output_token_ids"]) == 4
    assert len(recs[("3", 3)]["output_token_ids"]) == 3
    assert recs[("a", 1)]["error"] is None and isinstance(recs[("a", 1)]["text"], str)
    assert "top_p=0: must be in (0, 1]" in recs[("bad", 4)]["error"]
    assert "not valid JSON" in recs[(None, 5)]["error"]
    s = json.loads(summary.read_text())
    assert s["completed"] == 3 and s["errors"] == 2 and s["output_tokens"] >= 7
    # Resubmitted with one more line: only the new line runs; nothing is answered twice.
    with open(inp, "a") as f:
        f.write(json.dumps({"id": "c", "prompt_token_ids": [9, 9], "max_tokens": 2, "ignore_eos": True}) + "\n")
    r = submit(env, address, "--input", str(inp), "--output", str(out), "--summary-json", str(summary))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ids = [(x["id"], x["line"]) for x in map(json.loads, out.read_text().splitlines())]
    assert len(ids) == len(set(ids)) == 6 and ("c", 6) in ids
    s = json.loads(summary.read_text())
    assert s["skipped_already_done"] == 5 and s["completed"] == 1


def test_the_cluster_refuses_a_wrong_token(cluster):
    env, address, tmp = cluster
    wrong = tmp / "wrong_token"
    wrong.write_text(secrets.token_hex(32))
    r = subprocess.run([f"{BIN}/ray", "job", "list", "--address", address],
                       env={**env, "RAY_AUTH_TOKEN_PATH": str(wrong)}, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    ok = subprocess.run([f"{BIN}/ray", "job", "list", "--address", address], env=env, capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
