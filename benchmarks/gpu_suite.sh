#!/usr/bin/env bash
# The GPU checks and benchmarks, batched into few device calls because device time is scarce.
# Run from the repo root after `source .gpu/bootstrap.sh`; logs and JSON lines go to $OUT, one log per
# step. Usage: bash benchmarks/gpu_suite.sh PHASE   (PHASE: qwen | checks | rerun | llama | graphs | diag | warm | final | open | divergence | transport | families | logprobs | round5 | round6 | multigpu | all)
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

control_plane_old_new() {  # TP=2 shm control plane, this tree and .old (a `git archive` of the tree before), interleaved
  local cmd="python3 benchmarks/host/bench_control_plane.py --tp 2 --transports shm --device cuda --steps 2000"
  for i in 1 2; do
    TAIL=3 step "cp_new_$i" 70 $cmd
    TAIL=3 step "cp_old_$i" 70 bash -c "cd .old && PYTHONPATH=\$PWD:\$PYTHONPATH $cmd --no-write"
  done
}

phase_s8a() {  # eighth session, call 1: the control plane old/new interleaved ([cluster]), start-up before and
  # after compiling the shipped Ray's bytecode (the bundle ships none, and the image may forbid writing it),
  # greedy = HF in every graph mode on the tree with the scheduler's row-position path
  TAIL=40 step diag_boot 90 bash benchmarks/tools/diag_boot.sh
  control_plane_old_new
  TAIL=12 step startup_src 200 python3 benchmarks/e2e/bench_startup.py --shape qwen3-0.6b
  grep -l "Failed to bind" /tmp/ray/session_*/logs/dashboard_agent.log 2>/dev/null | head -3
  local t0=$SECONDS; python3 -m compileall -q -j 0 /tmp/site > /dev/null 2>&1; echo "compileall /tmp/site: $((SECONDS - t0)) s"
  TAIL=12 step diag_boot_compiled 60 bash benchmarks/tools/diag_boot.sh
  TAIL=12 step startup_pyc 100 python3 benchmarks/e2e/bench_startup.py --shape qwen3-0.6b --warm-only
  TAIL=30 step cuda_graphs 120 python3 benchmarks/checks/check_cuda_graphs.py
  cp -r benchmarks/results "$OUT/results" 2>/dev/null
}

phase_s8b() {  # eighth session, call 2: everything after compiling the image's bytecode (as pip installs it)
  TAIL=3 step compile_bytecode 150 python3 benchmarks/tools/compile_bytecode.py
  TAIL=14 step diag_boot 60 bash benchmarks/tools/diag_boot.sh
  TAIL=40 step actor_boot 90 python3 benchmarks/tools/diag_actor_boot.py
  control_plane_old_new
  TAIL=12 step startup 200 python3 benchmarks/e2e/bench_startup.py --shape qwen3-0.6b
  python3 .gpu/serve/install.py
  TAIL=30 step serve_ab 260 python3 benchmarks/e2e/bench_serve.py --shape qwen3-0.6b --num-prompts 500 \
    --compare serve.batch_submissions=false default
  cp -r benchmarks/results "$OUT/results" 2>/dev/null
}

phase_s8c() {  # eighth session, call 3: `kvray run` against LLM.generate on the nano recipe (never measured: its
  # step had hit the limit), the serve ratio again, start-up of the Llama-3.1-8B shape cold and warm
  TAIL=3 step compile_bytecode 60 python3 benchmarks/tools/compile_bytecode.py
  TAIL=30 step nano_run 230 python3 benchmarks/e2e/bench_offline.py --shape qwen3-0.6b --workload nano \
    --configs defaults tuned --idle --kvray-run
  python3 .gpu/serve/install.py
  TAIL=10 step serve_default 150 python3 benchmarks/e2e/bench_serve.py --shape qwen3-0.6b --num-prompts 500 \
    --compare default
  cp -r benchmarks/results "$OUT/results" 2>/dev/null
  TAIL=10 step startup_llama8b 240 python3 benchmarks/e2e/bench_startup.py --shape llama-3.1-8b
  cp -r benchmarks/results "$OUT/results" 2>/dev/null
}

