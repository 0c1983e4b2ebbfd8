"""Start-up's dry passes (actors/worker/compile_ahead.py): on Triton's own JIT for sm_90 (the cases of
tests/compile_ahead_sm90_cases.py, in a process without the interpreter), and the engine's wiring on the CPU,
with a recording stand-in for the compiler.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.worker import compile_ahead as ca

ROOT = Path(__file__).resolve().parents[1]


def test_the_dry_pass_on_triton_s_own_jit_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    cases = "tests/compile_ahead_sm90_cases.py"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", cases],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and "9 passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]


def test_nothing_runs_dry_off_the_gpu_or_without_threads():
    called = []
    assert ca.compile_ahead(lambda: called.append(1), torch.device("cpu"), threads=4) is None
    assert ca.compile_ahead(lambda: called.append(1), torch.device("cuda"), threads=0) is None
    assert called == []


def test_a_pass_s_fingerprint_follows_its_parts_and_the_environment(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("KVRAY_SOME_KNOB", raising=False)
    base = ca.pass_fingerprint(cpu, "buckets", (3, ["full"]), 64)
    assert base == ca.pass_fingerprint(cpu, "buckets", (3, ["full"]), 64)  # stable from start to start
    assert base != ca.pass_fingerprint(cpu, "buckets", (4, ["full"]), 64)
    assert base != ca.pass_fingerprint(cpu, "profile", (3, ["full"]), 64)
    monkeypatch.setenv("KVRAY_SOME_KNOB", "1")  # a kernel switch read from the environment
    assert base != ca.pass_fingerprint(cpu, "buckets", (3, ["full"]), 64)


def test_the_pool_size_comes_from_the_environment_or_the_cpus(monkeypatch):
    monkeypatch.delenv(ca.THREADS_ENV, raising=False)
    cpus = len(ca.os.sched_getaffinity(0))
    assert ca.compile_threads() == max(1, min(ca.MAX_THREADS, cpus))
    assert ca.compile_threads(ranks_per_engine=10**6) == 1
    monkeypatch.setenv(ca.THREADS_ENV, "0")
    assert ca.compile_threads() == 0
    monkeypatch.setenv(ca.THREADS_ENV, "6")
    assert ca.compile_threads(ranks_per_engine=4) == 6
    for bad, rule in (("-1", "must be >= 0"), ("many", "must be an integer")):
        monkeypatch.setenv(ca.THREADS_ENV, bad)
        with pytest.raises(ValueError, match=f"{ca.THREADS_ENV}.*{rule}"):
            ca.compile_threads()


def test_the_engine_runs_the_profile_forward_and_every_bucket_dry_before_the_real_ones(monkeypatch, tmp_path):
    """On the CPU nothing compiles, so a stand-in for compile_ahead records what each dry pass runs: the
    profile forward before the profile run, every bucket the capture will warm (with graphs on) and the
    sampler's variants before the capture, each run once more for real afterwards."""
    from hf_models import save_hf_model
    from test_cuda_graph_padding import RecordedGraphs, make_config

    import actors.worker.forward as fw
    import actors.worker.model_runner as mr
    from actors.driver.engine_core import EngineCore
    from actors.executor.local import LocalExecutor

    events: list[str] = []
    passes: list[list[str]] = []

    def dry(fn, device, threads, fingerprint=None, agree=None):
        start = len(events)
        fn()
        passes.append(events[start:])
        del events[start:]
        events.append("dry pass")
        return ca.CompiledAhead(variants=0, wall_s=0.0)

    forward = fw.GraphRunner._bucket_forward
    profile = mr.ModelRunner._profile_forward
    sampler = mr.warm_sampler
    monkeypatch.setattr(mr, "compile_ahead", dry)
    monkeypatch.setattr(fw.GraphRunner, "_bucket_forward", lambda self, b: events.append(f"{b}") or forward(self, b))
    monkeypatch.setattr(mr.ModelRunner, "_profile_forward", lambda self: events.append("profile") or profile(self))
    monkeypatch.setattr(mr, "warm_sampler", lambda *a: events.append("sampler") or sampler(*a))
    monkeypatch.setattr(fw, "StepGraphs", RecordedGraphs)
    monkeypatch.setattr(fw.GraphRunner, "graphs_unavailable", lambda self: None)
    save_hf_model("qwen3", str(tmp_path))
    config = make_config(str(tmp_path), "torch", tight=False)
    with LocalExecutor(config) as executor:
        EngineCore(config, executor)
        runner = executor.worker.model_runner
        buckets = [f"{b}" for b in runner.graph_runner.plan.buckets()]
        assert [p.variants for p in runner.compiled_ahead] == [0, 0]
    assert passes[0] == ["profile"]
    assert passes[1] == [*buckets, "sampler"]
    assert events[:2] == ["dry pass", "profile"]
    assert events[2] == "dry pass" and sorted(events[3:-1]) == sorted(buckets)  # the capture: each bucket for real
    assert events[-1] == "sampler"
    assert np.unique(buckets).size == len(buckets) > 5
