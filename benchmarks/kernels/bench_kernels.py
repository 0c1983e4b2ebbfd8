"""Every kernel benchmark in one command: paged attention against SDPA (bench_attention.py), slot mapping
and the block-table commit, full rows against delta (bench_block_table.py), and the fused layer kernels
against their torch references (bench_layer_kernels.py). Each script stays runnable on its own and
records its own figures; this one runs them in order, in separate processes (each sets up its own
device state), with the same flags.

  python benchmarks/kernels/bench_kernels.py            # GPU
  python benchmarks/kernels/bench_kernels.py --smoke    # CPU, tiny sizes, Triton interpreter
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPTS = ("bench_attention.py", "bench_block_table.py", "bench_layer_kernels.py")


def main() -> int:
    here = Path(__file__).resolve().parent
    failed = []
    for script in SCRIPTS:
        print(f"== {script}", flush=True)
        rc = subprocess.call([sys.executable, str(here / script), *sys.argv[1:]])
        if rc:
            failed.append(f"{script} (rc={rc})")
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
