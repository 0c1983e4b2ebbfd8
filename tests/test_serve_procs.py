"""The serving benchmarks' process meter and py-spy summary (benchmarks/e2e/serve_procs.py,
benchmarks/tools/summarize_pyspy.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from benchmarks.e2e import serve_procs
from benchmarks.tools import summarize_pyspy


def test_the_meter_counts_this_process_cpu() -> None:
    meter = serve_procs.ProcessMeter({"client": os.getpid()})
    meter.start()
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:
        pass
    cost = meter.stop(wall_s=0.3, output_tokens=1000)["client"]
    assert 0.2 <= cost["cpu_s"] <= 1.0
    assert cost["us_per_token"] == round(cost["cpu_s"] / 1000 * 1e6, 1)
    assert "client" in serve_procs.format_costs({"client": cost})


def test_processes_are_found_by_their_ray_title() -> None:
    # A child titled as Ray titles an actor's process (exec -a sets argv[0]).
    child = subprocess.Popen(["bash", "-c", "exec -a ray::EngineDriver.start sleep 30"])
    try:
        for _ in range(50):
            found = serve_procs.serve_processes()
            if "EngineDriver" in found:
                break
            time.sleep(0.05)
        assert found["client"] == os.getpid()
        assert found["EngineDriver"] == child.pid
        assert "Worker" not in found  # a title must name the class, not contain it
    finally:
        child.kill()
        child.wait()
    assert serve_procs.cpu_s(child.pid) == 0.0  # gone: no error


def test_the_pyspy_summary(tmp_path: Path) -> None:
    (tmp_path / "ServeReplica-1.txt").write_text(
        "main (a.py:1);loop (a.py:5);handle (b.py:9) 30\nmain (a.py:1);idle (c.py:2) 10\n"
    )
    own, anywhere, total = summarize_pyspy.read_folded(tmp_path / "ServeReplica-1.txt")
    assert total == 40 and own["handle (b.py:9)"] == 30 and anywhere["main (a.py:1)"] == 40
    text = summarize_pyspy.summarize(tmp_path / "ServeReplica-1.txt", top=3, budget=400)
    assert "40 samples (10% of 400" in text and " 75.0%  handle (b.py:9)" in text
