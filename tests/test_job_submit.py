"""`kvray run` as a Ray job on a real (local) cluster: `ray start --head` with token authentication,
`ray job submit --working-dir . -- kvray run --config configs/local.yaml --input ... --output ...`,
then the output file is checked, a resubmission skips what is done and retries what failed, and the
head is stopped (only it: every port it binds is a free one, its temp dir is private, and it is stopped
by its own process group, never by `ray stop`)."""

import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from tests.ports import free_ports

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


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
    # A private Ray temp dir (short: Ray's socket paths must fit 107 bytes): the head is recorded there,
    # not in /tmp/ray, so no other Ray user of this machine sees it or joins it.
    ray_tmp = tempfile.mkdtemp(prefix="kvrt-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.pop("TRITON_INTERPRET", None)  # a plain CPU run, as a user's job would be
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token),
        RAY_USAGE_STATS_ENABLED="0",
        RAY_TMPDIR=ray_tmp,
        PATH=os.pathsep.join(path + [env.get("PATH", "")]),
    )
    head, dash = start_head(env, ray_tmp)
    try:
        yield env, f"http://127.0.0.1:{dash}", tmp
    finally:
        stop_head(head, ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


HEAD_PORTS = (
    "port",
    "dashboard-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "metrics-export-port",
    "runtime-env-agent-port",
    "node-manager-port",
    "object-manager-port",
    "ray-client-server-port",
)


def start_head(env, ray_tmp, attempts: int = 3):
    """`ray start --head --block` on fresh free ports for every port the head binds (GCS, dashboard,
    dashboard agent, metrics, runtime-env agent, raylet, object manager, client server), in its own
    process group; returns (the process, the dashboard port). A port found free can be taken by another
    process before the head binds it: a failed start is stopped and retried on new ports."""
    errors = []
    for _ in range(attempts):
        ports = dict(zip(HEAD_PORTS, free_ports(len(HEAD_PORTS)), strict=True))
        cmd = [
            f"{BIN}/ray",
            "start",
            "--head",
            "--block",
            "--num-cpus=4",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            "--disable-usage-stats",
            *(f"--{k}={v}" for k, v in ports.items()),
        ]
        log = open(os.path.join(ray_tmp, "head.log"), "w+")
        head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and head.poll() is None:
            cluster_file = os.path.join(ray_tmp, "ray", "ray_current_cluster")
            if os.path.exists(cluster_file) and dashboard_up(ports["dashboard-port"]):
                return head, ports["dashboard-port"]
            time.sleep(1)
        log.seek(0)
        errors.append(log.read()[-2000:])
        stop_head(head, ray_tmp)
    raise RuntimeError("ray start --head failed %d times:\n%s" % (attempts, "\n---\n".join(errors)))


def dashboard_up(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def stop_head(head, ray_tmp):
    """Stop only this head: SIGTERM to its process group (`ray start --block` shuts its processes down),
    then any process still running from its private temp dir, by pid. Never `ray stop`, which stops every
    Ray on the machine."""
    try:
        os.killpg(head.pid, signal.SIGTERM)
        # Its own shutdown took ~30 s on the CI machine; what is left after 2 s is stopped below by pid
        # (its temp dir is private and removed after: nothing it would have cleaned up outlives it).
        head.wait(timeout=2)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    # The head had its 2 s to shut down: what is still running from its temp dir is SIGKILLed (more
    # SIGTERMs only waited ~15 s more on the CI machine before the SIGKILL came anyway).
    deadline = time.monotonic() + 30
    while True:
        left = processes_using(ray_tmp)
        if not left or time.monotonic() > deadline:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(1)


def processes_using(path):
    """Pids of the processes whose command line names path (this head's private temp dir)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if path.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def submit(env, address, *args):
    cmd = [
        f"{BIN}/ray",
        "job",
        "submit",
        "--address",
        address,
        "--working-dir",
        REPO,
        "--",
        "kvray",
        "run",
        "--config",
        "configs/local.yaml",
        "--no-progress",
        *args,
    ]
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
    lines = [
        {"id": "a", "prompt": "Hello, Ray", "max_tokens": 6},
        {"id": "b", "prompt_token_ids": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True},
        {"prompt": "third, id from the line number", "max_tokens": 3, "ignore_eos": True},
        {"id": "bad", "prompt": "x", "top_p": 0},
    ]
    inp.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    r = submit(env, address, "--input", str(inp), "--output", str(out), "--summary-json", str(summary))
    # Two lines got error records: the job ends with exit code 3 (so Ray marks it failed), the count last.
    assert r.returncode != 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "2 of 5 line(s) got error records (exit 3)" in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    recs = {(x["id"], x["line"]): x for x in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == {("a", 1), ("b", 2), ("3", 3), ("bad", 4), (None, 5)}
    assert recs[("b", 2)]["finish_reason"] == "length" and len(recs[("b", 2)]["output_token_ids"]) == 4
    assert len(recs[("3", 3)]["output_token_ids"]) == 3
    assert recs[("a", 1)]["error"] is None and isinstance(recs[("a", 1)]["text"], str)
    assert "top_p=0: must be in (0, 1]" in recs[("bad", 4)]["error"]
    assert "not valid JSON" in recs[(None, 5)]["error"]
    s = json.loads(summary.read_text())
    assert s["completed"] == 3 and s["errors"] == 2 and s["output_tokens"] >= 7
    # Resubmitted with the bad line fixed and one more line: those two run, the answered ones are skipped,
    # the line that is still not JSON fails again; nothing that succeeded is answered twice.
    lines[3] = {"id": "bad", "prompt": "x", "top_p": 0.5, "max_tokens": 2}
    lines.append({"id": "c", "prompt_token_ids": [9, 9], "max_tokens": 2, "ignore_eos": True})
    inp.write_text("\n".join(json.dumps(x) for x in lines[:4]) + "\nnot json\n" + json.dumps(lines[4]) + "\n")
    r = submit(env, address, "--input", str(inp), "--output", str(out), "--summary-json", str(summary))
    assert "1 of 3 line(s) got error records" in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    got = [x for x in map(json.loads, out.read_text().splitlines()) if x["error"] is None]
    ids = [(x["id"], x["line"]) for x in got]
    assert len(ids) == len(set(ids)) == 5 and ("c", 6) in ids and ("bad", 4) in ids
    s = json.loads(summary.read_text())
    assert s["skipped_already_done"] == 3 and s["completed"] == 2 and s["earlier_error_records"] == 2


def test_the_quick_start_works_beside_a_running_cluster(cluster, tmp_path):
    """RAY_ADDRESS unset, a `ray start` cluster on the machine: kvray starts a private Ray and says so."""
    env, _, _ = cluster
    out = tmp_path / "out.jsonl"
    r = subprocess.run(
        [
            "kvray",
            "run",
            "--config",
            "configs/local.yaml",
            "--no-progress",
            "--num-requests",
            "2",
            "--output",
            str(out),
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "a Ray cluster is already running on this machine" in r.stderr and "private local Ray" in r.stderr
    assert len(out.read_text().splitlines()) == 2


def test_the_cluster_refuses_a_wrong_token(cluster):
    env, address, tmp = cluster
    wrong = tmp / "wrong_token"
    wrong.write_text(secrets.token_hex(32))
    r = subprocess.run(
        [f"{BIN}/ray", "job", "list", "--address", address],
        env={**env, "RAY_AUTH_TOKEN_PATH": str(wrong)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    ok = subprocess.run(
        [f"{BIN}/ray", "job", "list", "--address", address], env=env, capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stderr[-2000:]


# A worker actor's INFO line as Ray streams it to the console, and one of the driver actor's.
WORKER_INFO = re.compile(
    r"\(Worker pid=\d+(, ip=[^)]*)?\).*actors\.worker\.actor: worker rank 0: \d+ start-up objects frozen"
)
DRIVER_INFO = "actors.driver.engine_core: EngineCore:"


def test_verbose_shows_the_workers_log_lines_on_a_cluster_started_before(cluster, tmp_path):
    """The head was started without KVRAY_VERBOSE, so -v must reach its actors through their runtime env."""
    env, _, _ = cluster
    assert "KVRAY_VERBOSE" not in env
    joined = {**env, "RAY_ADDRESS": "auto"}  # this head: its record is in the private RAY_TMPDIR

    def run(*flags):
        out = tmp_path / f"out{len(flags)}.jsonl"
        cmd = ["kvray", *flags, "run", "--config", "configs/local.yaml", "--no-progress", "--num-requests", "2"]
        r = subprocess.run(
            [*cmd, "--output", str(out)], env=joined, cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert "private local Ray" not in r.stderr  # it joined the head
        return r.stderr

    verbose = run("-v")
    assert WORKER_INFO.search(verbose) and DRIVER_INFO in verbose, verbose[-3000:]
    quiet = run()
    assert not WORKER_INFO.search(quiet) and DRIVER_INFO not in quiet, quiet[-3000:]


def readme_recipe() -> list[str]:
    """The README's `ray job submit` recipe: the lines of the code block after its marker."""
    text = open(os.path.join(REPO, "README.md")).read()
    block = text.split("<!-- recipe-job-submit -->", 1)[1].split("```", 2)[1]
    return [line.split("  #")[0].strip() for line in block.strip().splitlines()]


def test_the_readmes_token_auth_recipe_runs_as_written(tmp_path):
    """Each line of the recipe in a private HOME (its ~/.ray/auth_token) and Ray temp dir, with free ports
    added to `ray start --head` and put in place of 8265, and the output under tmp_path; then a submission
    without the token is refused. The head is stopped by its pids (never `ray stop`)."""
    lines = readme_recipe()
    assert [x.split()[0] for x in lines] == ["export", "ray", "ray", "RAY_ADDRESS=http://127.0.0.1:8265"], lines
    home, out, log = tmp_path / "home", tmp_path / "out.jsonl", tmp_path / "submit.log"
    home.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="kvrr-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.pop("TRITON_INTERPRET", None)
    env.update(HOME=str(home), RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0", PATH=kvray_path(tmp_path, env))

    def sh(*script: str, timeout: int = 300) -> subprocess.CompletedProcess:
        # The recipe's first line (export RAY_AUTH_MODE=token) holds for the lines after it.
        cmd = "\n".join(["set -e", lines[0], *script])
        return subprocess.run(["bash", "-c", cmd], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)

    try:
        r = sh(lines[1])
        assert r.returncode == 0 and (home / ".ray" / "auth_token").exists(), r.stderr[-2000:]
        # A head that times out starting on a loaded machine (or loses a port found free) is stopped and
        # started again on new ports, as start_head() does.
        for _ in range(3):
            ports = dict(zip(HEAD_PORTS, free_ports(len(HEAD_PORTS)), strict=True))
            flags = " ".join(f"--{k}={v}" for k, v in ports.items())
            r = sh(lines[2].replace("ray start --head", f"ray start --head {flags}"))
            if r.returncode == 0:
                break
            stop_daemonized_head(ray_tmp)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        submit = lines[3].replace(":8265", f":{ports['dashboard-port']}").replace("/tmp/kvray-job.out.jsonl", str(out))
        # Until the head's job agent is up it answers "No available agent": the README says to submit again.
        r = sh(
            "for i in $(seq 60); do",
            f"  if {submit} > {log} 2>&1; then exit 0; fi",
            f"  grep -q 'No available agent' {log} || {{ cat {log}; exit 1; }}",
            "  sleep 2",
            "done",
            "exit 1",
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        recs = [json.loads(x) for x in out.read_text().splitlines()]
        assert sorted(x["id"] for x in recs) == ["greedy-ids", "hello", "sampled"] and all(
            x["error"] is None for x in recs
        ), recs
        # Without the token (another HOME, no RAY_AUTH_MODE): refused.
        stranger = {**env, "HOME": str(tmp_path), "RAY_ADDRESS": f"http://127.0.0.1:{ports['dashboard-port']}"}
        r = subprocess.run(["ray", "job", "list"], env=stranger, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "Missing authentication token" in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    finally:
        stop_daemonized_head(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def kvray_path(tmp, env) -> str:
    """PATH with this Python's bin first, and a `kvray` shim where it is not installed there."""
    path = [BIN]
    if shutil.which("kvray", path=BIN) is None:
        shim = tmp / "bin"
        shim.mkdir()
        (shim / "kvray").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m cluster.cli "$@"\n')
        (shim / "kvray").chmod(stat.S_IRWXU)
        path.insert(0, str(shim))
    return os.pathsep.join(path + [env.get("PATH", "")])


def stop_daemonized_head(ray_tmp):
    """`ray start` without --block leaves no process of ours to signal: SIGKILL the processes that name the
    head's private temp dir and their children (Ray's agents and idle workers rename themselves), by pid."""
    deadline = time.monotonic() + 30
    while (pids := processes_using(ray_tmp)) and time.monotonic() < deadline:
        for pid in pids + children_of(pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(1)


def children_of(pids):
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid in pids:
                kids.append(int(entry))
    return kids
