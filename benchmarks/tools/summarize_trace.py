"""Summarize a torch.profiler Chrome trace of kvray worker steps (`kvray run --profile DIR`, written by
actors/profiling/step_profiler.py, one JSON per worker rank).

Prints, per trace:
  - the top GPU kernels by total time: name (truncated), count, total ms, mean us, share of kernel time
  - the steps: wall time, GPU kernels launched, GPU busy time; then GPU busy time (the union of kernel,
    memcpy and memset intervals on every stream) against the wall time from the first step's start to
    the last step's end
  - the top CPU ops by self time (count, self ms, inclusive ms, mean inclusive us), and the CUDA runtime
    calls when there are any (cudaLaunchKernel, cudaGraphLaunch, cudaStreamSynchronize, ...)

Steps: user annotations matching --step-marker (ProfilerStep#N, which torch writes only when the
profiler has a schedule, which StepProfiler does not use; or a record_function such as "execute_model")
when the trace has them. Otherwise they are inferred: every step runs one forward, which shows up as one
aten::embedding (eager) or one cudaGraphLaunch (a replayed CUDA graph), and consecutive steps are cut at
the largest host gap between them (the worker waiting for the driver's next step). With neither, the
host gaps alone decide (the N-1 largest with --steps N, else those above the largest jump in the sorted
gap sizes). Kernels count for the step in which they were launched (their CUDA runtime call, matched by
correlation id). A CPU-only trace has no GPU sections, which is said, not failed.

  python -m benchmarks.tools.summarize_trace /tmp/trace/                    # every *.json(.gz) in the folder
  python -m benchmarks.tools.summarize_trace trace.json --top 40 --steps 5
  python -m benchmarks.tools.summarize_trace --smoke      # a CPU trace of 3 annotated steps, summarized (CI)
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import itertools
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver"}
DEFAULT_MARKER = r"^(ProfilerStep#\d+|execute_model|kvray[ _:.-]?step.*)$"
ANCHOR_OP, ANCHOR_RUNTIME = "aten::embedding", "cudaGraphLaunch"  # once per step's forward


def by_name(events: list[dict]) -> dict[str, list[float]]:
    """name -> [count, total duration in us]."""
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        a = agg[e["name"]]
        a[0] += 1
        a[1] += e["dur"]
    return agg


def load_events(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def trunc(name: str, width: int) -> str:
    """One line of at most `width` characters: the head and the tail of a long (templated) name."""
    name = " ".join(name.split())
    if name.startswith("void "):
        name = name[5:]
    if len(name) <= width:
        return name
    head = (width - 3) * 2 // 3
    return name[:head] + "..." + name[len(name) - (width - 3 - head) :]


def union_length(intervals: list[tuple[float, float]], lo: float | None = None, hi: float | None = None) -> float:
    """Total length covered by the intervals (clipped to [lo, hi] when given)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if lo is not None:
            s = max(s, lo)
        if hi is not None:
            e = min(e, hi)
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def top_level(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events not nested inside another one of the same thread, in time order."""
    out, end = [], {}
    for e in sorted(events, key=lambda e: (str(e.get("tid")), e["ts"], -e["dur"])):
        t = str(e.get("tid"))
        if e["ts"] >= end.get(t, float("-inf")):
            out.append(e)
            end[t] = e["ts"] + e["dur"]
    return sorted(out, key=lambda e: e["ts"])


def self_times(events: list[dict[str, Any]]) -> dict[int, float]:
    """id(event) -> its duration minus that of its direct children (same thread, nested in time)."""
    selfs: dict[int, float] = {}
    by_tid: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_tid[str(e.get("tid"))].append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict[str, Any]] = []
        for e in evs:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            selfs[id(e)] = e["dur"]
            if stack:
                selfs[id(stack[-1])] -= min(e["dur"], stack[-1]["ts"] + stack[-1]["dur"] - e["ts"])
            stack.append(e)
    return selfs


@dataclass
class Steps:
    intervals: list[tuple[float, float]]
    how: str


def find_steps(events: list[dict[str, Any]], marker: str, n_steps: int | None) -> Steps:
    pat = re.compile(marker)
    marks = sorted(
        (
            e
            for e in events
            if e.get("cat") in ("user_annotation", "cpu_instant_event", "cpu_op") and pat.match(str(e.get("name", "")))
        ),
        key=lambda e: e["ts"],
    )
    if marks:
        names = sorted({m["name"].split("#")[0] for m in marks})
        return Steps([(m["ts"], m["ts"] + m["dur"]) for m in top_level(marks)], f"annotations {names}")
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    if not ops:
        return Steps([], "no CPU ops")
    # Every step runs one forward: eagerly (one aten::embedding, the token embedding) or as one CUDA
    # graph replay (one cudaGraphLaunch). The thread with the most of those runs the steps (Ray's
    # execution thread under compiled graphs); failing that, the one with the most CPU ops.
    anchors_by_tid: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if (e.get("cat") == "cpu_op" and e.get("name") == ANCHOR_OP) or (
            e.get("cat") in RUNTIME_CATS and e.get("name") == ANCHOR_RUNTIME
        ):
            anchors_by_tid[str(e.get("tid"))].append(e["ts"])
    per_tid: dict[str, int] = defaultdict(int)
    for e in ops:
        per_tid[str(e.get("tid"))] += 1
    main_tid = (
        max(anchors_by_tid, key=lambda t: len(anchors_by_tid[t])) if anchors_by_tid else max(per_tid, key=per_tid.get)
    )
    top = top_level([e for e in ops if str(e.get("tid")) == main_tid])
    gap_at = [(top[i + 1]["ts"] - (top[i]["ts"] + top[i]["dur"]), i) for i in range(len(top) - 1)]
    gaps = sorted(gap_at, reverse=True)
    cuts: list[int] = []
    anchors = sorted(set(anchors_by_tid.get(main_tid, [])))
    if len(anchors) >= 1 and gap_at:
        # One cut between consecutive forwards: at the largest host gap there (the wait for the next step).
        starts = [e["ts"] for e in top]
        for a, b in itertools.pairwise(anchors):
            lo_i, hi_i = bisect.bisect_right(starts, a) - 1, bisect.bisect_left(starts, b) - 1
            inside = [g for g in gap_at[max(lo_i, 0) : max(hi_i, 0)]]
            if inside:
                cuts.append(max(inside)[1])
        cuts = sorted(set(cuts))
        how = (
            f"inferred: {len(anchors)} forwards ({ANCHOR_OP} or {ANCHOR_RUNTIME}), cut at the largest "
            f"host gap between consecutive ones"
        )
        if n_steps is not None and n_steps != len(anchors):
            how += f"; NOTE --steps {n_steps} differs, the forwards were used"
    elif n_steps is not None and n_steps > 1:
        cuts = sorted(i for _, i in gaps[: n_steps - 1])
        how = f"inferred: the {n_steps - 1} largest host gaps (--steps {n_steps})"
    elif len(gaps) >= 2:
        head = [max(g, 1e-3) for g, _ in gaps[: min(len(gaps), 256)]]
        ratios = [head[k] / head[k + 1] for k in range(len(head) - 1)]
        k = max(range(len(ratios)), key=ratios.__getitem__)
        if ratios[k] >= 3.0:
            cuts = sorted(i for _, i in gaps[: k + 1])
            how = (
                f"inferred: host gaps >= {head[k] / 1e3:.3f} ms between top-level CPU ops (next largest "
                f"{head[k + 1] / 1e3:.3f} ms; pass --steps N if the profiled step count is known)"
            )
        else:
            how = "inferred: no clear idle gap between steps, the whole trace taken as one step"
    else:
        how = "inferred: one step"
    bounds, start = [], 0
    for i in cuts + [len(top) - 1]:
        bounds.append((top[start]["ts"], max(e["ts"] + e["dur"] for e in top[start : i + 1])))
        start = i + 1
    return Steps(bounds, how + f", thread {main_tid}")


def summarize(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    events = load_events(path)
    print(f"\n=== {path}  ({len(events)} complete events)")
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    kernels = [e for e in gpu if e.get("cat") == "kernel"]
    runtime = [e for e in events if e.get("cat") in RUNTIME_CATS]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    out: dict[str, Any] = {"trace": str(path), "num_kernels": len(kernels)}

    # ---- GPU kernels -----------------------------------------------------------------------
    if kernels:
        agg = by_name(kernels)
        total = sum(a[1] for a in agg.values())
        rows = sorted(agg.items(), key=lambda kv: -kv[1][1])
        print(
            f"\nGPU kernels: {len(kernels)} launches of {len(agg)} kernels, {total / 1e3:.3f} ms in total; "
            f"top {min(args.top, len(rows))} by total time"
        )
        print(f"{'kernel':<{args.width}} {'count':>7} {'total ms':>10} {'mean us':>10} {'share':>7}")
        seen: dict[str, int] = {}
        for name, (cnt, dur) in rows[: args.top]:
            short = trunc(name, args.width)
            seen[short] = seen.get(short, 0) + 1
            if seen[short] > 1:  # two long names that differ only in the middle
                short = trunc(name, args.width - 5) + f" [{seen[short]}]"
            print(f"{short:<{args.width}} {cnt:>7d} {dur / 1e3:>10.3f} {dur / cnt:>10.1f} {dur / total:>7.1%}")
        out["top_kernels"] = [{"name": n, "count": c, "total_ms": d / 1e3} for n, (c, d) in rows[: args.top]]
    else:
        print("\nGPU kernels: none in this trace (a CPU-only run, or the profiler had no CUDA activity)")

    # ---- steps -----------------------------------------------------------------------------
    steps = find_steps(events, args.step_marker, args.steps)
    print(f"\nsteps: {len(steps.intervals)} ({steps.how})")
    if steps.intervals:
        starts = [s for s, _ in steps.intervals]
        launch_ts = {}
        for r in runtime:
            corr = (r.get("args") or {}).get("correlation")
            if corr is not None:
                launch_ts[corr] = r["ts"]
        per_step_kernels = [0] * len(steps.intervals)
        outside = 0
        lo, hi = steps.intervals[0][0], steps.intervals[-1][1]
        gpu_end = hi  # the GPU runs behind the host: the last step's work may end after its host side
        for k in gpu:
            t = launch_ts.get((k.get("args") or {}).get("correlation"), k["ts"])
            i = bisect.bisect_right(starts, t) - 1
            if i >= 0 and t <= steps.intervals[i][1]:
                gpu_end = max(gpu_end, k["ts"] + k["dur"])
                if k.get("cat") == "kernel":
                    per_step_kernels[i] += 1
            elif k.get("cat") == "kernel":
                outside += 1
        gpu_iv = [(e["ts"], e["ts"] + e["dur"]) for e in gpu]
        hi = gpu_end
        nexts = starts[1:] + [hi]
        print(f"{'step':>5} {'wall ms':>9} {'kernels':>8} {'GPU busy ms':>12}")
        step_rows = []
        for i, (s, e) in enumerate(steps.intervals):
            busy = union_length(gpu_iv, s, max(e, nexts[i])) if gpu else 0.0
            step_rows.append({"wall_ms": (e - s) / 1e3, "kernels": per_step_kernels[i], "gpu_busy_ms": busy / 1e3})
            print(f"{i:>5d} {(e - s) / 1e3:>9.3f} {per_step_kernels[i]:>8d} {busy / 1e3:>12.3f}")
        step_wall = sum(e - s for s, e in steps.intervals)
        window = hi - lo
        print(
            f"steps' wall time {step_wall / 1e3:.3f} ms (sum), {window / 1e3:.3f} ms from the first step's "
            f"start to the last one's end" + (" (its GPU work included)" if gpu else "")
        )
        out.update(steps=step_rows, steps_how=steps.how, steps_wall_ms=step_wall / 1e3, window_ms=window / 1e3)
        if gpu:
            busy = union_length(gpu_iv, lo, hi)
            print(
                f"GPU busy (kernels, memcpy, memset; union over streams) {busy / 1e3:.3f} ms = "
                f"{busy / max(window, 1e-9):.1%} of that window; GPU idle {1 - busy / max(window, 1e-9):.1%}"
            )
            print(
                f"GPU kernels per step: mean {sum(per_step_kernels) / len(per_step_kernels):.1f}"
                + (f"; {outside} kernels launched outside the steps" if outside else "")
            )
            out.update(gpu_busy_ms=busy / 1e3, gpu_busy_frac=busy / max(window, 1e-9))
        else:
            print("GPU busy time: n/a (no GPU activity in this trace)")

    # ---- CPU ops ---------------------------------------------------------------------------
    if cpu_ops:
        selfs = self_times(cpu_ops)
        agg2: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        for e in cpu_ops:
            a = agg2[e["name"]]
            a[0] += 1
            a[1] += selfs[id(e)]
            a[2] += e["dur"]
        rows2 = sorted(agg2.items(), key=lambda kv: -kv[1][1])
        total_self = sum(a[1] for a in agg2.values())
        print(
            f"\nCPU ops: {len(cpu_ops)} calls of {len(agg2)} ops, {total_self / 1e3:.3f} ms self time in total; "
            f"top {min(args.top_cpu, len(rows2))} by self time"
        )
        print(f"{'op':<{args.width}} {'count':>7} {'self ms':>10} {'incl ms':>10} {'mean us':>10}")
        for name, (cnt, s, incl) in rows2[: args.top_cpu]:
            print(
                f"{trunc(name, args.width):<{args.width}} {cnt:>7d} {s / 1e3:>10.3f} {incl / 1e3:>10.3f} "
                f"{incl / cnt:>10.1f}"
            )
        out["top_cpu_ops"] = [
            {"name": n, "count": c, "self_ms": s / 1e3, "incl_ms": i / 1e3} for n, (c, s, i) in rows2[: args.top_cpu]
        ]
    else:
        print("\nCPU ops: none in this trace")
    if runtime:
        rows3 = sorted(by_name(runtime).items(), key=lambda kv: -kv[1][1])
        print(f"\nCUDA runtime/driver calls (host side), top {min(10, len(rows3))} by total time")
        print(f"{'call':<{args.width}} {'count':>7} {'total ms':>10} {'mean us':>10}")
        for name, (cnt, dur) in rows3[:10]:
            print(f"{trunc(name, args.width):<{args.width}} {cnt:>7d} {dur / 1e3:>10.3f} {dur / cnt:>10.1f}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", help="trace files (.json or .json.gz) or folders holding them")
    p.add_argument("--top", type=int, default=25, help="GPU kernels to list")
    p.add_argument("--top-cpu", type=int, default=25, help="CPU ops to list")
    p.add_argument("--width", type=int, default=70, help="name column width")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="the number of profiled steps (kvray run "
        "--profile-steps), to split a marker-less trace at the N-1 largest host gaps",
    )
    p.add_argument("--step-marker", default=DEFAULT_MARKER, help="regex of the annotations marking steps")
    p.add_argument("--json", help="also write the summaries as JSON to this path")
    p.add_argument("--smoke", action="store_true", help="profile 3 CPU steps (torch.profiler) and summarize them")
    args = p.parse_args(argv)
    if args.smoke:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            args.paths = [write_cpu_trace(Path(d) / "smoke.json", steps=3)]
            return summarize_paths(args)
    if not args.paths:
        p.error("give trace files or folders (or --smoke)")
    return summarize_paths(args)


def write_cpu_trace(path: Path, steps: int) -> str:
    """A real torch.profiler Chrome trace of `steps` annotated CPU steps (the smoke's input)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("execute_model"):
                torch.nn.functional.embedding(torch.tensor([1, 2]), x)
                (x @ x).relu_()
    prof.export_chrome_trace(str(path))
    return str(path)


def summarize_paths(args: argparse.Namespace) -> int:
    files: list[Path] = []
    for s in args.paths:
        q = Path(s)
        if q.is_dir():
            files += sorted(q.glob("*.json")) + sorted(q.glob("*.json.gz"))
        elif q.exists():
            files.append(q)
        else:
            print(f"summarize_trace: {s}: no such file or folder", file=sys.stderr)
            return 2
    if not files:
        print("summarize_trace: no trace files found", file=sys.stderr)
        return 2
    summaries = [summarize(f, args) for f in files]
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
