"""Every benchmark script's --smoke on the CPU (benchmarks/README.md lists the scripts without one, and
why), so that a renamed function or a changed signature breaks CI rather than a GPU run.

Each smoke runs in this process (the script imported by path, its main() called with --smoke): no
interpreter start and torch import per script. The smokes that run an engine share one local Ray,
started here and stopped here. Each test checks the smoke's own output, and that it recorded nothing.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
FOLDERS = ("kernels", "e2e", "host", "checks", "tools")


def load(rel: str):
    """benchmarks/<rel>.py imported under its script name (as its sibling scripts import it)."""
    path = BENCH / f"{rel}.py"
    name = path.stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def smoke(capsys, rel: str, *args: str) -> str:
    """Run the script's --smoke; its stdout. A smoke exits 0 and records no result. What a script sets
    for its own process (torch's thread count, environment variables) is put back for the next test."""
    import torch

    threads, environ = torch.get_num_threads(), dict(os.environ)
    try:
        rc = load(rel).main(["--smoke", *args])
    finally:
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)
    assert rc in (None, 0), f"{rel} --smoke returned {rc}"
    out = capsys.readouterr().out
    assert "RESULT" not in out, f"{rel} --smoke recorded a result"
    return out


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the engine smokes; its workers can import every benchmark script by name (the
    no-op worker of bench_logprobs_host_path is named by its module)."""
    import ray

    from cluster.replicas.placement import start_local_ray

    if ray.is_initialized():
        yield
        return
    saved = os.environ.get("PYTHONPATH")
    paths = [str(BENCH / f) for f in FOLDERS] + [str(BENCH)] + ([saved] if saved else [])
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    try:
        start_local_ray(num_cpus=8, include_dashboard=False)
        yield
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def test_every_script_is_listed_in_the_readme():
    """The map names every script (with its --smoke or why it has none), and nothing that is gone."""
    readme = (BENCH / "README.md").read_text()
    scripts = {str(p.relative_to(BENCH)) for f in FOLDERS for p in (BENCH / f).glob("*.*")}
    listed = {s for s in scripts if f"| `{s}` |" in readme}
    assert listed == scripts, sorted(scripts - listed)


# ---- kernels (Triton interpreter, tests/conftest.py) ------------------------------------------------


@pytest.mark.parametrize("cache", [[], ["--kv-cache-dtype", "fp8"]])
def test_bench_attention_smoke(capsys, cache):
    # Each kernel is checked against the torch reference (SDPA for prefill) inside the script.
    out = smoke(capsys, "kernels/bench_attention", *cache)
    assert out.count("decode B=") == 1 and "prefill 2x24 on 20 cached" in out and "mixed step" in out, out


def test_bench_fp8_linear_smoke(capsys):
    # Each projection's fp8 output is checked against bf16's inside the script (relative error < 8%).
    out = smoke(capsys, "kernels/bench_fp8_linear", "--shapes", "llama-3.1-8b")
    assert out.count("llama-3.1-8b ") == 12 and "small-M kernel" in out, out  # 4 projections x M 3, 20, 80


def test_bench_attention_splits_smoke(capsys):
    out = smoke(capsys, "kernels/bench_attention_splits", "--shapes", "llama-3.1-8b", "--dists", "wide")
    rows = [line for line in out.splitlines() if line.startswith("llama-3.1-8b  wide B=")]
    assert len(rows) == 2 and all("heuristic s1:" in r for r in rows), out  # batches 3 and 5
    assert out.count("default/s1=") == 2 and "n64s2/s2=" in out, out


def test_bench_block_table_smoke(capsys):
    out = smoke(capsys, "kernels/bench_block_table")
    assert out.count("slot mapping") == 5 and out.count("commit ") == 4, out
    assert "nothing recorded" in out


def test_bench_layer_kernels_smoke(capsys):
    out = smoke(capsys, "kernels/bench_layer_kernels")
    lines = [line for line in out.splitlines() if "bit-exact" in line or "decoder layer" in line]
    assert len(lines) == 8, out  # 3 ops and the layer, for each of the two shapes
    assert all("bit-exact 100.0000%" in line for line in lines if "bit-exact" in line), out


def test_bench_sampler_smoke(capsys):
    out = smoke(capsys, "kernels/bench_sampler")
    cases = [line for line in out.splitlines() if "tokens == torch reference" in line]
    assert len(cases) == 5 and all(line.endswith("1.000") for line in cases), out


def test_bench_moe_kernel_smoke(capsys):
    out = smoke(capsys, "kernels/bench_moe_kernel")
    assert out.count("fused == loop") == 3, out


def test_bench_kernels_runs_the_three_kernel_scripts():
    """bench_kernels only runs the scripts above in subprocesses: they must exist under those names."""
    module = load("kernels/bench_kernels")
    assert {f"kernels/{s}" for s in module.SCRIPTS} <= {
        str(p.relative_to(BENCH)) for p in (BENCH / "kernels").glob("*.py")
    }


# ---- host ------------------------------------------------------------------------------------------


def test_bench_scheduler_step_smoke(capsys):
    out = smoke(capsys, "host/bench_scheduler_step")
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("scheduler_step_us")}
    assert set(rows) == {"scheduler_step_us_256_decodes", "scheduler_step_us_prefill_mix"}, out
    assert float(rows["scheduler_step_us_256_decodes"][2]) == 256.0  # every step ran all 256 decodes


def test_bench_runner_host_smoke(capsys):
    out = smoke(capsys, "host/bench_runner_host")
    assert "256 decodes, median of 5 steps (us): execute_model" in out and "sampling inputs" in out, out


def test_bench_logprobs_stages_smoke(capsys):
    out = smoke(capsys, "host/bench_logprobs_stages")
    assert "8 rows, vocab 2000, logprobs=5" in out and "host total" in out, out


def test_bench_job_client_memory_smoke(capsys):
    out = smoke(capsys, "host/bench_job_client_memory")
    rec = json.loads(out.strip().splitlines()[-1])
    assert rec["lines"] == rec["completed"] == rec["resume_skipped"] == 2000, rec


# ---- tools -----------------------------------------------------------------------------------------


def test_summarize_trace_smoke(capsys):
    out = smoke(capsys, "tools/summarize_trace")
    assert "steps: 3 (annotations ['execute_model'])" in out and "aten::mm" in out, out
    assert "no GPU activity in this trace" in out


# ---- end to end, checks and host scripts with an engine (one shared local Ray) ----------------------
# Each starts one to four engines (driver and worker actors) on the module's one local Ray: they run in CI
# like every other smoke (about 1 minute in all on an idle 2-core machine, 4 on a loaded one).


def test_bench_control_plane_smoke(capsys, local_ray):
    out = smoke(capsys, "host/bench_control_plane")
    for transport in ("shm", "compiled_graph", "actor_calls"):
        assert f"tp=2 transport={transport}" in out, out


def test_bench_logprobs_host_path_smoke(capsys, local_ray):
    out = smoke(capsys, "host/bench_logprobs_host_path")
    assert out.count("32 tokens in") == 4 and "logprobs: " in out and " x base" in out, out


def test_bench_api_features_smoke(capsys, local_ray):
    out = smoke(capsys, "e2e/bench_api_features")
    assert out.count("48 tokens in") == 5, out  # base, logprobs, n4, stop, base_again: every token came
    for name in ("logprobs", "n4", "stop"):
        assert f"{name}: " in out, out
    assert out.count("x base (smoke, not recorded)") == 3, out


def test_bench_decode_idle_smoke(capsys, local_ray):
    out = smoke(capsys, "e2e/bench_decode_idle", "--configs", "graphs_async")  # one engine, not four
    row = next(line.split() for line in out.splitlines() if line.startswith("graphs_async"))
    assert float(row[-1]) > 0, out  # e2e tok/s (no CUDA events on the CPU: the idle columns are "-")


def test_bench_families_smoke(capsys, local_ray, tmp_path):
    out = smoke(capsys, "e2e/bench_families", "--model-dir", str(tmp_path))
    for shape in ("gemma-3-12b", "qwen3-30b-a3b"):
        assert f"{shape} (tiny, CPU): 6 requests, 48 tokens in" in out, out


def test_check_tp_smoke(capsys, local_ray):
    out = smoke(capsys, "checks/check_tp")
    assert "TP=2 vs TP=1: 6/6 sequences identical" in out and "TP greedy check (float32): PASS" in out, out


def test_check_bf16_divergence_smoke(capsys, local_ray):
    out = smoke(capsys, "checks/check_bf16_divergence")
    assert "kvray fp32 == HF fp32: every sequence identical" in out, out


def test_bench_tp_scaling_smoke(capsys, local_ray, tmp_path):
    out = smoke(capsys, "e2e/bench_tp_scaling", "--model-dir", str(tmp_path))
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("TP")}
    assert set(rows) == {"TP1", "TP2"} and all(float(r[-1]) > 0 for r in rows.values()), out


def test_bench_offline_counts_an_fp8_cache_at_one_byte_a_value():
    mod = load("e2e/bench_offline")
    bf16 = mod.kv_bytes_per_token("llama-3.1-8b")
    assert bf16 == 2 * 2 * 32 * 8 * 128  # K and V, bf16, 32 layers of 8 KV heads of 128
    assert (
        mod.kv_bytes_per_token("llama-3.1-8b", "fp8") == mod.kv_bytes_per_token("llama-3.1-8b", "fp8_e5m2") == bf16 // 2
    )
    assert mod.kv_bytes_per_token("llama-3.1-8b", "auto") == bf16
