"""Where a logprobs step's time goes, stage by stage, on this machine (no GPU, no Ray needed).

One decode step of `--rows` requests over a `--vocab` vocabulary, through the real code of each stage:
  device          compute_logprobs on [rows, vocab] float32 logits (on the CPU here the torch path: a GPU runs
                  the Triton kernel, so this figure only says how much work there is, not its GPU time)
  worker_collect  the host copies and LogprobsCollector.collect: the per-request Logprobs messages
  worker_dumps    ModelRunnerOutput pickled (protocol 5, out-of-band buffers, as Ray does) ...
  driver_loads    ... and unpickled by the driver
  driver_attach   attach_logprobs onto the scheduler's EngineCoreOutputs
  driver_dumps    the driver's PollResult of those outputs pickled (the client's poll) ...
  client_loads    ... and unpickled by the client
  client_process  OutputProcessor.process_output of every output, with a byte-level BPE tokenizer of
                  the full vocabulary (common.add_byte_tokenizer), as LLM.generate runs it
  client_read     off the engine's path: the user reading every new position's {token_id: Logprob}
                  dict (built on first read, cluster/logprobs.PositionLogprobs)
Each stage also runs with logprobs off (the base), so the table shows what logprobs add per step.

  python -m benchmarks.host.bench_logprobs_stages                 # 256 rows, 151936 vocab, k=5
  python -m benchmarks.host.bench_logprobs_stages --profile client_process   # cProfile of one stage
  python -m benchmarks.host.bench_logprobs_stages --device-breakdown cuda      # the device stage's kernels, GPU
  python -m benchmarks.host.bench_logprobs_stages --smoke      # 8 rows, vocab 2,000, 2 steps (CI)
"""

from __future__ import annotations

import argparse
import cProfile
import pickle
import pstats
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch

from actors.messages import PollResult
from actors.sample.logprobs import compute_logprobs, logprobs_reference
from actors.sample.step_logprobs import LogprobsCollector, launch_copies
from kvcore.messages import EngineCoreOutput, ModelRunnerOutput
from kvcore.request import SamplingParams
from kvcore.sched.logprob_outputs import attach_logprobs


def dumps(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Ray's way: pickle protocol 5 with the arrays' buffers out of band."""
    buffers: list[pickle.PickleBuffer] = []
    return pickle.dumps(obj, protocol=5, buffer_callback=buffers.append), buffers


def loads(msg: tuple[bytes, list[pickle.PickleBuffer]]) -> Any:
    return pickle.loads(msg[0], buffers=msg[1])


class Step:
    """One decode step's objects, stage by stage, with logprobs=k or without (k=None)."""

    def __init__(self, rows: int, vocab: int, k: int | None, tokenizer: Any, seed: int = 0) -> None:
        from cluster.client.output_processor import OutputProcessor

        g = torch.Generator().manual_seed(seed)
        self.k = k
        self.logits = torch.randn(rows, vocab, generator=g) * 3
        self.tokens = torch.randint(0, vocab, (rows,), generator=g)
        self.req_ids = [f"req-{i}" for i in range(rows)]
        self.sample_rows = np.arange(rows)
        self.collector = LogprobsCollector()
        self.processor = OutputProcessor(tokenizer)
        for rid in self.req_ids:
            self.processor.add_request(
                rid, None, [1, 2, 3], SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10**6, logprobs=k)
            )
        self.lp = compute_logprobs(self.logits, self.tokens, k) if k is not None else None
        self.mro: ModelRunnerOutput | None = None
        self.outputs: list[EngineCoreOutput] = []
        self.msg: tuple[bytes, list[pickle.PickleBuffer]] = (b"", [])

    def device(self) -> None:
        if self.k is not None:
            compute_logprobs(self.logits, self.tokens, self.k)

    def worker_collect(self) -> None:
        sample_k = np.full(len(self.req_ids), -1 if self.k is None else self.k, dtype=np.int32)
        step_lp = launch_copies(self.lp, sample_k if self.lp is not None else None, None, None, cuda=False)
        logprobs, prompt = self.collector.collect(step_lp, self.req_ids, self.sample_rows)
        self.mro = ModelRunnerOutput(
            self.req_ids, [[int(t)] for t in self.tokens.tolist()], 1, logprobs=logprobs, prompt_logprobs=prompt
        )

    def worker_dumps(self) -> None:
        self.msg = dumps(self.mro)

    def driver_loads(self) -> None:
        self.mro = loads(self.msg)

    def driver_attach(self) -> None:
        mro = self.mro
        assert mro is not None
        # The scheduler's own request ids: not the objects the batch unpickled (pickle's memo is by identity).
        self.outputs = [
            EngineCoreOutput(rid, toks) for rid, toks in zip(self.req_ids, mro.sampled_token_ids, strict=True)
        ]
        attach_logprobs(self.outputs, mro)

    def driver_dumps(self) -> None:
        self.msg = dumps(PollResult(self.outputs))

    def client_loads(self) -> None:
        self.outputs = loads(self.msg).outputs

    def client_process(self) -> None:
        for o in self.outputs:
            self.processor.process_output(o)

    def client_read(self) -> None:
        for state, _ in self.processor.states.values():
            rows = state.logprobs.logprobs
            if rows is not None and len(rows):
                rows[-1]  # builds the positions appended since the last read


STAGES = (
    "device",
    "worker_collect",
    "worker_dumps",
    "driver_loads",
    "driver_attach",
    "driver_dumps",
    "client_loads",
    "client_process",
    "client_read",
)
PROCESS = {"worker": STAGES[1:3], "driver": STAGES[3:6], "client": STAGES[6:8]}
ON_PATH = STAGES[1:8]  # client_read is the user's, after the outputs are made


