"""`kvray` as a user meets it: --version, exit codes checked before Ray starts, a run without --output
(a timestamped file, named in the summary, samples printed), stdin input, quiet by default and detail
with -v, Ctrl-C with a one-line message, and `kvray info` (table, --json, a one-line reason for a
non-zero exit). Each subprocess gets a private Ray temp dir, so it never joins another Ray here."""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import ray

from cluster.cli import EXIT_CLOSED_OUTPUT, EXIT_INTERRUPTED, EXIT_USAGE
from cluster.cli import main as kvray_main
from cluster.replicas.placement import start_local_ray
from tests.terminal_signals import sigint_as_in_a_terminal

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISE = (
    "Token authentication is enabled",
    "Tearing down compiled DAG",
    "Started a local Ray instance",
    "Teardown complete",
    "Traceback",
    "start-up objects frozen",  # a worker actor's INFO line (-v only)
)

# A worker actor's INFO line as Ray streams it to the console: "(Worker pid=...) ... worker rank 0: ...".
WORKER_INFO = re.compile(r"\(Worker pid=\d+\).*actors\.worker\.actor: worker rank 0: \d+ start-up objects frozen")


@pytest.fixture
def env():
    ray_tmp = tempfile.mkdtemp(prefix="kvrc-", dir="/tmp")
    e = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TRITON_INTERPRET")}
    e.update(PYTHONPATH=REPO, RAY_TMPDIR=ray_tmp)
    yield e


def kvray(env, *args, cwd, stdin=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args],
        cwd=cwd,
        env=env,
        stdin=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        kvray_main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("kvray 0.")


