"""kvray beside vLLM on the same GPU: vLLM's side of the offline workloads, and the ratios.

The vs-vllm suite (benchmarks/suites.yaml) runs kvray's side with bench_offline (nano recipe on the
Qwen3-0.6B shape, ShareGPT-like on the Llama-3.1-8B shape) and bench_batch1_decode, then vLLM's side with
this script, then the ratios. vLLM is not on the GPU image: it arrives in three device calls to one warm
machine (../shared/gpu/vllm/README.md), so the three parts run apart and meet in $KVRAY_RESULTS_MIRROR
(a folder under /tmp that every record() also writes to).

  vllm WORKLOAD MODEL_DIR   runs ../shared/gpu/vllm's vllm_bench.py (carried as .gpu/vllm/vllm_bench.py) under
                            $VLLM_PY (set by .gpu/vllm/install.sh) on bench_offline's workload and model dir, and
                            records vllm_<workload>_tok_s and vllm_<workload>_init_s (vs_vllm series)
  ratio                     reads both sides' latest figures from the mirror folder and records
                            nano_vs_vllm_ratio, sharegpt_vs_vllm_ratio (kvray tok/s over vLLM's, defaults, bf16)
                            and batch1_vs_vllm_ratio (vLLM's ms per token over kvray's); both sides must name
                            the same device

  python -m benchmarks.e2e.vs_vllm vllm nano /tmp/kvray-models/qwen3-0.6b-bfloat16
  python -m benchmarks.e2e.vs_vllm ratio --from /tmp/kvray-vs-vllm
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import RESULTS_DIR, latest, record

SERIES = "vs_vllm"
DEFAULT_MIRROR = "/tmp/kvray-vs-vllm"


@dataclass(frozen=True)
class Ratio:
    """One ratio: kvray's figure (series, metric) against vLLM's; `higher_is_better` orders the division."""

    metric: str
    kvray: tuple[str, str]
    vllm: tuple[str, str]
    higher_is_better: bool
    optional: bool = False  # its vLLM side is a part of its own (vllm-decode), run when a call has room


RATIOS = (
    Ratio("nano_vs_vllm_ratio", ("bench_offline", "offline_qwen3_0p6b_nano_tok_s"), (SERIES, "vllm_nano_tok_s"), True),
    Ratio(
        "sharegpt_vs_vllm_ratio",
        ("bench_offline", "offline_llama8b_output_tok_s"),
        (SERIES, "vllm_sharegpt_tok_s"),
        True,
    ),
    Ratio(
        "batch1_vs_vllm_ratio",
        ("bench_batch1_decode", "batch1_ms_per_token_llama8b"),
        (SERIES, "vllm_batch1_ms_per_token_llama8b"),
        False,
        optional=True,
    ),
)


def run_vllm_bench(workload: str, model_dir: str, script: str) -> list[dict]:
    """vllm_bench.py WORKLOAD MODEL_DIR defaults under $VLLM_PY; its VLLMBENCH records."""
    vllm_py = os.environ.get("VLLM_PY")
    if not vllm_py:
        raise SystemExit("VLLM_PY is not set: `source .gpu/vllm/install.sh` first (../shared/gpu/vllm/README.md)")
    if not Path(script).is_file():
        raise SystemExit(f"--script {script}: no such file (carry .gpu/vllm/vllm_bench.py in this call)")
    cmd = [*shlex.split(vllm_py), script, workload, model_dir, "defaults"]
    print("vLLM:", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(proc.stdout[-4000:])
    recs = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("VLLMBENCH ")]
    if proc.returncode != 0 or not recs:
        raise SystemExit(f"vllm_bench.py {workload} failed (rc={proc.returncode}, {len(recs)} records)")
    return recs


def ratio(folder: Path) -> int:
    """Record every ratio whose two figures are in `folder`; 1 when a required one is missing or the devices
    differ (an optional ratio without its figures is named and skipped)."""
    missing = 0
    for r in RATIOS:
        k, v = latest(folder, *r.kvray), latest(folder, *r.vllm)
        if k is None or v is None:
            skipped = " (optional: skipped)" if r.optional else ""
            which = r.kvray[1] if k is None else r.vllm[1]
            print(f"{r.metric}: no figure for {which} in {folder}{skipped}", flush=True)
            missing += not r.optional
            continue
        if k["device"] != v["device"]:
            raise SystemExit(f"{r.metric}: kvray ran on {k['device']!r}, vLLM on {v['device']!r}: not side by side")
        value = k["value"] / v["value"] if r.higher_is_better else v["value"] / k["value"]
        print(f"{r.metric}: kvray {k['value']:g} ({k['commit']}) / vLLM {v['value']:g} -> {value:.3f}", flush=True)
        record(SERIES, r.metric, value, "x", device=k["device"])
    return 1 if missing else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("vllm", help="vLLM's side of one bench_offline workload")
    v.add_argument("workload", choices=["nano", "sharegpt"])
    v.add_argument("model_dir")
    v.add_argument("--script", default=".gpu/vllm/vllm_bench.py", help="vllm_bench.py as carried to the device")
    r = sub.add_parser("ratio", help="both sides' latest figures -> the ratios")
    r.add_argument("--from", dest="folder", default=os.environ.get("KVRAY_RESULTS_MIRROR", DEFAULT_MIRROR))
    args = ap.parse_args(argv)
    if args.cmd == "ratio":
        folder = Path(args.folder)
        if not folder.is_dir():
            print(f"--from {folder}: no such folder; reading {RESULTS_DIR}", flush=True)
            folder = RESULTS_DIR
        return ratio(folder)
    for rec in run_vllm_bench(args.workload, args.model_dir, args.script):
        if rec["produced"] != rec["output_tokens"]:
            raise SystemExit(f"vLLM produced {rec['produced']} tokens, not {rec['output_tokens']}")
        record(SERIES, f"vllm_{args.workload}_tok_s", rec["tok_s"], "tok/s")
        record(SERIES, f"vllm_{args.workload}_init_s", rec["init_s"], "s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
