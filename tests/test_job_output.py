"""`kvray run` output: refused before any engine starts when it is an input, a device or a pipe, or
locked by another run; a failed write (a full disk) loses nothing; the tail repair reads only the
tail; resume retries lines that failed and keeps their earlier error records."""

import json
import os
import subprocess
import sys

import pytest

from cluster.cli import main as kvray_main
from cluster.config import EngineConfig
from cluster.job.input import InputReader, JobError, resolve_shards
from cluster.job.output import OutputFile, check_not_an_input
from cluster.job.runner import Job
from cluster.llm import load_client_model
from kvcore.request import SamplingParams
from tests.job_helpers import FakeEngines, expected_tokens

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SP = SamplingParams(max_tokens=3, ignore_eos=True)


@pytest.fixture
def inp(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": [i + 1, 2]}) + "\n" for i in range(20)))
    return p


def cli_error(capsys, *argv):
    code = kvray_main(["run", "--no-progress", *argv])
    return code, capsys.readouterr().err.strip().splitlines()[-1]


def test_output_equal_to_input_is_refused_before_any_engine(inp, capsys):
    code, err = cli_error(capsys, "--input", str(inp), "--output", str(inp))
    assert code == 2 and "is also the input" in err, err
    code, err = cli_error(capsys, "--input", str(inp.parent), "--output", str(inp.parent / "out.jsonl"))
    assert code == 2 and "inside the --input directory" in err, err
    code, err = cli_error(capsys, "--input", str(inp.parent / "*.jsonl"), "--output", str(inp.parent / "o.jsonl"))
    assert code == 2 and "matches the --input pattern" in err, err


def test_stdin_redirected_from_the_output_is_refused(inp, tmp_path):
    with open(inp, "rb") as f:
        r = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "run", "--input", "-", "--output", str(inp)],
            stdin=f,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": REPO, "RAY_ADDRESS": ""},
        )
    assert r.returncode == 2 and "is also the input ('-')" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("kind", ["dev_full", "fifo"])
def test_an_output_that_cannot_be_appended_and_sought_is_refused(inp, tmp_path, capsys, kind):
    if kind == "dev_full":
        path, what = "/dev/full", "a character device"
    else:
        path, what = str(tmp_path / "pipe"), "a pipe"
        os.mkfifo(path)
    code, err = cli_error(capsys, "--input", str(inp), "--output", path)
    assert code == 2 and f"--output {path!r}: {what}, not a regular file" in err, err


def test_a_second_run_on_a_locked_output_refuses(inp, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    holder = OutputFile(str(out))
    try:
        code, err = cli_error(capsys, "--input", str(inp), "--output", str(out))
        assert code == 2 and "another kvray run is writing it" in err, err
    finally:
        holder.close()
    OutputFile(str(out)).close()  # free again once the first run ends


def test_the_half_written_line_repair_reads_only_the_tail(tmp_path, monkeypatch):
    out = tmp_path / "big.jsonl"
    line = json.dumps({"id": "x" * 50, "error": None, "finish_reason": "length"}) + "\n"
    with open(out, "w") as f:
        for i in range(200_000):
            f.write(line.replace("x" * 50, f"{i:050d}"))
        f.write('{"id": "half", "err')
    size = out.stat().st_size
    read = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: read.append(n) or real(fd, n, off))
    monkeypatch.setattr("cluster.job.output.load_done", lambda path: (set(), 0))
    OutputFile(str(out)).close()
    assert sum(read) <= 1 << 16 and out.stat().st_size == size - len('{"id": "half", "err')
    assert out.read_bytes().endswith(b"\n")


WRITE_FAILS = """
import json, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), resource.RLIM_INFINITY))
from cluster.config import EngineConfig
from cluster.job.runner import Job
from cluster.job.input import JobError, read_items
from cluster.llm import load_client_model
from kvcore.request import SamplingParams
from tests.job_helpers import FakeEngines
job = Job(EngineConfig(), FakeEngines(), load_client_model(EngineConfig())[0], sys.argv[2], progress=False)
try:
    job.run(read_items(sys.argv[1], SamplingParams(max_tokens=3, ignore_eos=True)))
except JobError as e:
    print(e)
    sys.exit(1)
"""


def test_a_failed_write_stops_the_job_with_every_record_whole_then_a_rerun_resumes(inp, tmp_path):
    out = tmp_path / "out.jsonl"
    r = subprocess.run(
        [sys.executable, "-c", WRITE_FAILS, str(inp), str(out), "2000"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert r.returncode == 1 and "write failed (File too large)" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "every record written is whole" in r.stdout
    data = out.read_bytes()
    assert 0 < len(data) <= 2000 and data.endswith(b"\n")
    partial = [json.loads(x) for x in data.splitlines()]
    stats = Job(EngineConfig(), FakeEngines(), None, str(out), progress=False).run(
        InputReader(resolve_shards(str(inp)), SP)
    )
    assert stats.skipped == len(partial) and stats.completed == 20 - len(partial)
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in recs) == sorted(f"r{i}" for i in range(20))


def test_resume_retries_failed_lines_and_keeps_their_earlier_error_records(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = [json.dumps({"id": f"g{i}", "prompt_token_ids": [i + 1]}) for i in range(3)]
    inp.write_text("\n".join([*good, '{"id": "fixme", "prompt_token_ids": [5], "max_tokens": 0}']) + "\n")
    tok = load_client_model(EngineConfig())[0]
    s1 = Job(EngineConfig(), FakeEngines(), tok, str(out), progress=False).run(
        InputReader(resolve_shards(str(inp)), SP)
    )
    assert s1.completed == 3 and s1.errors == 1
    inp.write_text("\n".join([*good, '{"id": "fixme", "prompt_token_ids": [5], "max_tokens": 2}']) + "\n")
    engines = FakeEngines()
    s2 = Job(EngineConfig(), engines, tok, str(out), progress=False).run(InputReader(resolve_shards(str(inp)), SP))
    assert s2.skipped == 3 and s2.completed == 1 and s2.errors == 0 and s2.earlier_errors == 1
    assert engines.submitted == ["fixme"]
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    fix = [r for r in recs if r["id"] == "fixme"]
    assert [r["finish_reason"] for r in fix] == ["error", "length"]  # the last record counts
    assert fix[-1]["output_token_ids"] == expected_tokens([5], 2)


def test_check_not_an_input_allows_a_separate_file(inp, tmp_path):
    check_not_an_input(str(tmp_path / "elsewhere" / "out.jsonl"), str(inp), resolve_shards(str(inp)))
    with pytest.raises(JobError, match="is also the input"):
        check_not_an_input(str(tmp_path / "x" / ".." / "in.jsonl"), str(inp), resolve_shards(str(inp)))
