#!/usr/bin/env bash
# The GPU checks and benchmarks, batched into few device calls because device time is scarce.
# Run from the repo root after `source .gpu/bootstrap.sh`; logs and JSON lines go to $OUT, one log per
# step. Usage: bash benchmarks/gpu_suite.sh PHASE   (PHASE: qwen | checks | rerun | llama | graphs | diag | warm | final | open | divergence | transport | families | logprobs | round5 | round6 | multigpu | s8a ... s15c | all)
#   qwen:  greedy = HF with CUDA graphs and async scheduling; layer kernels, block-table commit, GPU idle
#          between decode steps, offline throughput and `kvray run` (with a profile) on the Qwen3-0.6B
#          shape; the cost of logprobs=5, n=4 and stop strings (bench_api_features); the control plane on
#          the GPU host.
#   checks: GPU idle with the worker's host phases; the worker's and the scheduler's host work on this
#          host's CPU; TP=2 on one GPU (gloo) against TP=1; bf16 against HF fp32.
#   llama: the Llama-3.1-8B shape offline (ShareGPT-like) and through `kvray run`.
#   graphs: ([graphs], <= 9 minutes) greedy = HF in every graph mode, the attention kernels' speed;
#          offline throughput defaults vs tuned on both workloads (Qwen3-0.6B nano recipe with the
#          all-steps idle share and `kvray run`; Llama-3.1-8B ShareGPT-like with a profile of a few
#          steps); start-up with a cold and a warm Triton cache and the first run's TTFT.
#   round6: vLLM's logprobs rule (check_logprobs_close: 8 prompts x 32 tokens, top-5) against HF bf16 on the
#          Llama-3.1-8B, Qwen3-0.6B, Mistral-7B and Gemma-3-12B (hybrid) shapes.
#   s8a ... s15c: one device call each of the sessions since the eighth (benchmarks/gpu_phases_sessions.sh).
#   multigpu: (2+ GPUs) TP=2/4 over NCCL against TP=1, decode scaling TP 1/2/4 and DP2xTP2, control
#          plane at TP 2/4/8. The fault run at TP=2 is `kvray stress --config configs/gpu-tp2.yaml
#          --kill-workers 2`.
set -u
OUT=${OUT:-/tmp/kvray-gpu}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
MODELS=/tmp/kvray-models
step() {
  local name=$1 limit=$2; shift 2
  echo "== $name, limit ${limit}s, $(date +%T)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? $name $(date +%T)"
  grep -E "RESULT|kvray:|kvray \[|start-up|engine:|hf:|PASS|FAIL|Traceback|Error|idle|tok/s|us|TP=|graphs_|prepare|median|identical|diverg" "$OUT/$name.log" \
    | grep -v "pid=" | tail -${TAIL:-14}
}
make_model() {  # shape dtype -> path on stdout
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from common import make_random_model; \
print(make_random_model('$1', '$MODELS', '$2'))" 2>/dev/null | tail -1
}
kvray_run() {  # name model_dir extra args...
  local name=$1 model=$2; shift 2
  step "$name" 240 python3 -m cluster.cli run --config configs/gpu.yaml --set "model.model=$model" \
    --no-progress --summary-json "$OUT/$name.json" --output /tmp/$name.out.jsonl "$@"
}

phase_qwen() {
  step cuda_graphs 180 python3 benchmarks/checks/check_cuda_graphs.py
  step layer_kernels 120 python3 benchmarks/kernels/bench_layer_kernels.py
  step block_table 120 python3 benchmarks/kernels/bench_block_table.py
  step decode_idle 200 python3 benchmarks/e2e/bench_decode_idle.py --configs graphs_async,graphs_sync
  step offline_qwen3 200 python3 benchmarks/e2e/bench_offline.py --shape qwen3-0.6b --workload small --async-scheduling
  step api_features 300 python3 benchmarks/e2e/bench_api_features.py --shape qwen3-0.6b
  local q; q=$(make_model qwen3-0.6b bfloat16)
  kvray_run run_qwen3 "$q" --num-requests 512 --max-tokens 256 --profile /tmp/trace --profile-steps 5 --profile-skip 60
  TAIL=60 step trace_summary 60 python3 benchmarks/tools/summarize_trace.py /tmp/trace
  step control_plane 150 python3 benchmarks/host/bench_control_plane.py --device cuda --tp 1 2 4
}

