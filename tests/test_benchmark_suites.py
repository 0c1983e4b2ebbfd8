"""The benchmark suites (benchmarks/suites.yaml, `python -m benchmarks`): the file's rules, the runner, the one
result writer, and the vs-vllm ratio step that joins kvray's side and vLLM's from separate device calls."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks import common
from benchmarks.__main__ import main as run_suites
from benchmarks.e2e import vs_vllm
from benchmarks.suites import DEVICE_CALL_S, load_suites

ROOT = Path(__file__).resolve().parent.parent


def test_the_named_suites_exist_and_each_gpu_part_fits_one_device_call():
    suites = load_suites()
    assert {"smoke", "kernels", "e2e", "control-plane", "vs-vllm", "multigpu"} <= set(suites)
    assert not suites["smoke"].gpu and not suites["control-plane"].gpu
    assert suites["vs-vllm"].gpu and suites["multigpu"].gpus >= 2
    for s in suites.values():
        if s.gpu:
            assert all(s.limit_s(p) <= DEVICE_CALL_S for p in s.parts), (s.name, s.parts)


def test_every_step_names_a_module_that_exists():
    for suite in load_suites().values():
        for step in suite.steps:
            assert importlib.util.find_spec(step.module) is not None, (suite.name, step.name, step.module)


def test_vs_vllm_runs_by_parts_and_records_the_three_targets():
    suite = load_suites()["vs-vllm"]
    assert suite.parts == ["kvray", "kvray-8b", "vllm", "vllm-decode", "ratio"]
    declared = {m for s in suite.steps for m in s.metrics}
    assert {"nano_vs_vllm_ratio", "sharegpt_vs_vllm_ratio", "batch1_weight_bw_frac_llama8b"} <= declared
    # Every figure a ratio joins is made by some step of the suite, on both sides.
    for r in vs_vllm.RATIOS:
        assert r.kvray[1] in declared and r.vllm[1] in declared, r
    assert suite.mirror  # the parts meet in a folder that outlives one device call


def _write(tmp_path: Path, suites: dict) -> Path:
    path = tmp_path / "suites.yaml"
    path.write_text(yaml.safe_dump({"suites": suites}))
    return path


@pytest.mark.parametrize(
    "suites, message",
    [
        ({"x": {"gpu": True, "steps": [{"name": "a", "module": "m", "limit_s": 601}]}}, "over one device call"),
        ({"x": {"gpu": False, "steps": [{"name": "a", "module": "m", "limit": 5}]}}, "unknown fields ['limit']"),
        ({"x": {"gpu": False, "steps": [{"name": "a", "module": "m"}, {"name": "a", "module": "n"}]}}, "repeated"),
        ({"x": {"gpu": "yes", "steps": [{"name": "a", "module": "m"}]}}, "'gpu' must be true or false"),
        ({"x": {"gpu": False, "steps": [{"name": "a", "module": "m", "python": "pypy"}]}}, "python must be"),
        ({"x": {"gpu": False, "steps": []}}, "'steps' must be a non-empty list"),
    ],
)
def test_bad_suite_data_is_refused_naming_the_field(tmp_path, suites, message):
    with pytest.raises(ValueError) as err:
        load_suites(_write(tmp_path, suites))
    assert message in str(err.value), err.value


def test_list_and_dry_run(capsys):
    assert run_suites(["--list"]) == 0
    out = capsys.readouterr().out
    assert "vs-vllm" in out and "parts kvray" in out and "smoke" in out
    assert run_suites(["vs-vllm", "--part", "ratio", "--dry-run"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].endswith("-m benchmarks.e2e.vs_vllm ratio"), out


def test_an_unknown_suite_or_part_is_refused(capsys):
    with pytest.raises(SystemExit):
        run_suites(["no-such-suite"])
    assert "not in benchmarks/suites.yaml" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_suites(["vs-vllm", "--part", "nope", "--dry-run"])
    assert "has parts" in capsys.readouterr().err


def test_the_runner_runs_a_step_and_checks_its_output(tmp_path, monkeypatch, capsys):
    """One CPU step through the real runner (a subprocess, its log, the expected text)."""
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    rc = run_suites(["smoke", "--only", "bench_job_client_memory", "--logs", str(tmp_path / "logs")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "smoke: 1/1 steps passed" in out
    assert '"completed": 2000' in (tmp_path / "logs" / "bench_job_client_memory.log").read_text()
    assert (tmp_path / "out" / "smoke-logs.tgz").exists()


@pytest.fixture
def results(tmp_path, monkeypatch):
    """record() writing into tmp_path/results (and the mirror), never into benchmarks/results."""
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setenv("KVRAY_RESULTS_MIRROR", str(tmp_path / "mirror"))
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.delenv("KVRAY_SUITE", raising=False)
    for name in [k for k in os.environ if k.startswith("KVRAY_") and k not in common.RUNNER_ENV]:
        monkeypatch.delenv(name)
    return tmp_path


def test_record_writes_every_field_to_the_results_and_the_mirror(results, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "e2e" / "bench_offline.py"), "--workload", "nano"])
    rec = common.record("series", "m", 1.23456, "x", device="NVIDIA H100 80GB HBM3")
    for folder in ("results", "mirror"):
        line = json.loads((results / folder / "series.jsonl").read_text())
        assert line == rec
    assert set(rec) == {"metric", "value", "unit", "device", "commit", "date", "command"}
    assert rec["command"] == "python -m benchmarks.e2e.bench_offline --workload nano"
    assert common.latest(results / "mirror", "series", "m") == rec
    assert common.latest(results / "mirror", "series", "other") is None


def test_a_figure_made_under_an_engine_switch_names_it(results, monkeypatch):
    """An A/B run (the fused cache write off, say) records under the same metric as the default: the record
    carries the switch, so the two are never confused, and the vs-vllm ratio reads only the default's
    figure; the runner's own variables are not named."""
    monkeypatch.setenv("KVRAY_FUSED_KV_WRITE", "0")
    monkeypatch.setenv("KVRAY_COMMIT", "abc1234")
    rec = common.record("series", "m", 1.0, "x", device="NVIDIA H100 80GB HBM3")
    assert rec["env"] == {"KVRAY_FUSED_KV_WRITE": "0"} and rec["commit"] == "abc1234"
    assert json.loads((results / "results" / "series.jsonl").read_text()) == rec
    assert common.latest(results / "mirror", "series", "m") is None, "the ratio step would read the A/B figure"
    monkeypatch.delenv("KVRAY_FUSED_KV_WRITE")
    default = common.record("series", "m", 2.0, "x", device="NVIDIA H100 80GB HBM3")
    monkeypatch.setenv("KVRAY_GREEDY_KERNEL", "0")
    common.record("series", "m", 3.0, "x", device="NVIDIA H100 80GB HBM3")  # a later A/B run
    assert common.latest(results / "mirror", "series", "m") == default


