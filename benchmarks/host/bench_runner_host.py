"""The worker's own host work per decode step, on this CPU: ModelRunner.update_states,
_prepare (staging the step record, the sampling inputs among it), and the rest of execute_model (the
sampled-token bookkeeping).

256 requests (prompts of 200-800 tokens, so block boundaries are staggered and ~1 in 16 rows gains a
block per step) run decode steps; the real Scheduler (block_size 16, one KV group, Qwen3-0.6B's 28
attention layers) produces every SchedulerOutput and consumes every ModelRunnerOutput, untimed.

The model is a stub whose forward and compute_logits return preallocated tensors, so only host work
is timed. The block table commits in "delta" mode, as on CUDA. Two pieces that are device work on a GPU
are no-ops here because their CPU stand-ins (torch reference kernels) would dominate and mislead:
the slot-mapping computation, the input-preparation kernels and the scatter of the block-table delta
(the host packing of the delta is still timed). Decode batches are padded to graph buckets as with CUDA graphs.

    PYTHONPATH=. python -m benchmarks.host.bench_runner_host [--steps 200] [--profile] [--no-record]
    python -m benchmarks.host.bench_runner_host --smoke      # 5 steps, nothing recorded (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import random
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import kvcore.kernels.block_table_delta as delta_mod
from actors.input_batch import InputBatch
from actors.worker.input_prep import InputStager
from actors.worker.model_runner import ModelRunner
from benchmarks.common import record
from cluster.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvcore import Request, SamplingParams
from kvcore.block_table import MultiGroupBlockTable
from kvcore.kv_cache_manager import KVCacheManager
from kvcore.sched.scheduler import Scheduler
from kvcore.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

SCRIPT = "bench_runner_host"
NUM_REQS = 256
BLOCK_SIZE = 16
NUM_LAYERS = 28  # Qwen3-0.6B: the runner builds a per-layer slot-mapping dict every step
VOCAB = 64  # the stub's logits: the sampler's argmax stays negligible


class StubModel(torch.nn.Module):
    """Returns preallocated tensors: the forward and the logits cost (almost) nothing."""

    def __init__(self, max_tokens: int) -> None:
        super().__init__()
        self.hidden = torch.zeros(max_tokens, 8)
        self.logits = torch.zeros(NUM_REQS, VOCAB)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits[: hidden.shape[0]]


class Timer:
    """Wraps bound methods (as instance attributes, which execute_model finds first) to sum their time."""

    def __init__(self, obj: Any, names: list[str]) -> None:
        self.us = dict.fromkeys(names, 0.0)
        for name in names:
            setattr(obj, name, self._wrap(name, getattr(obj, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.us[name] += (time.perf_counter_ns() - t) / 1000

        return timed

    def reset(self) -> None:
        for k in self.us:
            self.us[k] = 0.0


def build(max_model_len: int) -> tuple[Scheduler, ModelRunner]:
    cfg = EngineConfig(
        model=ModelConfig(model="stub", dtype="float32", max_model_len=max_model_len),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=1 << 20),
        scheduler=SchedulerConfig(max_num_seqs=NUM_REQS, max_num_batched_tokens=8192),
    )
    runner = ModelRunner(cfg, torch.device("cpu"), rank=0)
    model = StubModel(runner.max_num_tokens)
    runner.model = model
    runner.max_model_len = max_model_len
    batch = InputBatch(NUM_REQS, max_model_len, runner.max_num_tokens, runner.device, runner.pin_memory, [BLOCK_SIZE])
    batch.block_table.commit_mode = "delta"
    runner.input_batch = batch
    layer_to_group = {f"model.layers.{i}.self_attn.attn": 0 for i in range(NUM_LAYERS)}
    runner.graph_runner.bind(model, batch, max_model_len, layer_to_group, 0, None)  # as initialize_kv_cache does
    runner.graph_runner.pad_to_buckets = True  # the bucket selection a GPU with graphs makes

    spec = FullAttentionSpec(BLOCK_SIZE, 8, 128, torch.bfloat16)
    blocks = NUM_REQS * (max_model_len // BLOCK_SIZE + 2) + 1
    manager = KVCacheManager(KVCacheConfig(blocks, [KVCacheGroupSpec(["l0"], spec)]), max_model_len)
    sched = Scheduler(manager, max_num_seqs=NUM_REQS, max_num_batched_tokens=8192, max_model_len=max_model_len)
    return sched, runner


@contextlib.contextmanager
def device_work_stubbed() -> Iterator[None]:
    """Device work on a GPU, torch reference kernels here: not the host work this measures. Undone on
    exit (the CI smoke runs in the test process)."""
    patches = [
        (MultiGroupBlockTable, "compute_slot_mapping", lambda self, *a: None),
        (InputStager, "build", lambda self, *a: None),
        (delta_mod, "apply_block_table_delta", lambda *a: None),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, stub in patches:
        setattr(obj, name, stub)
    try:
        yield
    finally:
        for obj, name, original in saved:
            setattr(obj, name, original)


def step(sched: Scheduler, runner: ModelRunner, prof: cProfile.Profile | None = None) -> tuple[float, int]:
    out = sched.schedule()
    if prof is not None:
        prof.enable()  # the runner only, not the scheduler
    t = time.perf_counter_ns()
    mro = runner.execute_model(out)
    us = (time.perf_counter_ns() - t) / 1000
    if prof is not None:
        prof.disable()
    sched.update_from_output(out, mro)
    return us, len(out.num_scheduled_tokens)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="also cProfile the measured steps")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="5 measured steps, nothing recorded: the script runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.no_record = 5, True
    with device_work_stubbed():
        run(args)


def run(args: argparse.Namespace) -> None:
    warmup = 20
    max_model_len = 800 + warmup + 2 * args.steps + 64
    sched, runner = build(max_model_len)
    rng = random.Random(0)
    for i in range(NUM_REQS):
        ids = [rng.randrange(32000) for _ in range(rng.randint(200, 800))]
        sched.add_request(Request(f"d{i}", ids, SamplingParams(max_tokens=max_model_len - 800, ignore_eos=True)))
    while sched.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        step(sched, runner)  # prefill, not measured
    for _ in range(warmup):
        step(sched, runner)

    # Inner pieces: _prepare stages the step's record, the sampling inputs' build among it; _complete
    # (the sampled-token bookkeeping) is part of the rest.
    timer = Timer(runner, ["update_states", "_prepare", "_complete"])
    sampling = Timer(runner.sampling_inputs, ["build"])
    rows = []
    for _ in range(args.steps):
        timer.reset()
        sampling.reset()
        total, n = step(sched, runner)
        assert n == NUM_REQS, "every step must run all 256 decodes"
        us = timer.us
        rows.append(
            (
                total,
                us["update_states"],
                us["_prepare"],
                total - us["update_states"] - us["_prepare"],
                sampling.us["build"],
                us["_complete"],
            )
        )
    med = [statistics.median(r[i] for r in rows) for i in range(len(rows[0]))]
    print(
        f"256 decodes, median of {args.steps} steps (us): execute_model {med[0]:.1f} = "
        f"update_states {med[1]:.1f} + _prepare {med[2]:.1f} + rest {med[3]:.1f}"
    )
    print(f"  inside _prepare: sampling inputs {med[4]:.1f}; inside the rest: _complete {med[5]:.1f}")

    if args.profile:
        prof = cProfile.Profile()
        for _ in range(args.steps):
            step(sched, runner, prof)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if not args.no_record:
        record(SCRIPT, "runner_host_us_256_decodes", med[0], "us")


if __name__ == "__main__":
    main()
