"""The throughput cost of logprobs=5, n=4 and stop strings, side by side in one run on one engine.

Every variant generates the same number of output tokens (EOS ignored, fixed lengths, stop strings that
never match) from the same kind of prompts, so tok/s compare directly:
  base      N prompts, one sample each, temperature 0.8 / top_p 0.95
  logprobs  the same with logprobs=5 (top-5 plus the sampled token's, on the device and to the client)
  n4        N/4 prompts with n=4 (4 children sharing the prompt's KV through the prefix cache)
  stop      the same as base with 4 stop strings checked on the incrementally detokenized text
base runs first and last (its spread is the noise). The random-weight model gets a byte-level BPE
tokenizer of its full vocabulary (random 2-6 byte tokens), so detokenization does real work.

  python -m benchmarks.e2e.bench_api_features --shape qwen3-0.6b            # GPU
  python -m benchmarks.e2e.bench_api_features --smoke                       # CPU, tiny-random, seconds
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from benchmarks.common import SHAPES, add_byte_tokenizer, make_random_model, record

STOPS = ["\x00never-1\x00", "\x00never-2\x00", "\x00never-3\x00", "\x00never-4\x00"]  # ids never decode to NUL


def variants(n: int, out_len: int) -> dict:
    from cluster import SamplingParams

    common = dict(temperature=0.8, top_p=0.95, max_tokens=out_len, ignore_eos=True, seed=0)
    return {
        "base": (n, SamplingParams(**common)),
        "logprobs": (n, SamplingParams(**common, logprobs=5)),
        "n4": (n // 4, SamplingParams(**common, n=4)),
        "stop": (n, SamplingParams(**common, stop=STOPS)),
        "base_again": (n, SamplingParams(**common)),
    }


def run_variant(llm: Any, prompts: list[list[int]], sp: Any) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    for o in outs:
        if o.error is not None:
            raise RuntimeError(o.error)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return elapsed, n_out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--model-dir", default="/tmp/kvray-models")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="tiny-random on the CPU, a few tokens")
    args = ap.parse_args(argv)

    from cluster import LLM

    if args.smoke:
        model, vocab, tag = "tiny-random", 256, "smoke"
        n, in_len, out_len = 8, 24, 6
        llm = LLM(
            model=model,
            device="cpu",
            dtype="float32",
            block_size=8,
            max_num_seqs=16,
            max_num_batched_tokens=256,
            cpu_kv_cache_gib=0.02,
        )
    else:
        model = make_random_model(args.shape, args.model_dir)
        vocab = SHAPES[args.shape]["vocab_size"]
        add_byte_tokenizer(model, vocab)
        n, in_len, out_len = args.num_prompts, args.prompt_len, args.output_len
        tag = {"qwen3-0.6b": "qwen3_0p6b", "llama-3.1-8b": "llama8b"}[args.shape]
        llm = LLM(
            model=model,
            device="cuda",
            dtype="bfloat16",
            max_model_len=in_len + out_len + 16,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            gpu_memory_utilization=0.85,
        )
    rng = random.Random(0)
    try:
        run_variant(
            llm, [[rng.randrange(vocab) for _ in range(in_len)] for _ in range(8)], variants(8, 8)["logprobs"][1]
        )  # warm-up, logprobs path included
        tok_s = {}
        for name, (count, sp) in variants(n, out_len).items():
            prompts = [[rng.randrange(vocab) for _ in range(in_len)] for _ in range(count)]
            elapsed, n_out = run_variant(llm, prompts, sp)
            tok_s[name] = n_out / elapsed
            print(
                f"{name:10s} {count:4d} prompts x n={sp.n}: {n_out} tokens in {elapsed:.2f} s -> "
                f"{tok_s[name]:.0f} output tok/s",
                flush=True,
            )
    finally:
        llm.shutdown()
    base = (tok_s["base"] + tok_s["base_again"]) / 2
    print(f"base spread (first vs last run): {abs(tok_s['base'] - tok_s['base_again']) / base:.1%}")
    if args.smoke:  # a check that the script runs; CPU figures under the Triton interpreter mean nothing
        for name in ("logprobs", "n4", "stop"):
            print(f"{name}: {tok_s[name] / base:.3f} x base (smoke, not recorded)")
        return
    record("bench_api_features", f"api_{tag}_base_output_tok_s", base, "tok/s")
    for name in ("logprobs", "n4", "stop"):
        print(f"{name}: {tok_s[name] / base:.3f} x base")
        record("bench_api_features", f"api_{tag}_{name}_vs_base", tok_s[name] / base, "x")


if __name__ == "__main__":
    main()