def _side(metric_series: list[tuple[str, str, float]], device: str) -> None:
    for series, metric, value in metric_series:
        common.record(series, metric, value, "u", device=device)


def test_ratio_joins_both_sides_from_the_mirror(results, capsys):
    h100 = "NVIDIA H100 80GB HBM3"
    _side(
        [
            ("bench_offline", "offline_qwen3_0p6b_nano_tok_s", 19585.0),
            ("bench_offline", "offline_llama8b_output_tok_s", 7675.0),
            ("bench_batch1_decode", "batch1_ms_per_token_llama8b", 6.25),
        ],
        h100,
    )
    _side(
        [
            ("vs_vllm", "vllm_nano_tok_s", 18769.0),
            ("vs_vllm", "vllm_sharegpt_tok_s", 7435.0),
            ("vs_vllm", "vllm_batch1_ms_per_token_llama8b", 6.31),
        ],
        h100,
    )
    assert vs_vllm.main(["ratio", "--from", str(results / "mirror")]) == 0
    got = {m: common.latest(results / "mirror", "vs_vllm", m) for m in ("nano_vs_vllm_ratio", "sharegpt_vs_vllm_ratio")}
    assert got["nano_vs_vllm_ratio"]["value"] == round(19585 / 18769, 4)
    assert got["sharegpt_vs_vllm_ratio"]["value"] == round(7675 / 7435, 4)
    assert common.latest(results / "mirror", "vs_vllm", "batch1_vs_vllm_ratio")["value"] == round(6.31 / 6.25, 4)
    assert all(r["device"] == h100 for r in got.values())