phase_checks() {
  TAIL=30 step decode_idle 200 python3 benchmarks/e2e/bench_decode_idle.py --configs graphs_async,graphs_sync
  step runner_host 90 python3 benchmarks/host/bench_runner_host.py --steps 300
  step scheduler_step 90 python3 benchmarks/host/bench_scheduler_step.py --steps 2000
  TAIL=30 step check_tp 240 python3 benchmarks/checks/check_tp.py
  TAIL=30 step bf16_divergence 200 python3 benchmarks/checks/check_bf16_divergence.py
}

phase_rerun() {  # after host-side changes: the idle share and the offline figure again
  TAIL=30 step decode_idle 200 python3 benchmarks/e2e/bench_decode_idle.py --configs graphs_async,graphs_sync
  step offline_qwen3 200 python3 benchmarks/e2e/bench_offline.py --shape qwen3-0.6b --workload small --async-scheduling
}

phase_llama() {
  step offline_llama8b 420 python3 benchmarks/e2e/bench_offline.py --shape llama-3.1-8b --workload sharegpt --async-scheduling
  local l; l=$(make_model llama-3.1-8b bfloat16)
  kvray_run run_llama8b "$l" --num-requests 256 --max-tokens 128
}

phase_graphs() {  # limits sum to 530 s
  TAIL=50 step cuda_graphs 90 python3 benchmarks/checks/check_cuda_graphs.py
  TAIL=30 step attention 60 python3 benchmarks/kernels/bench_attention.py
  graphs_perf 115 180 70
  graphs_profile
}

graphs_perf() {  # nano, sharegpt and start-up limits in s. Tuned runs first: both runs see a warm disk cache.
  TAIL=20 step offline_qwen3_nano "$1" python3 benchmarks/e2e/bench_offline.py --shape qwen3-0.6b --workload nano \
    --configs tuned defaults --idle --kvray-run
  TAIL=20 step offline_llama8b "$2" python3 benchmarks/e2e/bench_offline.py --shape llama-3.1-8b --workload sharegpt \
    --configs tuned defaults
  TAIL=10 step startup "$3" python3 benchmarks/e2e/bench_startup.py --shape qwen3-0.6b
  cp -r benchmarks/results "$OUT/results" 2>/dev/null
}

graphs_profile() {  # a torch-profiler trace of 3 mixed steps of the defaults (Llama-3.1-8B shape, ShareGPT-like)
  TAIL=20 step offline_llama8b_profiled 170 python3 benchmarks/e2e/bench_offline.py --shape llama-3.1-8b \
    --workload sharegpt --configs defaults --profile /tmp/trace_llama --profile-steps 3 --profile-skip 30
  TAIL=60 step trace_summary 15 python3 benchmarks/tools/summarize_trace.py /tmp/trace_llama
}

phase_diag() {  # [graphs] where the time goes: step kinds (median, max), late compiles, two traces, start-up phases
  TAIL=30 step nano_idle 130 python3 benchmarks/e2e/bench_offline.py --shape qwen3-0.6b --workload nano --configs defaults \
    --idle --steps-json "$OUT/nano_steps.json" --profile /tmp/trace_mixed --profile-steps 3 --profile-skip 2
  TAIL=70 step trace_mixed 30 python3 benchmarks/tools/summarize_trace.py /tmp/trace_mixed --top 25
  TAIL=20 step nano_tail 80 python3 benchmarks/e2e/bench_offline.py --shape qwen3-0.6b --workload nano --configs defaults \
    --profile /tmp/trace_tail --profile-steps 6 --profile-skip 1010
  TAIL=70 step trace_tail 30 python3 benchmarks/tools/summarize_trace.py /tmp/trace_tail --top 25
  TAIL=40 step startup 150 python3 benchmarks/e2e/bench_startup.py --shape qwen3-0.6b
  cp -r benchmarks/results "$OUT/results" 2>/dev/null
}

