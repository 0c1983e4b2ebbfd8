"""kvray beside vLLM on the same GPU: vLLM's side of the offline workloads, and the ratios.

The vs-vllm suite (benchmarks/suites.yaml) runs kvray's side with bench_offline (nano recipe on the
Qwen3-0.6B shape with the defaults and the fp8 KV cache, ShareGPT-like on the Llama-3.1-8B shape with the
defaults and fp8 weights + KV cache), bench_startup and bench_batch1_decode, then vLLM's side with this script
on the same configurations, then the ratios. vLLM is not on the GPU image: it arrives in three device calls to
one warm machine (../shared/gpu/vllm/README.md), so the parts run apart and meet in $KVRAY_RESULTS_MIRROR (a
folder under /tmp that every record() also writes to).

  vllm WORKLOAD MODEL_DIR [--configs C ...]
                            runs ../shared/gpu/vllm's vllm_bench.py (carried as .gpu/vllm/vllm_bench.py) under
                            $VLLM_PY (set by .gpu/vllm/install.sh) on bench_offline's workload and model dir, one
                            engine per configuration (defaults, fp8kv, fp8, fp8w: vllm_bench.py's CONFIGS), and
                            records vllm_<workload>[_<config>]_tok_s and _init_s (vs_vllm series; no suffix for
                            the defaults)
  ratio                     reads both sides' latest figures from the mirror folder and records each ratio of
                            RATIOS whose two figures are there; both sides must name the same device

  python -m benchmarks.e2e.vs_vllm vllm nano /tmp/kvray-models/qwen3-0.6b-bfloat16 --configs defaults fp8kv
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
    """One ratio: kvray's figure (series, metric) against vLLM's. `kvray_over_vllm`: kvray's figure divided by
    vLLM's (throughput, start-up time), else vLLM's by kvray's (ms a token), so that each reads as the
    issue's target does."""

    metric: str
    kvray: tuple[str, str]
    vllm: tuple[str, str]
    kvray_over_vllm: bool
    optional: bool = False  # its figures come from a part or a configuration a call may leave out


RATIOS = (
    Ratio("nano_vs_vllm_ratio", ("bench_offline", "offline_qwen3_0p6b_nano_tok_s"), (SERIES, "vllm_nano_tok_s"), True),
    Ratio(
        "sharegpt_vs_vllm_ratio",
        ("bench_offline", "offline_llama8b_output_tok_s"),
        (SERIES, "vllm_sharegpt_tok_s"),
        True,
    ),
    # The opt-in fp8 paths against vLLM's same options: the fp8 KV cache on the nano recipe, fp8 weights and
    # KV cache on the ShareGPT-like workload.
    Ratio(
        "nano_fp8kv_vs_vllm_ratio",
        ("bench_offline", "offline_qwen3_0p6b_nano_fp8kv_tok_s"),
        (SERIES, "vllm_nano_fp8kv_tok_s"),
        True,
        optional=True,
    ),
    Ratio(
        "sharegpt_fp8_vs_vllm_ratio",
        ("bench_offline", "offline_llama8b_sharegpt_fp8_tok_s"),
        (SERIES, "vllm_sharegpt_fp8_tok_s"),
        True,
        optional=True,
    ),
    # Start-up: LLM(...) to ready, each engine's first start on the machine (kvray's Triton cache and vLLM's
    # compile cache cold). Target <= 0.5.
    Ratio(
        "startup_vs_vllm_ratio_qwen3_0p6b",
        ("bench_offline", "init_s_qwen3_0p6b_in_bench"),
        (SERIES, "vllm_nano_init_s"),
        True,
        optional=True,
    ),
    Ratio(
        "startup_vs_vllm_ratio_llama8b",
        ("bench_offline", "init_s_llama8b_in_bench"),
        (SERIES, "vllm_sharegpt_init_s"),
        True,
        optional=True,
    ),
    Ratio(
        "batch1_vs_vllm_ratio",
        ("bench_batch1_decode", "batch1_ms_per_token_llama8b"),
        (SERIES, "vllm_batch1_ms_per_token_llama8b"),
        False,
        optional=True,
    ),
)
VLLM_CONFIGS = ("defaults", "fp8kv", "fp8", "fp8w")  # vllm_bench.py's CONFIGS


def vllm_metric(workload: str, config: str, what: str) -> str:
    """vllm_<workload>_<what> for the defaults, vllm_<workload>_<config>_<what> for another configuration."""
    return f"vllm_{workload}_{what}" if config == "defaults" else f"vllm_{workload}_{config}_{what}"


def run_vllm_bench(workload: str, model_dir: str, script: str, configs: list[str]) -> list[dict]:
    """vllm_bench.py WORKLOAD MODEL_DIR CONFIG... under $VLLM_PY (one engine per configuration, in turn, in one
    process); its VLLMBENCH records."""
    vllm_py = os.environ.get("VLLM_PY")
    if not vllm_py:
        raise SystemExit("VLLM_PY is not set: `source .gpu/vllm/install.sh` first (../shared/gpu/vllm/README.md)")
    if not Path(script).is_file():
        raise SystemExit(f"--script {script}: no such file (carry .gpu/vllm/vllm_bench.py in this call)")
    cmd = [*shlex.split(vllm_py), script, workload, model_dir, *configs]
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
        value = k["value"] / v["value"] if r.kvray_over_vllm else v["value"] / k["value"]
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
    v.add_argument("--configs", nargs="+", choices=VLLM_CONFIGS, default=["defaults"], help="one engine each, in turn")
    r = sub.add_parser("ratio", help="both sides' latest figures -> the ratios")
    r.add_argument("--from", dest="folder", default=os.environ.get("KVRAY_RESULTS_MIRROR", DEFAULT_MIRROR))
    args = ap.parse_args(argv)
    if args.cmd == "ratio":
        folder = Path(args.folder)
        if not folder.is_dir():
            print(f"--from {folder}: no such folder; reading {RESULTS_DIR}", flush=True)
            folder = RESULTS_DIR
        return ratio(folder)
    for rec in run_vllm_bench(args.workload, args.model_dir, args.script, args.configs):
        if rec["produced"] != rec["output_tokens"]:
            raise SystemExit(f"vLLM produced {rec['produced']} tokens, not {rec['output_tokens']} ({rec['config']})")
        record(SERIES, vllm_metric(args.workload, rec["config"], "tok_s"), rec["tok_s"], "tok/s")
        record(SERIES, vllm_metric(args.workload, rec["config"], "init_s"), rec["init_s"], "s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
