"""The fp8 kernels compile for the H200 (sm_90) on this GPU-less machine: benchmarks/checks/check_sm90_compile.py
records every variant the fp8 tests launch under the interpreter and compiles each down to a cubin. The fp8
paths were written in sessions whose device calls got no machine, and a compile error on the GPU (a global
read without tl.constexpr, which the interpreter allows) would cost a whole device call.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = "benchmarks.checks.check_sm90_compile"


def run_tool(*args: str, extra_path: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), extra_path) if p)
    return subprocess.run(
        [sys.executable, "-m", TOOL, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


def test_the_fp8_kernels_compile_for_sm90():
    r = run_tool("tests/test_fp8_linear.py", "tests/test_fp8_kv_cache.py", "-k", "not rules and not engine")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    summary = [line for line in r.stdout.splitlines() if line.startswith("sm_90:")]
    assert summary, r.stdout[-2000:]
    compiled, total = (int(w) for w in summary[0].split()[1:4:2])
    assert compiled == total >= 40, summary  # the quantizer, the small-M GEMM, cache writes, attention over fp8
    assert "_small_m_kernel" in r.stdout and "FP8_DOT_F16': True" in r.stdout


def test_the_sampler_with_every_logits_processor_compiles_for_sm90():
    """Logit rows, conditional bans and min_p with penalties and filters: the variant first written reused
    the name `last` the vocabulary-share merge rebinds to a mask, which the interpreter ran and sm_90 refused."""
    r = run_tool("tests/test_sampler.py", "-k", "logit_rows_bans")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "'HAS_BAN_PREV': True" in r.stdout and "'HAS_MIN_P': True" in r.stdout and "'HAS_ROW': True" in r.stdout
    summary = [line for line in r.stdout.splitlines() if line.startswith("sm_90:")]
    compiled, total = (int(w) for w in summary[0].split()[1:4:2])
    assert compiled == total >= 2, summary


def test_the_check_reports_a_kernel_the_gpu_would_refuse(tmp_path):
    (tmp_path / "bad_kernel.py").write_text(
        "import triton\nimport triton.language as tl\nLIMIT = 3.0\n\n\n"
        "@triton.jit\ndef clamp_kernel(x_ptr, n, BLOCK: tl.constexpr):\n"
        "    offs = tl.arange(0, BLOCK)\n"
        "    x = tl.load(x_ptr + offs, mask=offs < n)\n"
        "    tl.store(x_ptr + offs, tl.minimum(x, LIMIT), mask=offs < n)\n"
    )
    spec = {"kernel": "bad_kernel:clamp_kernel", "signature": {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
            "constexprs": {"BLOCK": 64}, "options": {"num_warps": 4}}  # fmt: skip
    specs = tmp_path / "specs.jsonl"
    specs.write_text(json.dumps(spec) + "\n")
    r = run_tool("--compile-from", str(specs), extra_path=str(tmp_path))
    assert r.returncode == 1 and "FAIL clamp_kernel" in r.stdout and "LIMIT" in r.stdout, r.stdout + r.stderr
    assert "sm_90: 0 of 1 kernel variants compiled" in r.stdout