phase_warm() {  # [graphs] after the warm-up fixes: nano defaults vs tuned, start-up, logprobs cost, head-256 attention
  TAIL=40 step nano 170 python3 benchmarks/e2e/bench_offline.py --shape qwen3-0.6b --workload nano --configs defaults tuned \
    --idle --steps-json "$OUT/nano_steps.json"
  TAIL=40 step startup 130 python3 benchmarks/e2e/bench_startup.py --shape qwen3-0.6b
  TAIL=20 step api_features 110 python3 benchmarks/e2e/bench_api_features.py --shape qwen3-0.6b
  TAIL=20 step attn_head256 130 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider \
    tests/test_attention_kernels.py -k "head_256 or fall_back or half_precision"
}

phase_final() {  # [graphs] the round's figures: greedy = HF in every graph mode, start-up, nano defaults beside the knobs
  TAIL=30 step cuda_graphs 100 python3 benchmarks/checks/check_cuda_graphs.py
  TAIL=40 step startup 120 python3 benchmarks/e2e/bench_startup.py --shape qwen3-0.6b
  TAIL=40 step nano 140 python3 benchmarks/e2e/bench_offline.py --shape qwen3-0.6b --workload nano \
    --configs defaults no_prefix_cache len4096 --idle
  TAIL=20 step attn_head256 90 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider \
    tests/test_attention_kernels.py -k "head_256 or fall_back or half_precision or jumps"
}

serve_sweep() {  # Ray Serve is not in the slim Ray: .gpu/serve/ (benchmarks/tools/gpu_bundle_extras.sh) brings it
  python3 .gpu/serve/install.py
  TAIL=30 step serve 260 python3 benchmarks/e2e/bench_serve.py --shape qwen3-0.6b --num-prompts 500 --rates 32
}

phase_open() {  # the fourth session's figures: Llama step kinds, the control plane on the GPU host, the serve sweep
  TAIL=40 step llama_steps 150 python3 benchmarks/e2e/bench_offline.py --shape llama-3.1-8b --workload sharegpt \
    --configs defaults --idle --steps-json "$OUT/llama_steps.json"
  TAIL=30 step control_plane 60 python3 benchmarks/host/bench_control_plane.py --device cuda --tp 1 2 --steps 300
  serve_sweep
  cp -r benchmarks/results "$OUT/results" 2>/dev/null
}

phase_divergence() {  # fp32 = HF and bf16 divergence of the new families (~8 minutes on a cold Triton cache)
  # two engine starts each (fp32 then bf16; Gemma: head 256, two KV groups): ~90 s each when cold
  TAIL=30 step bf16_gemma3 270 python3 benchmarks/checks/check_bf16_divergence.py --shape gemma-3-12b --num-layers 8
  TAIL=30 step bf16_moe 250 python3 benchmarks/checks/check_bf16_divergence.py --shape qwen3-30b-a3b --num-layers 4
  cp -r benchmarks/results "$OUT/results" 2>/dev/null
}

phase_transport() {  # the nano workload with each step transport, side by side (real workers on the GPU)
  TAIL=30 step nano_transport 150 python3 benchmarks/e2e/bench_offline.py --shape qwen3-0.6b --workload nano \
    --configs compiled_graph shm
}

phase_families() {  # [models] end-to-end throughput of the new families, the logprobs kernels, the step transports
  TAIL=20 step logprobs_device 90 python3 benchmarks/host/bench_logprobs_stages.py --device-breakdown cuda
  TAIL=20 step families_gemma3 230 python3 benchmarks/e2e/bench_families.py --shape gemma-3-12b --num-layers 12
  TAIL=20 step families_moe 200 python3 benchmarks/e2e/bench_families.py --shape qwen3-30b-a3b --num-layers 8
  cp -r benchmarks/results "$OUT/results" 2>/dev/null
}

