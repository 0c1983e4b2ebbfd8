"""Worker.start_profile / stop_profile: a Chrome trace of the requested steps, started and stepped by the
thread that runs execute_model, written to the requested directory."""

import json
import os

import pytest

from actors.driver.engine_core import EngineCore
from actors.executor.local import LocalExecutor
from cluster.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kvcore.request import Request, SamplingParams


def test_profile_traces_the_requested_steps(tmp_path):
    config = EngineConfig(
        model=ModelConfig(model="tiny-random", dtype="float32"),
        parallel=ParallelConfig(device="cpu"),
        cache=CacheConfig(block_size=8, cpu_kv_cache_gib=0.01),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
    )
    with LocalExecutor(config) as executor:
        engine = EngineCore(config, executor)
        worker = executor.worker
        with pytest.raises(ValueError, match="num_steps"):
            worker.start_profile(str(tmp_path), -1)
        executor.collective_rpc("start_profile", str(tmp_path / "traces"), 3, 2)
        for i in range(3):
            engine.add_request(Request(f"r{i}", [5 + i, 6, 7, 8], SamplingParams(max_tokens=10, ignore_eos=True)))
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if steps == 4:
                assert worker.profiler.recording  # skipped 2, now recording
        assert steps >= 6
        # The 3 steps finished the trace on their own; stop returns it (and stops nothing else).
        paths = executor.collective_rpc("stop_profile")[0]
        assert len(paths) == 1 and paths[0].startswith(str(tmp_path / "traces"))
        with open(paths[0]) as f:
            trace = json.load(f)
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any(n.startswith("aten::") for n in names), sorted(names)[:20]
        assert executor.collective_rpc("stop_profile")[0] == []

        # Until stop (num_steps 0): stop finishes the trace itself.
        worker.start_profile(str(tmp_path / "open"), 0)
        engine.add_request(Request("q", [9, 9, 9], SamplingParams(max_tokens=3, ignore_eos=True)))
        while engine.has_unfinished():
            engine.step()
        (path,) = worker.stop_profile()
        assert os.path.getsize(path) > 0


def test_step_timer_host_phases_follow_the_marks():
    """Each execute_model call's host phases are differences of its marks; `outside` runs from one call's
    return to the next call's entry; a call without every mark (a lagged first call) is left out."""
    from actors.profiling.step_profiler import StepTimer

    clock = iter(
        [
            0.0,
            1.0,
            3.0,
            3.5,  # call 1: prepare 1, wait 2, complete 0.5 (s)
            10.0,
            10.25,  # call 2: entered and launched, never read tokens
            20.0,
            20.5,
            21.0,
            21.125,
        ]
    )  # call 3
    timer = StepTimer(clock=lambda: next(clock))
    for names in (StepTimer.HOST_MARKS, ("enter", "launched"), StepTimer.HOST_MARKS):
        for name in names:
            timer.mark(name)
    assert timer.host_phases() == [{"prepare_ms": 500.0, "wait_ms": 500.0, "complete_ms": 125.0, "outside_ms": 16500.0}]


def test_the_compile_log_records_each_variant_with_its_time():
    from actors.profiling.compile_log import CompileLog, install

    log = CompileLog()

    class Fn:
        name = "k"

    assert log.before_compile(key=1, repr="k[num_warps=4](x: *fp32)", fn=Fn()) is False  # False: Triton goes on
    log.after_compile(key=1, repr="k[num_warps=4](x: *fp32)", fn=Fn())
    mark = len(log.events)
    log.before_compile(repr="k2", fn=Fn())
    log.after_compile(repr="k2", fn=Fn())
    # The key carries the specialisations that tell variants apart; some Triton reprs list none.
    assert [e["signature"] for e in log.since(0)] == ["k[num_warps=4](x: *fp32) key=1", "k2"]
    assert [e["kernel"] for e in log.since(mark)] == ["k"]
    assert all(e["took_s"] >= 0 and e["started_s"] >= 0 for e in log.since(0))

    from triton import knobs

    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    try:
        installed = install()
        assert installed is not None and knobs.runtime.jit_cache_hook == installed.before_compile
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved
