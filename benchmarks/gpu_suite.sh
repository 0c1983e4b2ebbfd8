#!/usr/bin/env bash
# One GPU session, batched into one command because device time is scarce: the CUDA-graph correctness
# check (greedy equal to HF), end-to-end throughput against HF transformers on the same prompts, and the
# GPU idle fraction between decode steps. Run from the repo root after `source .gpu/bootstrap.sh`.
# Logs and JSON lines go to $OUT.
set -u
OUT=${OUT:-/tmp/kvray-gpu}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step() {
  local name=$1 limit=$2; shift 2
  echo "== $name, limit ${limit}s, $(date +%T)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? $name $(date +%T)"
  grep -E "RESULT|kvray:|hf:|PASS|FAIL|Traceback|Error" "$OUT/$name.log" | tail -12
}
step cuda_graphs 150 python3 benchmarks/check_cuda_graphs.py
step offline_qwen3 330 python3 benchmarks/bench_offline.py --shape qwen3-0.6b --workload small --hf
step decode_idle 130 python3 benchmarks/bench_decode_idle.py --configs graphs_async,graphs_sync
