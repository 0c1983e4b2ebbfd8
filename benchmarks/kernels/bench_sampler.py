"""The one-launch sampler against the sampler it replaced, side by side in one run.

Logits float32 [rows, vocab] (default 256 x 151,936, the Qwen3 vocabulary), every row random unless
the case says greedy. Cases: greedy (argmax); temperature 0.6 (nano-vllm's recipe); temperature with
top-k 50 and top-p 0.9; temperature with presence/frequency/repetition penalties; temperature with
logprobs=5. The new sampler is timed eagerly and as a CUDA-graph replay (it is capturable: no host
sync, fixed shapes); the old one (a torch.Generator per row, a full sort for top-k/top-p) eagerly.
Median microseconds per step. The floor is reading the logits once: rows x vocab x 4 bytes at the
GPU's bandwidth (~32 us for 256 x 151,936 on an H200), which the figures report beside the times.

  python benchmarks/kernels/bench_sampler.py            # GPU, appends to results/bench_sampler.jsonl
  python benchmarks/kernels/bench_sampler.py --smoke    # CPU, tiny shapes, Triton interpreter: errors only
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Its own folder (sibling scripts), benchmarks/ (common.py) and the repo root (kvcore, actors, cluster):
# the one import pattern of benchmarks/README.md.
sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:3]]
import torch  # noqa: E402
from common import record  # noqa: E402

from actors.penalty_state import PenaltyState  # noqa: E402
from actors.sample_reference import sample_reference  # noqa: E402
from actors.sampler import Sampler, SamplingMetadata  # noqa: E402

SCRIPT = "bench_sampler"


def old_sampler(logits, temperature, top_k, top_p, generators):
    """The sampler before the one-launch kernel (actors/sampler.py at a98f795), condensed."""
    logits = logits.float()
    scaled = logits / temperature.unsqueeze(1)
    if top_k is not None or top_p is not None:
        vocab = logits.shape[-1]
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if top_k is not None:
            drop |= ranks >= top_k.to(torch.int64).unsqueeze(1)
        if top_p is not None:
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            drop |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
            drop[:, 0] = False
        scaled = torch.empty_like(logits).scatter_(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for r, g in enumerate(generators):
        noise[r].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


def bench(fn, smoke: bool, graph: bool = False) -> float:
    if smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    import triton.testing

    fn()
    torch.cuda.synchronize()
    if graph:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
    return 1e3 * triton.testing.do_bench(fn, rep=200, return_mode="median")


def make_case(name: str, rows: int, vocab: int, dev: torch.device):
    ones = torch.ones(rows, device=dev)
    zeros_i = torch.zeros(rows, dtype=torch.int32, device=dev)
    md = dict(
        temperature=ones * 0.6,
        top_k=zeros_i,
        top_p=ones.clone(),
        seeds=torch.arange(rows, dtype=torch.int64, device=dev) * 7919,
        positions=torch.full((rows,), 100, dtype=torch.int64, device=dev),
        all_greedy=False,
        need_filter=False,
    )
    state = None
    if name == "greedy":
        md.update(all_greedy=True)
    elif name == "top_k_top_p":
        md.update(top_k=zeros_i + 50, top_p=ones * 0.9, need_filter=True)
    elif name == "penalties":
        state = PenaltyState(vocab, dev, initial_slots=rows)
        g = torch.Generator().manual_seed(0)
        slots = [
            state.add(
                f"r{i}",
                torch.randint(0, vocab, (200,), generator=g).tolist(),
                torch.randint(0, vocab, (100,), generator=g).tolist(),
            )
            for i in range(rows)
        ]
        md.update(
            penalty_slots=torch.tensor(slots, device=dev),
            penalties=torch.tensor([[0.5], [0.3], [1.2]], device=dev).expand(3, rows).contiguous(),
        )
    elif name == "logprobs5":
        md.update(num_logprobs=5)
    return SamplingMetadata(**md), state


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args(argv)
    smoke = args.smoke
    dev = torch.device("cpu" if smoke else "cuda")
    rows, vocab = (4, 64) if smoke else (args.rows, args.vocab)
    logits = torch.randn(rows, vocab, device=dev, generator=torch.Generator(dev).manual_seed(0)) * 4
    floor_us = rows * vocab * 4 / 4.8e12 * 1e6
    print(f"{rows} rows x {vocab} vocab; one read of the logits at 4.8 TB/s: {floor_us:.1f} us", flush=True)
    for name in ("greedy", "temperature", "top_k_top_p", "penalties", "logprobs5"):
        md, state = make_case(name, rows, vocab, dev)
        sampler = Sampler(state)
        if state is not None:
            state.record = lambda slots, tokens: None  # keep the counts fixed across timing repetitions
        new_us = bench(lambda: sampler(logits, md), smoke)
        graph_us = float("nan") if smoke else bench(lambda: sampler(logits, md), smoke, graph=True)
        gens = [torch.Generator(dev).manual_seed(i) for i in range(rows)]
        tk = md.top_k if md.need_filter else None
        tp = md.top_p if md.need_filter else None
        if name == "greedy":

            def old_fn() -> torch.Tensor:
                return logits.argmax(dim=-1)
        else:

            def old_fn() -> torch.Tensor:
                return old_sampler(logits, md.temperature, tk, tp, gens)

        old_us = bench(old_fn, smoke)
        if not md.plain_argmax:
            pen = (
                {}
                if state is None
                else dict(
                    penalty_slots=md.penalty_slots,
                    penalties=md.penalties,
                    counts=state.counts,
                    prompt_mask=state.prompt_mask,
                )
            )
            ref = sample_reference(logits, md.temperature, md.top_k, md.top_p, md.seeds, md.positions, **pen)
            same = float((sampler(logits, md).token_ids == ref).float().mean())
        else:
            same = 1.0
        print(
            f"{name:12s} new {new_us:9.1f} us  (graph {graph_us:8.1f})  old {old_us:10.1f} us  "
            f"old/new {old_us / new_us:6.1f}x  tokens == torch reference: {same:.3f}",
            flush=True,
        )
        if not smoke:
            record(SCRIPT, f"sampler_{name}_us_{rows}x{vocab}", graph_us, "us")
            record(SCRIPT, f"sampler_{name}_old_us_{rows}x{vocab}", old_us, "us")
            record(SCRIPT, f"sampler_{name}_old_vs_new_ratio", old_us / graph_us, "x")


if __name__ == "__main__":
    main()
