"""Batch-1 decode: milliseconds per output token of one greedy request, and the weight bandwidth that makes.

A batch-1 decode step reads every weight once, so its floor is the weights' bytes over the device's copy
bandwidth. This script measures both in one process: the copy bandwidth first (a 1 GiB device-to-device
copy, read + write bytes over time, median of 20), then the engine on one 128-token prompt,

    time per token = (generate(1 + N tokens) - generate(1 token)) / N      (median of --reps pairs)

so that the prompt's prefill and the first token drop out. The weights' bytes are the checkpoint's
safetensors files (a bf16 random-weight model: 16.06 GB for the Llama-3.1-8B shape).

--engine kvray (the default) or vllm: the same prompt and method on vLLM, run under vLLM's python (the
vs-vllm suite's vLLM side, benchmarks/README.md). Records batch1_ms_per_token_<tag> and
batch1_weight_bw_frac_<tag> (weight bytes per token / time per token / copy bandwidth) and
device_copy_gbs; vLLM's figures carry a vllm_ prefix, in the vs_vllm series.

  python -m benchmarks.e2e.bench_batch1_decode --shape llama-3.1-8b
  python -m benchmarks.e2e.bench_batch1_decode --smoke        # CPU, tiny-random, nothing recorded
  python -m benchmarks.e2e.bench_batch1_decode --profile /tmp/trace-b1   # + a torch-profiler trace of 5 steps

--profile DIR (kvray only): after the timing, a trace of a few decode steps of one more request, for
benchmarks/tools/summarize_trace.py (where the batch-1 step's time goes, kernel by kernel).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import copy_bandwidth_gbs, make_random_model, record, vocab_size

TAGS = {"qwen3-0.6b": "qwen3_0p6b", "llama-3.1-8b": "llama8b"}
PROMPT_LEN = 128


def weight_bytes(model_dir: str) -> int:
    """The checkpoint's weight bytes: its safetensors files (a header of a few KB each aside)."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def ms_per_token(generate: Callable[[int], None], new_tokens: int, reps: int) -> float:
    """(generate(1 + N) - generate(1)) / N in ms, median over `reps` interleaved pairs, after a warm-up."""
    generate(1 + new_tokens)  # warm-up: compiles, graph capture, allocator
    per_token = []
    for _ in range(reps):
        t0 = time.perf_counter()
        generate(1)
        one = time.perf_counter() - t0
        t0 = time.perf_counter()
        generate(1 + new_tokens)
        many = time.perf_counter() - t0
        per_token.append((many - one) / new_tokens * 1e3)
    return statistics.median(per_token)


def trace_steps(llm: Any, generate: Callable[[int], None], trace_dir: str, steps: int = 5) -> None:
    """A torch-profiler trace of `steps` decode steps of one more request (after its prefill and 10 steps)."""
    import ray

    driver = llm.engines.drivers[0]
    ray.get(driver.start_profile.remote(trace_dir, steps, 10))
    generate(10 + steps + 8)
    print("profile traces:", ray.get(driver.stop_profile.remote()), flush=True)


def kvray_generate(model_dir: str, prompt: list[int], smoke: bool) -> tuple[Any, Callable[[int], None]]:
    """An LLM on the model (defaults; the CPU and float32 in smoke) and its batch-1 greedy generate."""
    from cluster import LLM, SamplingParams

    extra = {"device": "cpu", "dtype": "float32", "cpu_kv_cache_gib": 0.05} if smoke else {"device": "cuda"}
    llm = LLM(model=model_dir, **extra)

    def generate(n: int) -> None:
        out = llm.generate(
            [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        )
        got = len(out[0].outputs[0].token_ids)
        if got != n:
            raise RuntimeError(f"kvray produced {got} tokens, not {n}")

    return llm, generate


def vllm_generate(model_dir: str, prompt: list[int]) -> tuple[Any, Callable[[int], None]]:
    """vLLM's LLM on the model (defaults, bf16, no tokenizer) and its batch-1 greedy generate."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16")

    def generate(n: int) -> None:
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
        got = len(out[0].outputs[0].token_ids)
        if got != n:
            raise RuntimeError(f"vLLM produced {got} tokens, not {n}")

    return llm, generate


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(TAGS), default="llama-3.1-8b")
    ap.add_argument("--model-dir", default="/tmp/kvray-models")
    ap.add_argument("--engine", choices=["kvray", "vllm"], default="kvray")
    ap.add_argument("--new-tokens", type=int, default=256, help="N: the tokens timed after the first")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny-random, 4 tokens, nothing recorded")
    ap.add_argument("--profile", metavar="DIR", help="kvray: a torch-profiler trace of 5 decode steps after the timing")
    args = ap.parse_args(argv)
    if args.smoke and args.engine != "kvray":
        ap.error("--smoke runs kvray on the CPU; --engine vllm needs vLLM's GPU environment")
    if args.profile and args.engine != "kvray":
        ap.error("--profile traces kvray's worker; vLLM has its own profiler")
    tag = TAGS[args.shape]
    device = "cpu" if args.smoke else "cuda"
    copy_gbs = copy_bandwidth_gbs(device, nbytes=1 << 24 if args.smoke else 1 << 30)
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s", flush=True)

    if args.smoke:
        model_dir, vocab, new_tokens, reps = "tiny-random", 200, 4, 1
    else:
        model_dir, vocab = make_random_model(args.shape, args.model_dir), vocab_size(args.shape)
        new_tokens, reps = args.new_tokens, args.reps
    prompt = np.random.default_rng(0).integers(3, min(vocab, 100_000), PROMPT_LEN).tolist()
    llm, generate = (
        vllm_generate(model_dir, prompt) if args.engine == "vllm" else kvray_generate(model_dir, prompt, args.smoke)
    )
    try:
        ms = ms_per_token(generate, new_tokens, reps)
        if args.profile:
            trace_steps(llm, generate, args.profile)
    finally:
        if args.engine == "kvray":
            llm.shutdown()
    print(f"{args.engine} batch-1 decode, {args.shape}: {ms:.3f} ms per token", flush=True)
    if args.smoke:
        return
    frac = weight_bytes(model_dir) / (ms / 1e3) / (copy_gbs * 1e9)
    print(f"weights {weight_bytes(model_dir) / 1e9:.2f} GB a token: {frac:.3f} of the copy bandwidth", flush=True)
    if args.engine == "vllm":
        record("vs_vllm", f"vllm_batch1_ms_per_token_{tag}", ms, "ms")
        record("vs_vllm", f"vllm_batch1_weight_bw_frac_{tag}", frac, "fraction")
        return
    record("bench_batch1_decode", "device_copy_gbs", copy_gbs, "GB/s")
    record("bench_batch1_decode", f"batch1_ms_per_token_{tag}", ms, "ms")
    record("bench_batch1_decode", f"batch1_weight_bw_frac_{tag}", frac, "fraction")


if __name__ == "__main__":
    main()
