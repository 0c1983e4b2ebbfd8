"""Compile every Triton kernel variant a test run launches for the H200 (sm_90), on a machine with no GPU.

The CPU tests run the kernels under TRITON_INTERPRET=1, which executes their Python and never compiles them,
so a kernel that the interpreter runs can still fail to compile on the GPU: a global read without
tl.constexpr, a dtype the MMA refuses, a layout the lowering cannot build. Device time is scarce, and such a
failure costs a whole call. This check closes that gap in two steps:
1. record: the given pytest targets run under the interpreter, and every launch's kernel, argument types,
   constexpr values and launch options are written down (one line per distinct variant); a kernel with a
   USE_PDL switch (off under the interpreter) is also compiled with it on, as a Hopper GPU launches it;
2. compile: in a fresh process without the interpreter, each variant goes through triton.compile for
   GPUTarget("cuda", 90, 32), down to the cubin (Triton's wheel carries ptxas), on --threads threads (default:
   the CPUs). With an empty TRITON_CACHE_DIR, `--threads 1` beside a larger count times the parallel compile.
Exit code 0 when every variant compiles. The GPU's own Triton may be older; this catches what any version
rejects at the front end, and the PTX a recent one produces.

  python -m benchmarks.checks.check_sm90_compile tests/test_fp8_linear.py tests/test_fp8_kv_cache.py
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl")
TORCH_TO_TRITON = {
    "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64",
    "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1",
}  # fmt: skip


def arg_type(value: Any) -> str:
    """Triton's signature type of a runtime argument, as its launcher would derive it."""
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return "*" + TORCH_TO_TRITON[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def is_constexpr(annotation: Any) -> bool:
    return "constexpr" in (annotation if isinstance(annotation, str) else getattr(annotation, "__name__", ""))


def spec_of(fn: Any, args: tuple, kwargs: dict) -> dict:
    """One launch as {kernel, signature, constexprs, options}; None arguments are constexprs, as in Triton."""
    import inspect

    params = list(inspect.signature(fn).parameters.values())
    # Positional arguments fill the leading parameters; the rest come by keyword (constexprs), so args is shorter.
    values = dict(zip((p.name for p in params), args, strict=False))
    values.update({k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    signature, constexprs = {}, {}
    for p in params:
        v = values.get(p.name, p.default)
        if is_constexpr(p.annotation) or v is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = v.value if hasattr(v, "value") else v
        else:
            signature[p.name] = arg_type(v)
    options = {k: kwargs[k] for k in LAUNCH_OPTIONS if kwargs.get(k) is not None}
    return {"kernel": f"{fn.__module__}:{fn.__name__}", "signature": signature, "constexprs": constexprs,
            "options": options}  # fmt: skip


def record(out: Path, pytest_args: list[str]) -> int:
    """Run pytest under the interpreter with every launch recorded into `out` (distinct variants)."""
    import pytest
    from triton.runtime.interpreter import InterpretedFunction

    seen: set[str] = set()
    run = InterpretedFunction.run

    def recording_run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        line = json.dumps(spec_of(self.fn, args, kwargs), sort_keys=True, default=str)
        if line not in seen:
            seen.add(line)
            with out.open("a") as f:
                f.write(line + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    return int(pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args]))


def pdl_variant(spec: dict) -> dict:
    """The variant a Hopper GPU launches: USE_PDL on, launched with programmatic dependent launch."""
    return dict(spec, constexprs=dict(spec["constexprs"], USE_PDL=True), options=dict(spec["options"], launch_pdl=True))


def compile_all(specs_path: Path, only: str | None = None, threads: int = 1) -> int:
    """Compile each recorded variant (those whose line matches `only`, a regex) for sm_90 on `threads` threads
    (Triton compiles outside the GIL, as the engine's start-up does: actors/worker/compile_ahead.py); print each
    with its time, and the failures; the number of failures."""
    import re
    from concurrent.futures import ThreadPoolExecutor

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    lines = [line for line in specs_path.read_text().splitlines() if only is None or re.search(only, line)]
    specs = [json.loads(line) for line in lines]
    # The interpreter records USE_PDL off; on an sm_90 GPU those kernels launch with it on (kvcore/kernels/pdl.py).
    specs += [pdl_variant(spec) for spec in specs if spec["constexprs"].get("USE_PDL") is False]
    kernels = {}
    for spec in specs:  # imported here, not in the threads: an import is no place for a race
        module, name = spec["kernel"].split(":")
        kernels[spec["kernel"]] = getattr(importlib.import_module(module), name)

    def one(spec: dict) -> bool:
        name = spec["kernel"].split(":")[1]
        src = ASTSource(fn=kernels[spec["kernel"]], signature=spec["signature"], constexprs=spec["constexprs"])
        t = time.perf_counter()
        try:
            triton.compile(src, target=target, options=spec["options"])
            print(f"ok   {time.perf_counter() - t:5.1f} s  {name} {spec['constexprs']}", flush=True)
            return True
        except Exception as e:  # noqa: BLE001
            # Broad on purpose: a compile error of any kind (the compiler's own, an assertion in a pass) is
            # the finding; it is counted and printed, and the next variant compiles.
            print(f"FAIL {name} {spec['constexprs']} {spec['options']}\n  {str(e)[:2000]}", flush=True)
            return False

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, threads)) as pool:
        failed = sum(not ok for ok in pool.map(one, specs))
    wall = time.perf_counter() - t0
    print(f"sm_90: {len(specs) - failed} of {len(specs)} kernel variants compiled in {wall:.1f} s on {threads} threads")
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("targets", nargs="*", help="pytest targets: test files, then any pytest option (-k ...)")
    ap.add_argument("--only", help="compile only the variants whose record matches this regex")
    ap.add_argument("--keep", help="keep the recorded variants in this file (JSON lines)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="compile on this many threads")
    ap.add_argument("--record-to", help=argparse.SUPPRESS)  # the recording child process
    ap.add_argument("--compile-from", help=argparse.SUPPRESS)  # the compiling child process
    args, rest = ap.parse_known_args(argv)
    if args.record_to:
        return record(Path(args.record_to), args.targets + rest)
    if args.compile_from:
        return min(compile_all(Path(args.compile_from), args.only, args.threads), 1)
    if not args.targets:
        ap.error("name the pytest targets whose kernel launches to compile")
    with tempfile.TemporaryDirectory() as tmp:
        specs = Path(tmp) / "specs.jsonl"
        me, env = [sys.executable, "-m", "benchmarks.checks.check_sm90_compile"], dict(os.environ, PYTHONPATH=str(ROOT))
        rc = subprocess.call([*me, *args.targets, *rest, "--record-to", str(specs)], cwd=ROOT,
                             env=dict(env, TRITON_INTERPRET="1"))  # fmt: skip
        if rc != 0 or not specs.exists():
            print(f"recording failed: pytest exit {rc}")
            return 1
        if args.keep:
            Path(args.keep).write_text(specs.read_text())
        env.pop("TRITON_INTERPRET", None)
        only = ["--only", args.only] if args.only else []
        return subprocess.call(
            [*me, "--compile-from", str(specs), *only, "--threads", str(args.threads)], cwd=ROOT, env=env
        )


if __name__ == "__main__":
    sys.exit(main())
