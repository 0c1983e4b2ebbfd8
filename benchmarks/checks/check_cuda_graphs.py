"""GPU check of every graph mode (no timing): greedy tokens equal HF transformers in float32.

For tiny random HF checkpoints (float32, so the Triton kernels compute in IEEE fp32 and greedy decoding
must match HF token for token): one KV-cache group (qwen3, llama) and a hybrid of full and
sliding-window groups (qwen3_hybrid). Each runs EngineCore + LocalExecutor on the GPU in five modes:
eager (sync), decode graphs (sync, async) and graphs for all steps (sync, async). The requests arrive
in two waves, so prefill chunks mix into running decodes. A run fails unless every bucket of its mode
was captured, graphs really replayed (decode steps padded past their size, and in the all-steps mode
mixed steps too, at a share of 100%), and every request's tokens equal HF's. Exit code 0 = pass.

  python -m benchmarks.checks.check_cuda_graphs
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from typing import Any

from actors.driver.engine_core import EngineCore
from actors.executor.local import LocalExecutor
from cluster.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvcore.request import Request, SamplingParams
from tests import hf_models as H

NEW_TOKENS = 24
COPIES = 5  # 8 prompts x 5 = 40 requests: batches of 40 and below, between the 32 and 48 buckets
# (name, cudagraph_mode, async)
MODES = [
    ("eager", "none", False),
    ("decode-graphs sync", "decode", False),
    ("decode-graphs async", "decode", True),
    ("all-graphs sync", "all", False),
    ("all-graphs async", "all", True),
]


def expected_len(rid: str) -> int:
    i, c = (int(x) for x in rid[1:].split("-"))
    return NEW_TOKENS - (3 * c + i) % 17  # different lengths: the batch shrinks through non-buckets


def run(path: str, prompts: Any, mode: str, async_on: bool) -> tuple[dict[str, list[int]], Counter, dict]:
    config = EngineConfig(
        model=ModelConfig(model=path, dtype="float32", cudagraph_mode=mode),
        parallel=ParallelConfig(device="cuda"),
        cache=CacheConfig(block_size=16, num_gpu_blocks=1024),
        scheduler=SchedulerConfig(
            max_num_seqs=64, max_num_batched_tokens=2048, async_scheduling=async_on, debug_invariants=True
        ),
    )
    replays: Counter = Counter()
    with LocalExecutor(config) as executor:
        engine = EngineCore(config, executor)
        model_runner = executor.worker.model_runner
        runner = model_runner.graph_runner
        if mode == "none":
            assert runner.graphs is None
        else:
            assert runner.graphs is not None, "CUDA graph capture failed (see the warning in the log)"
            assert runner.graphs.captured == sorted(runner.plan.buckets()), runner.graphs.captured
            real_replay = runner.graphs.replay

            def counting_replay(bucket: Any) -> Any:
                replays[(model_runner.input_batch.num_reqs, bucket)] += 1
                return real_replay(bucket)

            runner.graphs.replay = counting_replay
        tokens: dict[str, list[int]] = {}
        for wave in (range(0, 3), range(3, COPIES)):  # the second wave joins running decodes
            for c in wave:
                for i, p in enumerate(prompts):
                    rid = f"g{i}-{c}"
                    engine.add_request(Request(rid, p, SamplingParams(max_tokens=expected_len(rid), ignore_eos=True)))
            for _ in range(4 if wave.start == 0 else 10**6):
                if not engine.has_unfinished():
                    break
                for out in engine.step():
                    assert out.error is None, out.error
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        stats = engine.stats()
        stats["eager_reasons"] = dict(runner.graph_stats.eager)
    return tokens, replays, stats


def main() -> int:
    failures = 0
    for family in ("qwen3", "llama", "qwen3_hybrid"):
        with tempfile.TemporaryDirectory() as path:
            model = H.save_hf_model(family, path)
            prompts = H.make_prompts()
            expected = [H.hf_greedy(model, p, NEW_TOKENS).tokens for p in prompts]
            for name, mode, async_on in MODES:
                t0 = time.perf_counter()
                tokens, replays, stats = run(path, prompts, mode, async_on)
                bad = [
                    rid
                    for rid, toks in tokens.items()
                    if toks != expected[int(rid[1:].split("-")[0])][: len(toks)] or len(toks) != expected_len(rid)
                ]
                bad += [
                    f"missing {i}-{c}" for i in range(len(prompts)) for c in range(COPIES) if f"g{i}-{c}" not in tokens
                ]
                padded = sum(n for (real, b), n in replays.items() if b.decode and b.num_seqs > real)
                mixed = sum(n for (_, b), n in replays.items() if not b.decode)
                share = stats["graph_step_share"]
                ok = not bad
                if mode != "none":
                    ok = ok and bool(replays) and padded > 0
                if mode == "all":
                    ok = ok and mixed > 0 and share == 1.0
                failures += not ok
                print(
                    f"{'PASS' if ok else 'FAIL'} {family:<13} {name:<20} requests={len(tokens)} "
                    f"mismatched={bad[:4]} steps={stats['num_steps']} graph_share={share:.3f} "
                    f"replays={sum(replays.values())} padded_decode={padded} mixed={mixed} "
                    f"eager={stats['eager_reasons']} ({time.perf_counter() - t0:.1f}s)",
                    flush=True,
                )
    print("CUDA graph check:", "PASS" if failures == 0 else f"FAIL ({failures} runs)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