phase_s8d() {  # eighth session, call 4: the serve sweep (low rates to saturation) on both shapes, current tree
  TAIL=3 step compile_bytecode 60 python3 benchmarks/tools/compile_bytecode.py
  python3 .gpu/serve/install.py
  TAIL=12 step serve_qwen3 220 python3 benchmarks/e2e/bench_serve.py --shape qwen3-0.6b --num-prompts 500
  mkdir -p "$OUT/results"; cp benchmarks/results/bench_serve.jsonl "$OUT/results/" 2>/dev/null
  TAIL=12 step serve_llama8b 260 python3 benchmarks/e2e/bench_serve.py --shape llama-3.1-8b --num-prompts 500
  cp benchmarks/results/bench_serve.jsonl "$OUT/results/" 2>/dev/null
}

phase_s9a() {  # ninth session, call 1: decode attention at mixed context lengths (split count x tiles) on both
  # shapes, then nano's defaults with the KV bandwidth of each step kind and a profile of its tail steps
  TAIL=3 step compile_bytecode 60 python3 benchmarks/tools/compile_bytecode.py
  TAIL=40 step attn_splits_qwen3 200 python3 benchmarks/kernels/bench_attention_splits.py --shapes qwen3-0.6b \
    --json "$OUT/attn_splits_qwen3.jsonl"
  TAIL=40 step attn_splits_llama 100 python3 benchmarks/kernels/bench_attention_splits.py --shapes llama-3.1-8b \
    --tiles default --json "$OUT/attn_splits_llama.jsonl"
  TAIL=30 step nano_profile 170 python3 benchmarks/e2e/bench_offline.py --shape qwen3-0.6b --workload nano \
    --configs defaults --idle --steps-json "$OUT/nano_steps.json" --profile /tmp/pn --profile-skip 850 --profile-steps 3
  python3 benchmarks/tools/summarize_trace.py /tmp/pn --top 30 > "$OUT/nano_profile_summary.txt" 2>&1
  mkdir -p "$OUT/results"; cp benchmarks/results/*.jsonl "$OUT/results/" 2>/dev/null
}

phase_s9b() {  # ninth session, call 2: the sampler's vocabulary shares and power-of-two split counts: the sampler
  # side by side, both offline workloads with defaults, greedy = HF in every graph mode, then a profile of
  # nano's big decode steps (its throughput is no figure: the profiler starts inside the timed run)
  TAIL=3 step compile_bytecode 60 python3 benchmarks/tools/compile_bytecode.py
  TAIL=6 step sampler_shares 60 python3 benchmarks/kernels/bench_sampler.py --shares-only
  TAIL=24 step nano 150 python3 benchmarks/e2e/bench_offline.py --shape qwen3-0.6b --workload nano \
    --configs defaults tuned --idle
  mkdir -p "$OUT/results"; cp benchmarks/results/*.jsonl "$OUT/results/" 2>/dev/null
  TAIL=20 step llama 170 python3 benchmarks/e2e/bench_offline.py --shape llama-3.1-8b --workload sharegpt \
    --configs defaults --idle
  cp benchmarks/results/*.jsonl "$OUT/results/" 2>/dev/null
  TAIL=30 step cuda_graphs 120 python3 benchmarks/checks/check_cuda_graphs.py
  cp benchmarks/results/*.jsonl "$OUT/results/" 2>/dev/null
  TAIL=4 step nano_profile_big 60 python3 benchmarks/e2e/bench_offline.py --shape qwen3-0.6b --workload nano \
    --configs defaults --profile /tmp/pb --profile-skip 150 --profile-steps 3
  python3 benchmarks/tools/summarize_trace.py /tmp/pb --top 30 > "$OUT/nano_profile_big.txt" 2>&1
}

phase_s9c() {  # ninth session, call 3: the serve sweep on the Llama-3.1-8B shape (never measured), then the Qwen3
  # saturation ratio with each server process's CPU
  TAIL=3 step compile_bytecode 60 python3 benchmarks/tools/compile_bytecode.py
  python3 .gpu/serve/install.py
  TAIL=16 step serve_llama8b 330 python3 benchmarks/e2e/bench_serve.py --shape llama-3.1-8b --num-prompts 500
  mkdir -p "$OUT/results"; cp benchmarks/results/bench_serve.jsonl "$OUT/results/" 2>/dev/null
  TAIL=16 step serve_qwen3 150 python3 benchmarks/e2e/bench_serve.py --shape qwen3-0.6b --num-prompts 500 \
    --compare default
  cp benchmarks/results/bench_serve.jsonl "$OUT/results/" 2>/dev/null
}

phase_s9d() {  # ninth session, call 4: Ray Serve LLM's stream batching (serve.stream_batching_ms, 50 by default at the time)
  # against a chunk every step, at saturation on the Qwen3 shape, then the sweep's TTFT at half saturation
  TAIL=3 step compile_bytecode 60 python3 benchmarks/tools/compile_bytecode.py
  python3 .gpu/serve/install.py
  TAIL=16 step serve_batching 200 python3 benchmarks/e2e/bench_serve.py --shape qwen3-0.6b --num-prompts 500 \
    --compare default serve.stream_batching_ms=0
  mkdir -p "$OUT/results"; cp benchmarks/results/bench_serve.jsonl "$OUT/results/" 2>/dev/null
  TAIL=16 step serve_qwen3 200 python3 benchmarks/e2e/bench_serve.py --shape qwen3-0.6b --num-prompts 500 --no-offline \
    --rates 8
  cp benchmarks/results/bench_serve.jsonl "$OUT/results/" 2>/dev/null
}

phase_s10a() {  # next H200 call: the stream-batching rework (5b338b4, the stream sleeps through its window)
  # against a chunk every step (the default), at saturation on the Qwen3 shape, same host, one run
  TAIL=3 step compile_bytecode 60 python3 benchmarks/tools/compile_bytecode.py
  python3 .gpu/serve/install.py
  TAIL=16 step serve_batching 300 python3 benchmarks/e2e/bench_serve.py --shape qwen3-0.6b --num-prompts 500 \
    --compare default serve.stream_batching_ms=50 serve.stream_batching_ms=20
  mkdir -p "$OUT/results"; cp benchmarks/results/bench_serve.jsonl "$OUT/results/" 2>/dev/null
}

phase_s12a() {  # twelfth session, call 1: the held sampler branch (tl.rand4x draws, logits in the model dtype;
  # .gpu/pending_sampler.patch applied to a copy in /tmp/br) beside this tree: the sampler alone, then the nano
  # recipe's defaults interleaved; then where the Llama-3.1-8B tail steps (1-16 rows, 5.4 ms against a 3.8 ms
  # weight read) spend their time: a profile of 4 of them
  TAIL=3 step compile_bytecode 60 python3 benchmarks/tools/compile_bytecode.py
  rm -rf /tmp/br && mkdir /tmp/br && tar --exclude=./.gpu -cf - . | tar -xf - -C /tmp/br && ln -s "$PWD/.gpu" /tmp/br/.gpu
  (cd /tmp/br && patch -p1 -s < .gpu/pending_sampler.patch) || { echo "patch failed"; return 1; }
  TAIL=12 step sampler_main 90 python3 benchmarks/kernels/bench_sampler.py --shares-only
  TAIL=12 step sampler_branch 90 bash -c "cd /tmp/br && KVRAY_COMMIT=d57fb53 python3 benchmarks/kernels/bench_sampler.py --shares-only"
  for i in 1 2; do
    TAIL=16 step "nano_main_$i" 110 python3 benchmarks/e2e/bench_offline.py --shape qwen3-0.6b --workload nano \
      --configs defaults --idle
    TAIL=16 step "nano_branch_$i" 110 bash -c "cd /tmp/br && KVRAY_COMMIT=d57fb53 python3 benchmarks/e2e/bench_offline.py \
      --shape qwen3-0.6b --workload nano --configs defaults --idle"
  done
  TAIL=30 step llama_tail 200 python3 benchmarks/e2e/bench_offline.py --shape llama-3.1-8b --workload sharegpt \
    --configs defaults --idle --profile /tmp/pt --profile-skip 1500 --profile-steps 4
  TAIL=70 step llama_tail_trace 40 python3 benchmarks/tools/summarize_trace.py /tmp/pt --top 30
  mkdir -p "$OUT/results" "$OUT/results_branch"
  cp benchmarks/results/*.jsonl "$OUT/results/" 2>/dev/null; cp /tmp/br/benchmarks/results/*.jsonl "$OUT/results_branch/" 2>/dev/null
  bundle_out s12a
}

phase_s12b() {  # twelfth session, call 2: greedy = HF in every graph mode with the landed sampler (6bb415d); a
  # profile of 4 big decode steps of the Llama-3.1-8B shape (129-256 rows, 11.7 ms against ~5.5 ms of GEMMs
  # and ~2.4 ms of KV read); then s10a's stream-batching A/B (0 / 50 / 20 ms) on the Qwen3 shape
  TAIL=3 step compile_bytecode 60 python3 benchmarks/tools/compile_bytecode.py
  TAIL=30 step cuda_graphs 130 python3 benchmarks/checks/check_cuda_graphs.py
  TAIL=12 step llama_big 150 python3 benchmarks/e2e/bench_offline.py --shape llama-3.1-8b --workload sharegpt \
    --configs defaults --idle --profile /tmp/pb --profile-skip 300 --profile-steps 4
  python3 benchmarks/tools/summarize_trace.py /tmp/pb --top 30 > "$OUT/llama_big_trace.txt" 2>&1
  mkdir -p "$OUT/results"; cp benchmarks/results/*.jsonl "$OUT/results/" 2>/dev/null
  bundle_out s12b_1
  python3 .gpu/serve/install.py > "$OUT/serve_install.log" 2>&1
  TAIL=16 step serve_batching 270 python3 benchmarks/e2e/bench_serve.py --shape qwen3-0.6b --num-prompts 500 \
    --compare default serve.stream_batching_ms=50 serve.stream_batching_ms=20
  cp benchmarks/results/bench_serve.jsonl "$OUT/" 2>/dev/null
}

phase_s12c() {  # twelfth session, call 3: decode tiles for short contexts. The Llama-3.1-8B big decode steps'
  # attention ran at ~2.5 TB/s (123 us a layer, mean context ~330): 16x128 tiles in 3 stages leave room for
  # one program an SM. The sweep picks the best other tiles; both workloads run with them (KVRAY_DECODE_TILES)
  # beside the defaults. Then the stream-batching A/B once more (0 against 50 ms)
  TAIL=3 step compile_bytecode 60 python3 benchmarks/tools/compile_bytecode.py
  TAIL=40 step attn_tiles 110 python3 benchmarks/kernels/bench_attention_splits.py --shapes llama-3.1-8b qwen3-0.6b \
    --dists short wide tail --batches 32 128 256 --splits 1 2 --tiles default n64s2 n64s3 n32s3 n128s2 --rep-ms 30 \
    --json "$OUT/attn_tiles.jsonl"
  local t; t=$(python3 benchmarks/tools/pick_decode_tiles.py "$OUT/attn_tiles.jsonl" 2>>"$OUT/pick.log") || t=64:4:2
  echo "decode tiles for the A/B: $t" | tee -a "$OUT/pick.log"
  local llama="python3 benchmarks/e2e/bench_offline.py --shape llama-3.1-8b --workload sharegpt --configs defaults --idle"
  local nano="python3 benchmarks/e2e/bench_offline.py --shape qwen3-0.6b --workload nano --configs defaults --idle"
  TAIL=14 step llama_default 160 $llama
  TAIL=14 step llama_tiles 130 env KVRAY_DECODE_TILES="$t" $llama
  TAIL=14 step nano_default 80 $nano
  TAIL=14 step nano_tiles 80 env KVRAY_DECODE_TILES="$t" $nano
  mkdir -p "$OUT/results"; cp benchmarks/results/*.jsonl "$OUT/results/" 2>/dev/null
  bundle_out s12c_1
  python3 .gpu/serve/install.py > "$OUT/serve_install.log" 2>&1
  TAIL=16 step serve_batching 200 python3 benchmarks/e2e/bench_serve.py --shape qwen3-0.6b --num-prompts 500 \
    --compare default serve.stream_batching_ms=50
  cp benchmarks/results/bench_serve.jsonl "$OUT/" 2>/dev/null
}

phase_s12d() {  # twelfth session, call 4: with serve.stream_batching_ms at its new default (50), the Qwen3 sweep's
  # TTFT p99 at half saturation (26.7 ms with 0 in the ninth session; the first token goes out at once)
  TAIL=3 step compile_bytecode 60 python3 benchmarks/tools/compile_bytecode.py
  python3 .gpu/serve/install.py > "$OUT/serve_install.log" 2>&1
  TAIL=16 step serve_qwen3 200 python3 benchmarks/e2e/bench_serve.py --shape qwen3-0.6b --num-prompts 500 --no-offline \
    --rates 8
  cp benchmarks/results/bench_serve.jsonl "$OUT/" 2>/dev/null
}

NANO="python3 benchmarks/e2e/bench_offline.py --shape qwen3-0.6b --workload nano --configs defaults --idle"
nano_ab() {  # A B VAR=value: nano with the defaults (steps nano_A_i) and with VAR=value (nano_B_i), as A B A B
  local a=$1 b=$2 setting=$3 i
  for i in 1 2; do
    TAIL=14 step "nano_${a}_$i" 80 $NANO
    TAIL=14 step "nano_${b}_$i" 80 env "$setting" $NANO
  done
}

phase_s13a() {  # thirteenth session, call 1: decode tiles by occupancy. Nano's big decode steps run attention at
  # ~3.4 TB/s (190 us a layer, mean context ~780): the default 16x128 tiles in 3 stages take 192 KiB of shared
  # memory, one program an SM, so every program's start is exposed. One stage (64 KiB) fits three. Expected: a
  # one-stage variant >= 8% faster at the "nano" and "short" lengths and within 3% at "tail"; then nano end to end
  # with the pick for the Qwen3 shape, interleaved with the defaults (default, pick, default, pick)
  TAIL=3 step compile_bytecode 60 python3 benchmarks/tools/compile_bytecode.py
  TAIL=60 step attn_tiles 170 python3 benchmarks/kernels/bench_attention_splits.py --shapes qwen3-0.6b llama-3.1-8b \
    --dists short nano wide tail --batches 32 64 128 256 --splits 1 \
    --tiles default n128s1 n128s1w8 n128s2w8 n64s1 n64s2 n64s2w2 n256s1 --rep-ms 25 --json "$OUT/attn_tiles.jsonl"
  local tq tl
  tq=$(python3 benchmarks/tools/pick_decode_tiles.py "$OUT/attn_tiles.jsonl" --shape qwen3-0.6b --min-batch 64 \
    2>>"$OUT/pick.log") || tq=128:4:1
  tl=$(python3 benchmarks/tools/pick_decode_tiles.py "$OUT/attn_tiles.jsonl" --shape llama-3.1-8b --min-batch 128 \
    2>>"$OUT/pick.log") || tl=128:4:1
  echo "decode tiles for the A/B: qwen3 $tq llama $tl" | tee -a "$OUT/pick.log"
  nano_ab default tiles KVRAY_DECODE_TILES="$tq"
  mkdir -p "$OUT/results"; cp benchmarks/results/*.jsonl "$OUT/results/" 2>/dev/null
  bundle_out s13a
}

phase_s13b() {  # thirteenth session, call 2: decodes launched longest first (LPT). At mixed context lengths one
  # program an SM and grid order leave a last wave of a few long programs: B=32-64 at nano's lengths ran at
  # 54-67% of copy against 87% at B=256 (call 1). Expected: B=32-64 10-20% faster, B=256 2-5%, tail lengths
  # (narrow) unchanged; nano end to end +3-5%, order A/B interleaved (KVRAY_DECODE_ORDER=grid is the old launch)
  TAIL=3 step compile_bytecode 60 python3 benchmarks/tools/compile_bytecode.py
  TAIL=44 step attn_lpt 120 python3 benchmarks/kernels/bench_attention_splits.py --shapes qwen3-0.6b llama-3.1-8b \
    --dists short nano wide tail --batches 16 32 64 128 256 --splits 1 --tiles default --lpt --rep-ms 25 \
    --json "$OUT/attn_lpt.jsonl"
  TAIL=20 step cuda_graphs 150 python3 benchmarks/checks/check_cuda_graphs.py
  nano_ab lpt grid KVRAY_DECODE_ORDER=grid
  mkdir -p "$OUT/results"; cp benchmarks/results/*.jsonl "$OUT/results/" 2>/dev/null
  bundle_out s13b
}

phase_s13c() {  # thirteenth session, call 3: longest first only where a launch has <= 4 programs an SM (call 2:
  # it won 3.7% on nano's 17-64-row steps and lost 2.5% on its 129-256-row ones). Expected: nano +0.5% against
  # grid order (the big steps back to grid order, the small ones kept), Llama-3.1-8B within noise (+0.2%)
  TAIL=3 step compile_bytecode 60 python3 benchmarks/tools/compile_bytecode.py
  TAIL=20 step cuda_graphs 150 python3 benchmarks/checks/check_cuda_graphs.py
  local llama="python3 benchmarks/e2e/bench_offline.py --shape llama-3.1-8b --workload sharegpt --configs defaults --idle"
  nano_ab gated grid KVRAY_DECODE_ORDER=grid
  TAIL=14 step llama_gated 150 $llama
  TAIL=14 step llama_grid 130 env KVRAY_DECODE_ORDER=grid $llama
  mkdir -p "$OUT/results"; cp benchmarks/results/*.jsonl "$OUT/results/" 2>/dev/null
  bundle_out s13c
}

phase_s13d() {  # thirteenth session, call 4: where nano's time goes now (28d8fa5), 4 profiled steps each of its
  # mixed steps (the first), its ~256-row decode steps and its ~100-row ones. Profiled runs' throughput is no figure
  TAIL=3 step compile_bytecode 60 python3 benchmarks/tools/compile_bytecode.py
  local name skip name_skip
  for name_skip in mixed:1 big:100 mid:620; do
    name=${name_skip%%:*}; skip=${name_skip##*:}
    TAIL=4 step "nano_prof_$name" 90 $NANO --profile "/tmp/p_$name" --profile-skip "$skip" --profile-steps 4
    python3 benchmarks/tools/summarize_trace.py "/tmp/p_$name" --top 30 > "$OUT/nano_${name}_trace.txt" 2>&1
  done
  bundle_out s13d
}

bundle_out() {  # the device returns at most 8 files: the step logs and result folders as one archive
  (cd "$OUT" && tar -czf "/tmp/$1.tgz" --exclude="$1.tgz" . && rm -rf ./* && mv "/tmp/$1.tgz" .)
}

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
  s8a) phase_s8a ;;
  s8b) phase_s8b ;;
  s8c) phase_s8c ;;
  s8d) phase_s8d ;;
  s9a) phase_s9a ;;
  s9b) phase_s9b ;;
  s9c) phase_s9c ;;
  s9d) phase_s9d ;;
  s10a) phase_s10a ;;
  s12a) phase_s12a ;;
  s12b) phase_s12b ;;
  s12c) phase_s12c ;;
  s12d) phase_s12d ;;
  s13a) phase_s13a ;;
  s13b) phase_s13b ;;
  s13c) phase_s13c ;;
  s13d) phase_s13d ;;
  all) phase_qwen; phase_checks; phase_llama ;;
  *) echo "usage: $0 qwen|checks|rerun|llama|graphs|graphs_perf|graphs_profile|diag|warm|final|open|divergence|transport|families|logprobs|round5|round6|multigpu|all"; exit 2 ;;
esac
