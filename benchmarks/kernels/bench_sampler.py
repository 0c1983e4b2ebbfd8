"""The one-launch sampler against its torch reference, side by side in one run.

Logits float32 [rows, vocab] (default 256 x 151,936, the Qwen3 vocabulary), every row random unless
the case says greedy. Cases: greedy (argmax); temperature 0.6 (nano-vllm's recipe); temperature with
top-k 50 and top-p 0.9; temperature with presence/frequency/repetition penalties; temperature with
logprobs=5. The sampler is timed eagerly and as a CUDA-graph replay (it is capturable: no host
sync, fixed shapes); the torch reference (actors/sample/reference.py: a full sort for top-k/top-p) eagerly.
Median microseconds per step. The floor is reading the logits once: rows x vocab x 4 bytes at the
GPU's bandwidth (~32 us for 256 x 151,936 on an H200), which the figures report beside the times.

Then the logprobs alone (bf16-valued float32 logits, as the LM head makes them, full of ties): the torch
path and the kernel, at rows x vocab for k in --ks; and prompt logprobs of --prompt-rows positions through
compute_prompt_logprobs (slices of PROMPT_SLICE rows; compute_logits is the identity over precomputed
logits, so the figure holds the slices' row gather but no LM head), torch against the kernel. The
kernel must agree with torch (values; ties may name other ids).

  python -m benchmarks.kernels.bench_sampler            # GPU, appends to results/bench_sampler.jsonl
  python -m benchmarks.kernels.bench_sampler --logprobs-only   # GPU, the logprobs part only
  python -m benchmarks.kernels.bench_sampler --smoke    # CPU, tiny shapes, Triton interpreter: errors only
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import torch

from actors.sample.logprobs import LogprobsTensors, compute_logprobs, logprobs_reference
from actors.sample.penalties import PenaltyState
from actors.sample.reference import sample_reference
from actors.sample.sampler import Sampler, SamplingMetadata
from actors.sample.step_logprobs import PromptPlan, compute_prompt_logprobs
from benchmarks.common import record

SCRIPT = "bench_sampler"


def bench(fn: Callable[[], object], smoke: bool, graph: bool = False) -> float:
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


def torch_reference_tokens(logits: torch.Tensor, md: SamplingMetadata, pen: dict) -> torch.Tensor:
    """The plain-torch sampler's tokens for one case (argmax where the case is greedy)."""
    if md.plain_argmax:
        return logits.argmax(dim=-1)
    return sample_reference(logits, md.temperature, md.top_k, md.top_p, md.seeds, md.positions, **pen)


def sample_float32_copy(sampler: Sampler, logits: torch.Tensor, md: SamplingMetadata) -> object:
    """The path before bf16 logits were read directly: a float32 copy first (timed with the sampler)."""
    return sampler(logits.float(), md)


def make_case(name: str, rows: int, vocab: int, dev: torch.device) -> tuple[SamplingMetadata, PenaltyState | None]:
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
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 5, 20], help="logprobs k of the logprobs part")
    ap.add_argument("--prompt-rows", type=int, default=4096)
    ap.add_argument("--prompt-k", type=int, default=5)
    ap.add_argument("--logprobs-only", action="store_true", help="skip the sampler cases")
    ap.add_argument(
        "--shares-only", action="store_true", help="only vocabulary shares and the logits dtype, side by side"
    )
    args = ap.parse_args(argv)
    smoke = args.smoke
    dev = torch.device("cpu" if smoke else "cuda")
    rows, vocab = (4, 64) if smoke else (args.rows, args.vocab)
    bench_vocab_shares([3, 5] if smoke else [16, 48, 128, 256], vocab, dev, smoke)
    bench_logits_dtype([3] if smoke else [16, 128, 256], vocab, dev, smoke)
    if args.shares_only:
        return
    if not args.logprobs_only:
        bench_sampler_cases(rows, vocab, dev, smoke)
    lp_rows, lp_vocab, prompt_rows = (3, 5000, 4) if smoke else (rows, vocab, args.prompt_rows)
    bench_logprobs(lp_rows, lp_vocab, args.ks, dev, smoke)
    bench_prompt_logprobs(prompt_rows, lp_vocab, args.prompt_k, dev, smoke)


