"""Every benchmark script's --smoke on the CPU, read from the `smoke` suite of benchmarks/suites.yaml, so that
a renamed function or a changed signature breaks CI rather than a GPU run.

Each smoke runs in this process (its module imported as benchmarks.<folder>.<script>, its main() called
with the suite's arguments): no interpreter start and torch import per script. The smokes that run an
engine share one local Ray, started here and stopped here. Each test checks the text the suite expects of
the smoke, any closer check below, and that it recorded nothing.
"""

import importlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.suites import load_suites

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
FOLDERS = ("kernels", "e2e", "host", "checks", "tools")
SMOKE = load_suites()["smoke"]


def run_smoke(capsys, module: str, args: list[str]) -> str:
    """Run the module's main(args); its stdout. A smoke exits 0 and records no result. What a script sets
    for its own process (torch's thread count, environment variables) is put back for the next test."""
    import torch

    threads, environ = torch.get_num_threads(), dict(os.environ)
    try:
        rc = importlib.import_module(module).main(args)
    finally:
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)
    assert rc in (None, 0), f"{module} {args} returned {rc}"
    out = capsys.readouterr().out
    assert "RESULT" not in out, f"{module} --smoke recorded a result"
    return out


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the engine smokes; its workers import the benchmark modules from the repo root (the
    no-op worker of bench_logprobs_host_path is named by its module)."""
    import ray

    from cluster.replicas.placement import start_local_ray

    if ray.is_initialized():
        yield
        return
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([saved] if saved else []))
    try:
        start_local_ray(num_cpus=8, include_dashboard=False)
        yield
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


# ---- closer checks than the suite's expected text, by step name -------------------------------------


def _rows(out: str, prefix: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.startswith(prefix)]


def _attention(out: str) -> None:
    # Each kernel is checked against the torch reference (SDPA for prefill) inside the script.
    # One decode row, one at nano's shape, one prefill per layout run (the fp8 step runs the default's).
    layouts = [x for x in ("NHD", "HND") if f"decode {x} B=" in out]
    assert layouts, out
    for x in layouts:
        assert out.count(f"decode {x} B=") == 1 and out.count(f"decode-nano {x} B=") == 1, out
    assert out.count("prefill 2x24") == len(layouts), out


def _fp8_linear(out: str) -> None:
    # Each projection's fp8 output is checked against bf16's inside the script (relative error < 8%).
    assert out.count("llama-3.1-8b ") == 12, out  # 4 projections x M 3, 20, 80


def _splits(out: str) -> None:
    rows = [line for line in out.splitlines() if line.startswith("llama-3.1-8b  wide B=")]
    assert len(rows) == 2 and all("heuristic s1:" in r for r in rows), out  # batches 3 and 5
    assert out.count("default/s1=") == 2, out


def _block_table(out: str) -> None:
    assert out.count("slot mapping") == 5 and out.count("commit ") == 4, out


def _layer_kernels(out: str) -> None:
    lines = [line for line in out.splitlines() if "bit-exact" in line or "decoder layer" in line]
    assert len(lines) == 8, out  # 3 ops and the layer, for each of the two shapes
    assert all("bit-exact 100.0000%" in line for line in lines if "bit-exact" in line), out


def _sampler(out: str) -> None:
    cases = [line for line in out.splitlines() if "tokens == torch reference" in line]
    assert len(cases) == 5 and all(line.endswith("1.000") for line in cases), out


def _moe(out: str) -> None:
    assert out.count("fused == loop") == 3, out


def _scheduler_step(out: str) -> None:
    rows = {r[0]: r[1:] for r in _rows(out, "scheduler_step_us")}
    assert set(rows) == {"scheduler_step_us_256_decodes", "scheduler_step_us_prefill_mix"}, out
    assert float(rows["scheduler_step_us_256_decodes"][2]) == 256.0  # every step ran all 256 decodes


def _job_client_memory(out: str) -> None:
    rec = json.loads(out.strip().splitlines()[-1])
    assert rec["lines"] == rec["completed"] == rec["resume_skipped"] == 2000, rec


def _logprobs_host_path(out: str) -> None:
    assert out.count("32 tokens in") == 4, out


def _api_features(out: str) -> None:
    assert out.count("48 tokens in") == 5, out  # base, logprobs, n4, stop, base_again: every token came
    assert all(f"{name}: " in out for name in ("logprobs", "n4", "stop")), out
    assert out.count("x base (smoke, not recorded)") == 3, out


def _decode_idle(out: str) -> None:
    row = _rows(out, "graphs_async")[0]
    assert float(row[-1]) > 0, out  # e2e tok/s (no CUDA events on the CPU: the idle columns are "-")


def _tp_scaling(out: str) -> None:
    rows = {r[0]: r for r in _rows(out, "TP")}
    assert set(rows) == {"TP1", "TP2"} and all(float(r[-1]) > 0 for r in rows.values()), out


CHECKS: dict[str, Callable[[str], None]] = {
    "bench_attention": _attention,
    "bench_attention_fp8kv": _attention,
    "bench_fp8_linear": _fp8_linear,
    "bench_attention_splits": _splits,
    "bench_block_table": _block_table,
    "bench_layer_kernels": _layer_kernels,
    "bench_sampler": _sampler,
    "bench_moe_kernel": _moe,
    "bench_scheduler_step": _scheduler_step,
    "bench_job_client_memory": _job_client_memory,
    "bench_logprobs_host_path": _logprobs_host_path,
    "bench_api_features": _api_features,
    "bench_decode_idle": _decode_idle,
    "bench_tp_scaling": _tp_scaling,
}

# The host-only smokes first, then the engine smokes on the shared Ray (module-scoped: started once).
STEPS = sorted(SMOKE.steps, key=lambda s: s.ray)


@pytest.mark.parametrize("step", STEPS, ids=[s.name for s in STEPS])
def test_smoke(capsys, request, tmp_path, step):
    if step.ray:
        request.getfixturevalue("local_ray")
    args = [a.replace("{tmp}", str(tmp_path)) for a in step.args]
    out = run_smoke(capsys, step.module, args)
    missing = [t for t in step.expect if t not in out]
    assert not missing, (missing, out)
    if step.name in CHECKS:
        CHECKS[step.name](out)


def test_every_closer_check_names_a_smoke_step():
    assert set(CHECKS) <= {s.name for s in SMOKE.steps}


def test_every_script_with_a_smoke_is_in_the_smoke_suite():
    """A script that takes --smoke runs in CI: the smoke suite names it (the README says why the others have none)."""
    suite_modules = {s.module for s in SMOKE.steps}
    with_smoke = {
        f"benchmarks.{p.parent.name}.{p.stem}"
        for f in FOLDERS
        for p in (BENCH / f).glob("*.py")
        if '"--smoke"' in p.read_text() and p.stem != "__init__"
    }
    # bench_serve: Ray Serve and an offline engine, minutes (its client runs against tests/test_serve.py's
    # server); check_logprobs_close: its smoke records into a folder of its own (tests/test_check_logprobs_close.py)
    exempt = {"benchmarks.e2e.bench_serve", "benchmarks.checks.check_logprobs_close"}
    assert with_smoke - suite_modules == exempt, with_smoke - suite_modules


def test_every_script_is_listed_in_the_readme():
    """The map names every script (with its --smoke or why it has none), and nothing that is gone."""
    readme = (BENCH / "README.md").read_text()
    scripts = {str(p.relative_to(BENCH)) for f in FOLDERS for p in (BENCH / f).glob("*.*") if p.stem != "__init__"}
    listed = {s for s in scripts if f"| `{s}` |" in readme}
    assert listed == scripts, sorted(scripts - listed)


def test_bench_offline_counts_an_fp8_cache_at_one_byte_a_value():
    from benchmarks.e2e.bench_offline import kv_bytes_per_token

    bf16 = kv_bytes_per_token("llama-3.1-8b")
    assert bf16 == 2 * 2 * 32 * 8 * 128  # K and V, bf16, 32 layers of 8 KV heads of 128
    assert kv_bytes_per_token("llama-3.1-8b", "fp8") == kv_bytes_per_token("llama-3.1-8b", "fp8_e5m2") == bf16 // 2
    assert kv_bytes_per_token("llama-3.1-8b", "auto") == bf16