def time_stages(chains: list[Step], steps: int, skip_device: bool) -> list[dict[str, float]]:
    """Median seconds per step of each stage of each chain, over `steps` runs of every chain's whole step
    in turn (steps alternate between the chains, so a load that drifts hits them alike); then client_read
    once over the positions those steps appended (per step), as a user reads them after generate."""
    times: list[dict[str, list[float]]] = [{s: [] for s in STAGES} for _ in chains]
    for _ in range(steps):
        for step, t in zip(chains, times, strict=True):
            for s in STAGES[:-1]:
                if s == "device" and (skip_device or step.k is None):
                    continue
                t0 = time.perf_counter()
                getattr(step, s)()
                t[s].append(time.perf_counter() - t0)
    for step, t in zip(chains, times, strict=True):
        t0 = time.perf_counter()
        step.client_read()
        t["client_read"].append((time.perf_counter() - t0) / steps)
    return [{s: float(np.median(v)) if v else 0.0 for s, v in t.items()} for t in times]


def profile_stage(step: Step, stage: str, steps: int) -> None:
    prof = cProfile.Profile()
    for _ in range(steps):
        for s in STAGES[1:]:
            if s == "client_read" != stage:
                continue  # the user's read, after generate: not interleaved with the output path
            fn: Callable[[], None] = getattr(step, s)
            if s == stage:
                prof.enable()
                fn()
                prof.disable()
            else:
                fn()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def device_breakdown(rows: int, vocab: int, k: int, device: str, reps: int) -> None:
    """The torch path (logprobs_reference) and its parts on `device` (ms per step; CUDA events on a GPU),
    and on a GPU the kernel compute_logprobs runs there. The logits are float32 with bf16 values, as the
    LM head makes them. (bench_sampler.py times the kernel before/after and the prompt logprobs.)"""
    dev = torch.device(device)
    logits = (torch.randn(rows, vocab, device=dev) * 3).bfloat16().float()
    tokens = torch.randint(0, vocab, (rows,), device=dev)
    lp = logits.log_softmax(-1)
    tok_lp = lp.gather(1, tokens.unsqueeze(1))
    parts: dict[str, Callable[[], object]] = {
        "logprobs_reference (torch)": lambda: logprobs_reference(logits, tokens, k),
        "  log_softmax": lambda: logits.log_softmax(-1),
        "  rank (lp >= tok).sum": lambda: (lp >= tok_lp).sum(-1),
        f"  topk({k})": lambda: lp.topk(k, dim=-1),
    }
    if dev.type == "cuda":  # what the sampler runs on a GPU
        parts["compute_logprobs (2 Triton launches)"] = lambda: compute_logprobs(logits, tokens, k)
    for name, fn in parts.items():
        fn()  # warm-up
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / reps
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            ms = (time.perf_counter() - t0) * 1e3 / reps
        print(f"{name:34s} {ms:8.3f} ms")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device-steps", type=int, default=3, help="runs of the (slow on a CPU) device stage")
    ap.add_argument("--profile", choices=STAGES[1:], help="cProfile this stage instead of timing")
    ap.add_argument(
        "--device-breakdown",
        metavar="DEVICE",
        help="time the device stage's parts on DEVICE (cuda on the GPU) instead of the host stages",
    )
    ap.add_argument("--smoke", action="store_true", help="8 rows over a 2,000 vocabulary, 2 steps: the script runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.vocab, args.steps, args.device_steps = 8, 2000, 2, 1
    if args.device_breakdown:
        device_breakdown(args.rows, args.vocab, args.k, args.device_breakdown, args.steps)
        return

    from benchmarks.common import add_byte_tokenizer
    from cluster.client.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as d:
        add_byte_tokenizer(d, args.vocab)
        tok = Tokenizer.from_dir(d)
    torch.set_num_threads(1)
    with_lp = Step(args.rows, args.vocab, args.k, tok)
    if args.profile:
        profile_stage(with_lp, args.profile, args.steps)
        return
    base = Step(args.rows, args.vocab, None, tok)
    time_stages([with_lp, base], 2, skip_device=True)  # warm-up: tokenizer caches, allocator
    lp_t, base_t = time_stages([with_lp, base], args.steps, skip_device=True)
    lp_t["device"] = time_stages([with_lp], args.device_steps, skip_device=False)[0]["device"]
    print(f"{args.rows} rows, vocab {args.vocab}, logprobs={args.k}; median ms per step (1 thread)")
    print(f"{'stage':16s} {'base':>9s} {'logprobs':>9s} {'added':>9s}")
    total_b = total_l = 0.0
    for s in STAGES:
        b = base_t[s]
        lp = lp_t[s]
        if s in ON_PATH:
            total_b, total_l = total_b + b, total_l + lp
        print(f"{s:16s} {b * 1e3:9.2f} {lp * 1e3:9.2f} {(lp - b) * 1e3:9.2f}")
    print(f"{'host total':16s} {total_b * 1e3:9.2f} {total_l * 1e3:9.2f} {(total_l - total_b) * 1e3:9.2f}")
    for proc, stages in PROCESS.items():  # each process's share: the slowest bounds a pipelined step
        b, lp = sum(base_t[s] for s in stages), sum(lp_t[s] for s in stages)
        print(f"{'  ' + proc:16s} {b * 1e3:9.2f} {lp * 1e3:9.2f} {(lp - b) * 1e3:9.2f}")


if __name__ == "__main__":
    main()