def lm_logits(rows: int, vocab: int, dev: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(dev).manual_seed(seed)
    logits = (torch.randn(rows, vocab, device=dev, generator=g) * 3).bfloat16().float()
    return logits, torch.randint(0, vocab, (rows,), device=dev, generator=g)


def check_logprobs(got: LogprobsTensors, ref: LogprobsTensors, what: str) -> None:
    """Own token, rank and logprob values as the torch path's (the top-k ids of tied values may differ)."""
    ok = torch.equal(got.token_ids[:, 0], ref.token_ids[:, 0]) and torch.equal(got.ranks, ref.ranks)
    ok = ok and torch.allclose(got.logprobs, ref.logprobs, atol=1e-4, rtol=0)
    if not ok:
        raise SystemExit(f"{what}: the kernel's logprobs differ from the torch path's")


def bench_logprobs(rows: int, vocab: int, ks: list[int], dev: torch.device, smoke: bool) -> None:
    logits, tokens = lm_logits(rows, vocab, dev, 1)
    floor_us = rows * vocab * 4 / 4.8e12 * 1e6
    print(f"logprobs, {rows} x {vocab} bf16-valued logits (one read at 4.8 TB/s: {floor_us:.1f} us)", flush=True)
    for k in ks:
        now = compute_logprobs(logits, tokens, k, use_triton=True)
        check_logprobs(now, logprobs_reference(logits, tokens, k), f"k={k}")
        torch_us = bench(functools.partial(logprobs_reference, logits, tokens, k), smoke)
        now_us = bench(functools.partial(compute_logprobs, logits, tokens, k, use_triton=True), smoke)
        print(
            f"  k={k:<3d} torch {torch_us:9.1f} us  kernel {now_us:9.1f} us  torch/kernel {torch_us / now_us:5.1f}x",
            flush=True,
        )
        if not smoke:
            name = f"logprobs_k{k}_{rows}x{vocab}"
            record(SCRIPT, f"{name}_torch_us", torch_us, "us")
            record(SCRIPT, f"{name}_kernel_us", now_us, "us")


def bench_prompt_logprobs(rows: int, vocab: int, k: int, dev: torch.device, smoke: bool) -> None:
    logits, targets = lm_logits(rows, vocab, dev, 2)
    plan = PromptPlan(np.arange(rows, dtype=np.int64), targets.cpu().numpy(), [("p", rows, k)], k)

    def run(use_triton: bool) -> LogprobsTensors:
        return compute_prompt_logprobs(lambda h: h, logits, plan, use_triton)

    kern, ref = run(True), run(False)
    check_logprobs(kern, ref, f"prompt logprobs, {rows} rows")
    torch_us, kern_us = bench(lambda: run(False), smoke), bench(lambda: run(True), smoke)
    print(
        f"prompt logprobs, {rows} positions x {vocab}, k={k}: torch {torch_us / 1e3:8.3f} ms  "
        f"kernel {kern_us / 1e3:8.3f} ms  torch/kernel {torch_us / kern_us:5.1f}x",
        flush=True,
    )
    if not smoke:
        name = f"prompt_logprobs_k{k}_{rows}x{vocab}"
        record(SCRIPT, f"{name}_torch_us", torch_us, "us")
        record(SCRIPT, f"{name}_kernel_us", kern_us, "us")
        record(SCRIPT, f"{name}_torch_vs_kernel_ratio", torch_us / kern_us, "x")


def bench_sampler_cases(rows: int, vocab: int, dev: torch.device, smoke: bool) -> None:
    logits = torch.randn(rows, vocab, device=dev, generator=torch.Generator(dev).manual_seed(0)) * 4
    floor_us = rows * vocab * 4 / 4.8e12 * 1e6
    print(f"{rows} rows x {vocab} vocab; one read of the logits at 4.8 TB/s: {floor_us:.1f} us", flush=True)
    for name in ("greedy", "temperature", "top_k_top_p", "penalties", "logprobs5"):
        md, state = make_case(name, rows, vocab, dev)
        sampler = Sampler(state)
        if state is not None:
            state.record = lambda slots, tokens: None  # keep the counts fixed across timing repetitions
        new_us = bench(functools.partial(sampler, logits, md), smoke)
        graph_us = float("nan") if smoke else bench(functools.partial(sampler, logits, md), smoke, graph=True)
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

        reference = functools.partial(torch_reference_tokens, logits, md, pen)
        torch_us = bench(reference, smoke)
        same = float((sampler(logits, md).token_ids == reference()).float().mean())
        print(
            f"{name:12s} kernel {new_us:9.1f} us  (graph {graph_us:8.1f})  torch {torch_us:10.1f} us  "
            f"torch/kernel {torch_us / new_us:6.1f}x  tokens == torch reference: {same:.3f}",
            flush=True,
        )
        if not smoke:
            record(SCRIPT, f"sampler_{name}_us_{rows}x{vocab}", graph_us, "us")
            record(SCRIPT, f"sampler_{name}_torch_us_{rows}x{vocab}", torch_us, "us")


def bench_vocab_shares(row_counts: list[int], vocab: int, dev: torch.device, smoke: bool) -> None:
    """The temperature case (nano's recipe) with one program a row, as before vocabulary shares, against
    the default split (actors.sample.kernel.vocab_shares), side by side; the tokens must be identical."""
    import actors.sample.kernel as sk

    default_shares = sk.vocab_shares
    for rows in row_counts:
        logits = torch.randn(rows, vocab, device=dev, generator=torch.Generator(dev).manual_seed(1)) * 4
        md, _ = make_case("temperature", rows, vocab, dev)
        sampler = Sampler()
        times, tokens = {}, {}
        for label, fn in (("one_program_a_row", lambda blocks, tiles, device: 1), ("shares", default_shares)):
            sk.vocab_shares = fn
            try:
                tokens[label] = sampler(logits, md).token_ids.clone()
                times[label] = bench(functools.partial(sampler, logits, md), smoke, graph=not smoke)
            finally:
                sk.vocab_shares = default_shares
        same = bool(torch.equal(tokens["one_program_a_row"], tokens["shares"]))
        ratio = times["one_program_a_row"] / times["shares"]
        print(
            f"temperature {rows:4d} x {vocab}: one program a row {times['one_program_a_row']:8.1f} us, "
            f"vocabulary shares {times['shares']:8.1f} us ({ratio:.2f}x), tokens identical: {same}",
            flush=True,
        )
        if not same:
            raise SystemExit("vocabulary shares changed the sampled tokens")
        if not smoke:
            record(SCRIPT, f"sampler_temperature_shares_us_{rows}x{vocab}", times["shares"], "us")
            record(SCRIPT, f"sampler_temperature_one_program_us_{rows}x{vocab}", times["one_program_a_row"], "us")


def bench_logits_dtype(row_counts: list[int], vocab: int, dev: torch.device, smoke: bool) -> None:
    """The temperature case from the LM head's bf16 logits: a float32 copy first and the sampler on it,
    as before, against the sampler reading the bf16 logits (now); the tokens must be identical (the
    cast is exact, and the kernel computes in float32 either way)."""
    for rows in row_counts:
        g = torch.Generator(dev).manual_seed(2)
        logits = (torch.randn(rows, vocab, device=dev, generator=g) * 4).bfloat16()
        md, _ = make_case("temperature", rows, vocab, dev)
        sampler = Sampler()
        same = bool(torch.equal(sampler(logits.float(), md).token_ids, sampler(logits, md).token_ids))
        before = bench(functools.partial(sample_float32_copy, sampler, logits, md), smoke, graph=not smoke)
        now = bench(functools.partial(sampler, logits, md), smoke, graph=not smoke)
        print(
            f"temperature {rows:4d} x {vocab}: float32 copy + sampler {before:8.1f} us, sampler on bf16 "
            f"{now:8.1f} us ({before / now:.2f}x), tokens identical: {same}",
            flush=True,
        )
        if not same:
            raise SystemExit("reading bf16 logits changed the sampled tokens")
        if not smoke:
            record(SCRIPT, f"sampler_temperature_bf16_us_{rows}x{vocab}", now, "us")
            record(SCRIPT, f"sampler_temperature_cast_fp32_us_{rows}x{vocab}", before, "us")


if __name__ == "__main__":
    main()
