"""Offline throughput: kvray against HF transformers' continuous batching, same prompts, one run.

Workloads (random token ids, EOS ignored, seed 0):
  small   256 sequences, prompt and output lengths uniform in [100, 1024] (Qwen3-0.6B shape)
  sharegpt  1,000 sequences, long-tailed lengths, about 200 in and 180 out on average (Llama-3.1-8B shape)

  python benchmarks/bench_offline.py --shape qwen3-0.6b --workload small --hf
  python benchmarks/bench_offline.py --shape llama-3.1-8b --workload sharegpt
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES, make_random_model, record  # noqa: E402


def make_workload(kind: str, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    if kind == "small":
        n = 256
        in_lens = rng.integers(100, 1025, n)
        out_lens = rng.integers(100, 1025, n)
    elif kind == "sharegpt":
        n = 1000
        # Log-normal lengths with means of about 200 (prompt) and 180 (output), long-tailed.
        in_lens = np.clip(rng.lognormal(np.log(200) - 0.5, 1.0, n), 4, 2048).astype(int)
        out_lens = np.clip(rng.lognormal(np.log(180) - 0.5, 1.0, n), 4, 2048).astype(int)
    else:
        raise ValueError(f"--workload {kind!r}: must be small or sharegpt")
    prompts = [rng.integers(0, min(vocab, 100_000), int(k)).tolist() for k in in_lens]
    return prompts, [int(x) for x in out_lens]


def run_kvray(model_dir: str, prompts, out_lens, args, admission_min_batch: int = 1,
              logprobs: int | None = None) -> dict:
    from cluster import LLM, SamplingParams

    llm = LLM(model=model_dir, device="cuda", dtype="bfloat16", max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
              enforce_eager=args.eager, async_scheduling=args.async_scheduling,
              admission_min_batch=admission_min_batch, admission_max_wait_steps=args.admission_max_wait_steps)
    try:
        warm = [{"prompt_token_ids": p} for p in prompts[:8]]
        llm.generate(warm, SamplingParams(max_tokens=16, ignore_eos=True))
        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=getattr(args, "temperature", 0.0),
                                 logprobs=logprobs)
                  for n in out_lens]
        driver = llm.engines.drivers[0]
        before = llm.engines.stats()[0]
        if args.profile:
            import ray
            ray.get(driver.start_profile.remote(args.profile, args.profile_steps, args.profile_skip))
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        elapsed = time.perf_counter() - t0
        after = llm.engines.stats()[0]
        if args.profile:
            print("profile traces:", ray.get(driver.stop_profile.remote()))
        steps = after["num_steps"] - before["num_steps"]
        tokens = after["num_tokens_scheduled"] - before["num_tokens_scheduled"]
        print(f"engine: {steps} steps, {tokens} tokens scheduled ({tokens / max(steps, 1):.0f} a step), "
              f"{elapsed / max(steps, 1) * 1e3:.2f} ms a step, preemptions "
              f"{after.get('num_preemptions', 0) - before.get('num_preemptions', 0)}", flush=True)
    finally:
        llm.shutdown()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(out_lens), f"kvray produced {n_out} tokens, expected {sum(out_lens)}"
    res = {"elapsed_s": elapsed, "output_tokens": n_out}
    timed = [o.metrics for o in outs if o.metrics is not None and o.metrics.ttft_s is not None]
    if timed:
        res["ttft_p50_ms"] = statistics.median(m.ttft_s for m in timed) * 1e3
        res["tpot_p50_ms"] = statistics.median((m.e2e_s - m.ttft_s) / max(1, m.num_output_tokens - 1)
                                               for m in timed) * 1e3
    return res


def run_hf(model_dir: str, prompts, out_lens) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda",
                                                 attn_implementation="sdpa")
    gc = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=max(out_lens))
    manager = model.init_continuous_batching(generation_config=gc)
    manager.start()
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, out_lens)):
        manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
    done, n_out = 0, 0
    while done < len(prompts):
        r = manager.get_result(timeout=5)
        if r is None:
            if not manager.is_running():
                raise RuntimeError("HF continuous batching thread stopped")
            continue
        if r.is_finished():
            done += 1
            n_out += len(r.generated_tokens)
    elapsed = time.perf_counter() - t0
    manager.stop(block=True)
    return {"elapsed_s": elapsed, "output_tokens": n_out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--workload", choices=["small", "sharegpt"], default="small")
    ap.add_argument("--model-dir", default="/tmp/kvray-models")
    ap.add_argument("--hf", action="store_true", help="also run HF transformers on the same prompts")
    ap.add_argument("--eager", action="store_true", help="kvray without CUDA graphs")
    ap.add_argument("--async-scheduling", action="store_true", help="kvray schedules step N+1 during step N")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--admission-min-batch", type=int, nargs="+", default=[1],
                    help="scheduler.admission_min_batch; several values run side by side")
    ap.add_argument("--admission-max-wait-steps", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0, help="0.6 for nano-vllm's recipe")
    ap.add_argument("--logprobs", type=int, metavar="K",
                    help="also run with SamplingParams(logprobs=K), side by side: the throughput cost")
    ap.add_argument("--profile", metavar="DIR", help="torch profiler traces of a few worker steps into DIR")
    ap.add_argument("--profile-steps", type=int, default=4)
    ap.add_argument("--profile-skip", type=int, default=40, help="steps of the timed run before the trace")
    args = ap.parse_args()

    model_dir = make_random_model(args.shape, args.model_dir)
    prompts, out_lens = make_workload(args.workload, SHAPES[args.shape]["vocab_size"])
    n_in = sum(map(len, prompts))
    print(f"workload {args.workload}: {len(prompts)} seqs, {n_in} prompt tokens, {sum(out_lens)} output tokens")
    tag = {"qwen3-0.6b": "qwen3_0p6b", "llama-3.1-8b": "llama8b"}[args.shape]
    # The first admission_min_batch value gives the headline figure; others are recorded with a suffix.
    for i, admit in enumerate(args.admission_min_batch):
        ours = run_kvray(model_dir, prompts, out_lens, args, admit)
        tok_s = ours["output_tokens"] / ours["elapsed_s"]
        print(f"kvray (admission_min_batch={admit}): {ours}  -> {tok_s:.0f} output tok/s, "
              f"{(ours['output_tokens'] + n_in) / ours['elapsed_s']:.0f} total tok/s", flush=True)
        record("bench_offline", f"offline_{tag}_output_tok_s_admit{admit}", tok_s, "tok/s")
        if i == 0:
            record("bench_offline", f"offline_{tag}_output_tok_s", tok_s, "tok/s")
            headline_tok_s = tok_s
    if args.logprobs is not None:
        with_lp = run_kvray(model_dir, prompts, out_lens, args, args.admission_min_batch[0], args.logprobs)
        lp_tok_s = with_lp["output_tokens"] / with_lp["elapsed_s"]
        print(f"kvray with logprobs={args.logprobs}: {lp_tok_s:.0f} output tok/s "
              f"({lp_tok_s / headline_tok_s:.3f} of without)", flush=True)
        record("bench_offline", f"offline_{tag}_logprobs{args.logprobs}_output_tok_s", lp_tok_s, "tok/s")
        record("bench_offline", f"offline_{tag}_logprobs{args.logprobs}_vs_none_ratio", lp_tok_s / headline_tok_s, "x")
    if args.hf:
        hf = run_hf(model_dir, prompts, out_lens)
        hf_tok_s = hf["output_tokens"] / hf["elapsed_s"]
        print(f"hf: {hf} -> {hf_tok_s:.0f} output tok/s")
        record("bench_offline", f"offline_{tag}_hf_output_tok_s", hf_tok_s, "tok/s")
        record("bench_offline", f"offline_{tag}_vs_hf_ratio", tok_s / hf_tok_s, "x")


if __name__ == "__main__":
    main()