def test_a_missing_model_exits_2_before_ray_starts(capsys, tmp_path):
    assert kvray_main(["run", "--set", f"model.model={tmp_path / 'nope'}"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.model" in err[0] and "no such directory" in err[0]
    assert not ray.is_initialized()


def test_a_run_without_output_writes_a_timestamped_file_quietly(env, tmp_path):
    with open(os.path.join(REPO, "examples", "prompts.jsonl"), "rb") as f:
        r = kvray(
            env, "run", "--config", os.path.join(REPO, "configs", "local.yaml"), "--input", "-", cwd=tmp_path, stdin=f
        )
    assert r.returncode == 0, r.stderr[-3000:]
    files = [p for p in os.listdir(tmp_path) if p.startswith("kvray-") and p.endswith(".out.jsonl")]
    assert len(files) == 1
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["output"] == str(tmp_path / files[0]) and summary["completed"] == 3  # in full
    assert "  hello: " in r.stdout  # a few sample completions
    assert {json.loads(x)["id"] for x in (tmp_path / files[0]).read_text().splitlines()} == {
        "hello",
        "greedy-ids",
        "sampled",
    }
    for noise in NOISE:
        assert noise not in r.stderr, (noise, r.stderr[-3000:])
    assert "kvray run: 3req" in r.stderr and "0 errors" in r.stderr  # the bar (stdin: no total to count)


def test_verbose_brings_the_detail_back_and_dev_stdin_works(env, tmp_path):
    with open(os.path.join(REPO, "examples", "prompts.jsonl"), "rb") as f:
        r = kvray(
            env,
            "-v",
            "run",
            "--input",
            "/dev/stdin",
            "--output",
            str(tmp_path / "o.jsonl"),
            "--no-progress",
            cwd=tmp_path,
            stdin=f,
        )
    assert r.returncode == 0, r.stderr[-3000:]
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 3
    # Ray's start-up banners are back (which ones Ray prints depends on its auth settings and state).
    banners = ("Token authentication is enabled", "Started a local Ray instance")
    assert any(b in r.stderr for b in banners), r.stderr[-3000:]


def test_ctrl_c_in_the_first_moments_is_one_line_and_130(monkeypatch, capsys):
    """Ctrl-C while kvray sets up its console (the first ~0.5 s, still importing): it printed a raw
    KeyboardInterrupt traceback (1 in 20 Ctrl-C during start-up, benchmarks/checks/check_ctrl_c_startup.py)."""
    from cluster import console

    def interrupted(verbose):
        raise KeyboardInterrupt

    monkeypatch.setattr(console, "configure", interrupted)
    assert kvray_main(["run", "--num-requests", "1"]) == EXIT_INTERRUPTED
    assert capsys.readouterr().err == "kvray: interrupted\n"


def test_ctrl_c_ends_with_where_the_output_is_and_how_to_resume(env, tmp_path):
    out = tmp_path / "o.jsonl"
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "run",
            "--num-requests",
            "400",
            "--no-progress",
            "--set",
            "scheduler.max_num_seqs=2",
            "--output",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_as_in_a_terminal,
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and p.poll() is None and (not out.exists() or not out.read_text()):
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == EXIT_INTERRUPTED, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "interrupted" in last and f"--output {out} to resume" in last, err[-3000:]
    assert "Traceback" not in err
    assert out.read_bytes().endswith(b"\n")


def test_info_table_json_and_a_one_line_reason(capsys):
    # The first look starts an embedded Ray sized to this machine and stops it; the others look at one
    # local Ray sized the same way, started here (kvray info uses a Ray this process already talks to):
    # the same answers with two Ray starts instead of four.
    assert kvray_main(["info", "--config", "configs/local.yaml"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:6] == ["node", "ip", "alive", "CPUs", "GPUs", "memory"]
    assert "e0r0" in out and "verdict: fits" in out
    assert not ray.is_initialized()  # the embedded Ray of the look is stopped after it
    start_local_ray(num_cpus=os.cpu_count() or 1, include_dashboard=False)
    try:
        info_against_a_running_ray(capsys)
    finally:
        ray.shutdown()


def info_against_a_running_ray(capsys):
    assert kvray_main(["info", "--config", "configs/local.yaml", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["placement"]["fits"] and report["cluster"]["nodes"][0]["resources"]["CPU"] == os.cpu_count()
    # A Ray sized to this machine: a GPU config does not fit a machine without GPUs.
    code = kvray_main(["info", "--config", "configs/gpu.yaml"])
    captured = capsys.readouterr()
    import torch

    if not torch.cuda.is_available():
        assert code == 1 and "verdict: does not fit" in captured.out
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and "asks for 1 GPU(s) and this machine has 0" in err[0]
    # TP=2 x DP=2 CPU ranks: oversubscribed on fewer than 4 cores (the run shares them), never "fits".
    assert kvray_main(["info", "--config", "configs/local-tp2.yaml"]) == 0
    out = capsys.readouterr().out
    if (os.cpu_count() or 1) < 4:
        assert "verdict: oversubscribed: 4 CPU rank(s) would share this machine's" in out
    else:
        assert "verdict: fits" in out
    assert ray.is_initialized()  # a Ray the caller started is left up


def test_records_on_redirected_stdout_summary_on_stderr_verbose_and_one_tok_per_s(env, tmp_path):
    # `kvray run -o /dev/stdout > file`: the summary, written through its own offset, overwrote the records.
    # -v shows kvray's own lines (the driver's, from its actor); the bar's last tok/s is the summary's.
    records = tmp_path / "records.jsonl"
    with open(os.path.join(REPO, "examples", "prompts.jsonl"), "rb") as f, open(records, "wb") as stdout:
        r = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "-v", "run", "-i", "-", "-o", "/dev/stdout"],
            cwd=tmp_path,
            env=env,
            stdin=f,
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in records.read_text().splitlines()]
    assert sorted(rec["id"] for rec in recs) == ["greedy-ids", "hello", "sampled"]  # records only
    summary = json.loads(r.stderr.strip().splitlines()[-1])
    assert summary["output"] == "<stdout>" and summary["completed"] == 3
    assert "actors.driver.engine_core: EngineCore:" in r.stderr  # kvray's own INFO line, from the driver actor
    assert WORKER_INFO.search(r.stderr), r.stderr[-3000:]  # and from a worker actor
    bar = re.findall(r"kvray run: .*?(\d+) tok/s", r.stderr)
    assert bar and abs(int(bar[-1]) - summary["output_tok_per_s"]) <= 1, (bar[-1:], summary["output_tok_per_s"])


def test_output_dash_into_head_ends_quietly_with_141(env, tmp_path):
    p = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "run", "--num-requests", "64", "--set", "scheduler.max_num_seqs=2"]
        + ["--no-progress", "-o", "-"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = p.stdout.readline()  # what `| head -n 1` reads before it goes away
        p.stdout.close()
        err = p.stderr.read()
        p.wait(timeout=300)
    finally:
        p.kill()
    assert json.loads(first)["id"].startswith("synthetic-")
    assert p.returncode == EXIT_CLOSED_OUTPUT, err[-3000:]
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-3000:]
    assert not list(tmp_path.glob("*.jsonl"))  # no file named "-", no default file


def test_a_relative_output_under_ray_job_submit_is_named_in_full(monkeypatch, tmp_path, caplog):
    import cluster.cli

    ran = []
    monkeypatch.setattr(cluster.cli, "_run_engines", lambda config, args, shards, out, total: ran.append(out.path) or 0)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")  # what `ray job submit` sets for its entrypoint
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    assert kvray_main(["run", "-o", "out.jsonl"]) == 0
    assert ran == [str(tmp_path / "out.jsonl")]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "--output 'out.jsonl' is relative" in said and str(tmp_path / "out.jsonl") in said


MID_RAY_IMPORT = """
import atexit, os, signal, sys

register = atexit.register

def register_then_ctrl_c(f, *args, **kwargs):
    register(f, *args, **kwargs)
    if getattr(f, "__module__", "") == "ray._private.worker" and f.__name__ == "shutdown":
        os.kill(os.getpid(), signal.SIGINT)  # raised in ray/_private/worker.py, its exit handler registered
    return f

atexit.register = register_then_ctrl_c
from cluster.cli import main
sys.exit(main(["run", "--num-requests", "1", "--output", sys.argv[1]]))
"""


def test_ctrl_c_in_the_middle_of_importing_ray_is_one_line_and_130(env, tmp_path):
    """It left a half-imported ray whose exit handler printed a traceback after the line (1 in 40 Ctrl-C
    during start-up, benchmarks/checks/check_ctrl_c_startup.py). The child interrupts itself mid-import."""
    r = subprocess.run(
        [sys.executable, "-c", MID_RAY_IMPORT, str(tmp_path / "o.jsonl")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=sigint_as_in_a_terminal,
    )
    assert r.returncode == EXIT_INTERRUPTED and r.stderr == "kvray: interrupted\n", (r.returncode, r.stderr[-3000:])
