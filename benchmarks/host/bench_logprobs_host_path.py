"""What logprobs add to the whole host path, end to end through Ray, with no model: LLM.generate -> driver
actor -> a worker actor that samples a fixed token at once but builds its logprob messages with the real
runner code (LogprobsCollector over one step's [rows, 1 + k] host arrays) -> the driver -> the client's
OutputProcessor (vLLM's dicts, decoded tokens, with a byte-level tokenizer of the full vocabulary).

With the GPU's work gone, a step is only host work, so the difference between the variants is what
logprobs cost the engine's processes a step; on the GPU that cost adds to (or hides behind) the ~10 ms
decode step of bench_api_features.py.

  python -m benchmarks.host.bench_logprobs_host_path [--num-prompts 256] [--output-len 64] [--vocab 151936]
  python -m benchmarks.host.bench_logprobs_host_path --smoke     # 8 prompts x 4 tokens, vocab 2,000 (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actors.sample.logprobs import LogprobsTensors
from actors.sample.step_logprobs import LogprobsCollector, launch_copies
from actors.worker.noop import NoopWorker
from benchmarks.common import SHAPES
from kvcore.messages import ModelRunnerOutput, SchedulerOutput

WORKER = "benchmarks.host.bench_logprobs_host_path.LogprobsNoopWorker"


class LogprobsNoopWorker(NoopWorker):
    """NoopWorker whose sampled rows carry logprob messages, built as the model runner builds them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.k: dict[str, int] = {}
        self.collector = LogprobsCollector()
        self.rng = torch.Generator().manual_seed(0)
        self.vocab = int(os.environ.get("KVRAY_BENCH_VOCAB", "151936"))

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        for nr in so.scheduled_new_reqs:
            lp = nr.sampling_params.logprobs
            self.k[nr.req_id] = -1 if lp is None else lp
        out = super().execute_model(so)
        if out is None or not out.req_ids:
            return out
        rows = np.array([i for i, t in enumerate(out.sampled_token_ids) if t], dtype=np.int64)
        ks = np.array([self.k.get(out.req_ids[r], -1) for r in rows.tolist()], dtype=np.int32)
        if not len(rows) or ks.max() < 0:
            return out
        width = 1 + int(ks.max())
        n = len(rows)
        tensors = LogprobsTensors(
            torch.randint(0, self.vocab, (n, width), generator=self.rng, dtype=torch.int32),
            -torch.rand(n, width, generator=self.rng) * 10,
            torch.randint(1, 100, (n,), generator=self.rng, dtype=torch.int32),
        )
        step = launch_copies(tensors, ks, None, None, cuda=False)
        out.logprobs, _ = self.collector.collect(step, out.req_ids, rows)
        return out


def model_dir(vocab: int) -> str:
    """config.json (the 0.6B shape at this vocabulary) and a byte-level tokenizer.json; no weights."""
    from benchmarks.common import add_byte_tokenizer

    d = os.path.join(tempfile.gettempdir(), f"kvray-hostpath-{vocab}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**SHAPES["qwen3-0.6b"], "vocab_size": vocab}, f)
    add_byte_tokenizer(d, vocab)
    return d


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--smoke", action="store_true", help="8 prompts x 4 tokens over a 2,000 vocabulary")
    args = ap.parse_args(argv)
    if args.smoke:
        args.num_prompts, args.output_len, args.vocab = 8, 4, 2000
    os.environ["KVRAY_BENCH_VOCAB"] = str(args.vocab)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
    )  # the actors import WORKER

    from cluster import LLM, SamplingParams

    llm = LLM(
        model=model_dir(args.vocab),
        worker_cls=WORKER,
        device="cpu",
        dtype="float32",
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=8192,
        num_gpu_blocks=8192,
        max_model_len=args.prompt_len + args.output_len + 16,
    )
    rng = random.Random(0)
    common = dict(temperature=0.8, top_p=0.95, max_tokens=args.output_len, ignore_eos=True, seed=0)
    variants = {
        "base": SamplingParams(**common),
        "logprobs": SamplingParams(**common, logprobs=5),
        "base_again": SamplingParams(**common),
        "logprobs_again": SamplingParams(**common, logprobs=5),
    }
    tok_s = {}
    try:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 8, variants["logprobs"], use_tqdm=False)  # warm-up
        for name, sp in variants.items():
            prompts = [
                {"prompt_token_ids": [rng.randrange(256) for _ in range(args.prompt_len)]}
                for _ in range(args.num_prompts)
            ]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
            assert all(o.error is None for o in outs) and n_out == args.num_prompts * args.output_len
            if sp.logprobs is not None:
                assert all(len(c.logprobs or []) == args.output_len for o in outs for c in o.outputs)
            tok_s[name] = n_out / elapsed
            print(
                f"{name:15s} {n_out} tokens in {elapsed:.2f} s -> {tok_s[name]:.0f} output tok/s "
                f"({elapsed / args.output_len * 1e3:.2f} ms a step of {args.num_prompts} rows)",
                flush=True,
            )
    finally:
        llm.shutdown()
    base = (tok_s["base"] + tok_s["base_again"]) / 2
    lp = (tok_s["logprobs"] + tok_s["logprobs_again"]) / 2
    rows = args.num_prompts
    print(f"logprobs: {lp / base:.3f} x base; added {(rows / lp - rows / base) * 1e3:.2f} ms a step of {rows} rows")


if __name__ == "__main__":
    main()