phase_logprobs() {  # [api] the logprobs kernels and the end-to-end cost of logprobs=5; [cluster] the step transports
  TAIL=20 step logprobs_device 90 python3 benchmarks/host/bench_logprobs_stages.py --device-breakdown cuda
  TAIL=20 step api_features 130 python3 benchmarks/e2e/bench_api_features.py --shape qwen3-0.6b
  phase_transport
  cp -r benchmarks/results "$OUT/results" 2>/dev/null
}

phase_round5() {  # the fifth session's merge: greedy = HF in every mode, logprobs, control plane, serve stream_interval A/B
  TAIL=30 step cuda_graphs 120 python3 benchmarks/checks/check_cuda_graphs.py
  TAIL=20 step api_features 130 python3 benchmarks/e2e/bench_api_features.py --shape qwen3-0.6b
  TAIL=30 step control_plane 70 python3 benchmarks/host/bench_control_plane.py --device cuda --tp 1 2 --steps 300
  python3 -c "import os; print('cores', len(os.sched_getaffinity(0)))"
  python3 .gpu/serve/install.py
  TAIL=30 step serve_compare 220 python3 benchmarks/e2e/bench_serve.py --shape qwen3-0.6b --num-prompts 500 \
    --compare default serve.stream_interval=4
}

phase_round6() {  # [api] vLLM's logprobs rule against HF bf16: Llama, Qwen3, Mistral, Gemma-3 (hybrid); ~4 minutes
  TAIL=30 step logprobs_close 360 python3 benchmarks/checks/check_logprobs_close.py
  cp -r benchmarks/results "$OUT/results" 2>/dev/null
}

phase_multigpu() {  # a host with 2+ GPUs ([multigpu]): NCCL correctness and scaling
  TAIL=30 step check_tp_nccl 300 python3 benchmarks/checks/check_tp.py --gpus-per-worker 1 --tp 2,4
  TAIL=30 step tp_scaling 600 python3 benchmarks/e2e/bench_tp_scaling.py
  step control_plane_tp8 200 python3 benchmarks/host/bench_control_plane.py --device cuda --tp 2 4 8
}

bundle_out() {  # the device returns at most 8 files: the step logs and result folders as one archive
  (cd "$OUT" && tar -czf "/tmp/$1.tgz" --exclude="$1.tgz" . && rm -rf ./* && mv "/tmp/$1.tgz" .)
}

# shellcheck source=benchmarks/gpu_phases_sessions.sh
source "$(dirname "$0")/gpu_phases_sessions.sh"

# The engines need pyzmq, which make-bundle.sh's .gpu/ lacks (s14x lost its end-to-end runs to that).
python3 -c "import zmq" 2>/dev/null || { echo "gpu_suite: no zmq here: run benchmarks/tools/gpu_bundle_extras.sh \
after ../shared/gpu/make-bundle.sh on the CPU machine (it puts the pyzmq wheel into .gpu/)"; exit 3; }

case "${1:-all}" in
  qwen) phase_qwen ;;
  checks) phase_checks ;;
  rerun) phase_rerun ;;
  llama) phase_llama ;;
  graphs) phase_graphs ;;
  graphs_perf) graphs_perf 150 160 110 ;;  # the throughput and start-up half of graphs (420 s)
  graphs_profile) graphs_profile ;;
  diag) phase_diag ;;
  warm) phase_warm ;;
  final) phase_final ;;
  open) phase_open ;;
  divergence) phase_divergence ;;
  transport) phase_transport ;;
  families) phase_families ;;
  logprobs) phase_logprobs ;;
  round5) phase_round5 ;;
  round6) phase_round6 ;;
  multigpu) phase_multigpu ;;
  s[0-9]*) declare -F "phase_$1" > /dev/null || { echo "no phase $1"; exit 2; }; "phase_$1" ;;
  all) phase_qwen; phase_checks; phase_llama ;;
  *) echo "usage: $0 qwen|checks|rerun|llama|graphs|graphs_perf|graphs_profile|diag|warm|final|open|divergence|transport|families|logprobs|round5|round6|multigpu|s8a..s15c|all"; exit 2 ;;
esac