def test_ratio_joins_the_fp8_and_start_up_figures_when_a_run_made_them(results, capsys):
    h100 = "NVIDIA H100 80GB HBM3"
    kvray = [
        ("bench_offline", "offline_qwen3_0p6b_nano_tok_s", 19500.0),
        ("bench_offline", "offline_llama8b_output_tok_s", 7700.0),
        ("bench_offline", "offline_qwen3_0p6b_nano_fp8kv_tok_s", 23400.0),
        ("bench_offline", "init_s_qwen3_0p6b_in_bench", 20.0),
    ]
    vllm = [("vs_vllm", m, v) for m, v in (("vllm_nano_tok_s", 18500.0), ("vllm_sharegpt_tok_s", 7600.0))]
    vllm += [("vs_vllm", "vllm_nano_fp8kv_tok_s", 22500.0), ("vs_vllm", "vllm_nano_init_s", 56.0)]
    _side(kvray, h100)
    _side(vllm, h100)
    assert vs_vllm.main(["ratio", "--from", str(results / "mirror")]) == 0
    got = lambda m: common.latest(results / "mirror", "vs_vllm", m)  # noqa: E731
    assert got("nano_fp8kv_vs_vllm_ratio")["value"] == round(23400 / 22500, 4)
    assert got("startup_vs_vllm_ratio_qwen3_0p6b")["value"] == round(20 / 56, 4)  # kvray's time over vLLM's
    out = capsys.readouterr().out
    for missing in ("sharegpt_fp8_vs_vllm_ratio", "startup_vs_vllm_ratio_llama8b", "batch1_vs_vllm_ratio"):
        assert got(missing) is None and f"{missing}: no figure" in out and "(optional: skipped)" in out


def test_the_vllm_side_runs_each_configuration_and_names_its_figures(results, tmp_path, monkeypatch):
    """vllm_bench.py's records (a stand-in prints them as vLLM's would) become vllm_<workload>[_<config>]_*."""
    bench = tmp_path / "vllm_bench.py"
    bench.write_text(
        "import json, sys\n"
        "for i, config in enumerate(sys.argv[3:]):\n"
        "    rec = dict(config=config, output_tokens=10, produced=10, tok_s=100.0 + i, init_s=50.0 + i)\n"
        "    print('VLLMBENCH', json.dumps(rec))\n"
    )
    monkeypatch.setenv("VLLM_PY", sys.executable)
    assert vs_vllm.main(["vllm", "nano", "/models/q", "--script", str(bench), "--configs", "defaults", "fp8kv"]) == 0
    figures = {m: common.latest(results / "mirror", "vs_vllm", m)["value"] for m in (
        "vllm_nano_tok_s", "vllm_nano_init_s", "vllm_nano_fp8kv_tok_s", "vllm_nano_fp8kv_init_s")}  # fmt: skip
    assert figures == {
        "vllm_nano_tok_s": 100.0,
        "vllm_nano_init_s": 50.0,
        "vllm_nano_fp8kv_tok_s": 101.0,
        "vllm_nano_fp8kv_init_s": 51.0,
    }
    with pytest.raises(SystemExit):  # a configuration vllm_bench.py does not know
        vs_vllm.main(["vllm", "nano", "/models/q", "--script", str(bench), "--configs", "int4"])


def test_ratio_refuses_figures_from_two_devices_and_reports_missing_ones(results, capsys):
    common.record("bench_offline", "offline_qwen3_0p6b_nano_tok_s", 19585.0, "tok/s", device="NVIDIA H100 80GB HBM3")
    common.record("vs_vllm", "vllm_nano_tok_s", 18769.0, "tok/s", device="NVIDIA H200")
    with pytest.raises(SystemExit, match="not side by side"):
        vs_vllm.main(["ratio", "--from", str(results / "mirror")])
    (results / "mirror" / "vs_vllm.jsonl").unlink()
    assert vs_vllm.main(["ratio", "--from", str(results / "mirror")]) == 1
    assert "no figure for vllm_nano_tok_s" in capsys.readouterr().out


def test_the_vllm_side_needs_vllm_py(monkeypatch):
    monkeypatch.delenv("VLLM_PY", raising=False)
    with pytest.raises(SystemExit, match="VLLM_PY is not set"):
        vs_vllm.main(["vllm", "nano", "/nonexistent"])


def test_the_module_runs_from_the_repo_root():
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--list"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "control-plane" in r.stdout, r.stderr
