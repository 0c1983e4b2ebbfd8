"""Paged attention with head size 256 in float32 (Gemma in fp32) on the GPU: every Triton compile as it
happens (kernel, seconds, tiles) and the result against the torch reference, for the default tile choice
(with its OutOfResources fallback) and for explicit small tiles, each in its own bounded process.

  python -m benchmarks.checks.check_head256_fp32 --timeout 60
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def child(kind: str, block_m: int, block_n: int) -> None:
    import torch

    import tests.test_attention_kernels as t
    from actors.profiling import compile_log
    from kvcore.kernels import paged_attention as pa

    log = compile_log.install()
    if log is not None:  # print each compile when it ends, so a hang shows which one was last
        after = log.after_compile

        def loud(**kw: Any) -> Any:
            after(**kw)
            e = log.events[-1]
            print(f"  compiled {e.kernel} in {e.took_s:.1f} s", flush=True)

        from triton import knobs

        knobs.runtime.jit_post_compile_hook = loud
    b = t.make_batch(*t.SHAPES[kind], 16, 8, 256, 16, torch.float32, seed=1)
    b = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in b.items()}
    ref = t.run_attention(b, 0.0625, None, "torch")
    kw = {} if not block_m else {"block_m": block_m, "block_n": block_n}
    t0 = time.perf_counter()
    out = t.run_attention(b, 0.0625, None, "triton", **kw)
    torch.cuda.synchronize()
    err = (out - ref).abs().nan_to_num(0).max().item()
    print(
        f"RESULT {kind} tiles={kw or 'default'}: {time.perf_counter() - t0:.1f} s, max err {err:.2e}, "
        f"fitted {pa.FITTED_TILES}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--child", nargs=3)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return
    for kind, bm, bn in (("mixed", 0, 0), ("mixed", 16, 32), ("mixed", 32, 16)):
        print(f"== {kind} block_m={bm or 'default'} block_n={bn or 'default'}", flush=True)
        try:
            subprocess.run(
                [sys.executable, "-m", "benchmarks.checks.check_head256_fp32", "--child", kind, str(bm), str(bn)],
                timeout=args.timeout,
                cwd=ROOT,
                env={**os.environ, "TRITON_INTERPRET": "0"},
            )
        except subprocess.TimeoutExpired:
            print(f"TIMEOUT after {args.timeout:g} s", flush=True)


if __name__ == "__main__":
    main()
