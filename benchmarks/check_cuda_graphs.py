"""GPU check of the decode CUDA-graph path (no timing): greedy tokens with graphs equal HF transformers.

For tiny random HF checkpoints (float32, so the Triton kernels compute in IEEE fp32 and greedy decoding
must match HF token for token): one KV-cache group (qwen3, llama) and a hybrid of full and
sliding-window groups (qwen3_hybrid). Each runs EngineCore + LocalExecutor on the GPU three ways:
graphs + sync scheduling, graphs + async scheduling, eager. It fails unless every bucket was captured,
decode steps really replayed graphs (including batches padded past their size), and every run's tokens
equal HF's. Exit code 0 = pass.

  python benchmarks/check_cuda_graphs.py
"""
from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent))

import hf_models as H  # noqa: E402
from actors.engine_core import EngineCore  # noqa: E402
from actors.local_executor import LocalExecutor  # noqa: E402
from cluster.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig  # noqa: E402
from kvcore.request import Request, SamplingParams  # noqa: E402

NEW_TOKENS = 24
COPIES = 5  # 8 prompts x 5 = 40 requests: batches of 40 and below, between the 32 and 48 buckets


def run(path: str, prompts, enforce_eager: bool, async_on: bool) -> tuple[dict[str, list[int]], Counter, list]:
    config = EngineConfig(model=ModelConfig(model=path, dtype="float32", enforce_eager=enforce_eager),
                          parallel=ParallelConfig(device="cuda"),
                          cache=CacheConfig(block_size=16, num_gpu_blocks=1024),
                          scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048,
                                                    async_scheduling=async_on, debug_invariants=True))
    replays: Counter = Counter()
    with LocalExecutor(config) as executor:
        engine = EngineCore(config, executor)
        runner = executor._worker.model_runner
        if enforce_eager:
            assert runner.graphs is None
        else:
            assert runner.graphs is not None, "CUDA graph capture failed (see the warning in the log)"
            assert runner.graphs.captured_sizes == runner.cudagraph_sizes, runner.graphs.captured_sizes
            real_replay = runner.graphs.replay

            def counting_replay(size):
                replays[(runner.input_batch.num_reqs, size)] += 1
                return real_replay(size)

            runner.graphs.replay = counting_replay
        for c in range(COPIES):
            for i, p in enumerate(prompts):
                n = NEW_TOKENS - (3 * c + i) % 17  # different lengths: the batch shrinks through non-buckets
                engine.add_request(Request(f"g{i}-{c}", p, SamplingParams(max_tokens=n, ignore_eos=True)))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None, out.error
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        sizes = runner.cudagraph_sizes
    return tokens, replays, sizes


def main() -> int:
    failures = 0
    for family in ("qwen3", "llama", "qwen3_hybrid"):
        with tempfile.TemporaryDirectory() as path:
            model = H.save_hf_model(family, path)
            prompts = H.make_prompts()
            expected = [H.hf_greedy(model, p, NEW_TOKENS).tokens for p in prompts]
            for eager, async_on in ((False, False), (False, True), (True, False)):
                t0 = time.perf_counter()
                tokens, replays, sizes = run(path, prompts, eager, async_on)
                bad = [rid for rid, toks in tokens.items()
                       if toks != expected[int(rid[1:].split("-")[0])][:len(toks)]
                       or len(toks) != NEW_TOKENS - (3 * int(rid.split("-")[1]) + int(rid[1:].split("-")[0])) % 17]
                padded = sum(n for (real, size), n in replays.items() if size > real)
                ok = not bad and (eager or (replays and padded))
                failures += not ok
                print(f"{'PASS' if ok else 'FAIL'} {family:<13} graphs={not eager!s:<5} async={async_on!s:<5} "
                      f"requests={len(tokens)} mismatched={bad[:4]} replays={sum(replays.values())} "
                      f"padded_replays={padded} buckets={sizes} ({time.perf_counter() - t0:.1f}s)", flush=True)
    print("CUDA graph check:", "PASS" if failures == 0 else f"FAIL ({failures} runs)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
