"""The inputs a CUDA graph replays, run eagerly on the CPU.

On the GPU every step is padded to a bucket: uniform decode steps by row count, mixed steps (prefill
chunks with decodes) by token count. Padding sequences hold no tokens and padding tokens belong to no
sequence (id 0, position 0, slot -1), and the attention metadata carries the bucket's host ints only
(max_query_len 1 or the token count, max_seq_len = max_model_len). The graph runner's `pad_to_buckets`
switch builds exactly those inputs without a graph, so here greedy outputs of the padded path must
equal HF transformers token for token: padding writes no KV and disturbs no real row, on one KV-cache
group and on a hybrid model (full + sliding-window groups), with the torch reference attention and
with the Triton kernels under TRITON_INTERPRET=1, in a roomy pool and in a tight one (chunked prefill
and preemption between padded steps).
"""

import hf_models as H
import pytest

from actors.driver.engine_core import EngineCore
from actors.executor.local import LocalExecutor
from actors.worker.cuda_graphs import (
    Bucket,
    BucketPlan,
    bucket_for,
    capture_sizes,
    token_sizes,
)
from cluster.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvcore.request import Request, SamplingParams

NEW_TOKENS = 12
# Different lengths, so the decode batch shrinks through sizes that are not buckets (7, 5, 3, ...).
MAX_TOKENS = [12, 3, 9, 12, 6, 11, 2, 12]


def test_capture_sizes_and_buckets():
    assert capture_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100]
    sizes = capture_sizes(40)
    assert sizes[-1] == 40
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 9, 33, 40)] == [1, 4, 8, 16, 40, 40]
    assert bucket_for(41, sizes) is None
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)
    assert token_sizes(8192) == [8, 16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert token_sizes(100) == [8, 16, 32, 64, 100]
    plan = BucketPlan(max_num_reqs=16, max_num_tokens=256, mode="all")
    assert plan.select(5, 5, 1) == (Bucket(8, 8, True), "")
    assert plan.select(5, 40, 36) == (Bucket(64, 16, False), "")
    assert plan.select(3, 4, 2) == (Bucket(8, 8, False), "")
    decode_only = BucketPlan(16, 256, "decode")
    bucket, reason = decode_only.select(5, 40, 36)
    assert bucket is None and "mixed" in reason
    assert BucketPlan(16, 256, "none").buckets() == []
    # model.cudagraph_max_tokens: bigger mixed steps run eagerly at their exact size
    capped = BucketPlan(16, 8192, "all", max_graph_tokens=512)
    assert capped.token_sizes[-1] == 512 and capped.select(16, 512, 400)[0] == Bucket(512, 16, False)
    bucket, reason = capped.select(16, 513, 400)
    assert bucket is None and "model.cudagraph_max_tokens" in reason
    assert BucketPlan(256, 8192, "all", max_graph_tokens=128).decode_sizes[-1] == 128


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return H.greedy_references(tmp_path_factory.mktemp, NEW_TOKENS)


def make_config(path: str, backend: str, tight: bool) -> EngineConfig:
    if tight:
        cache = CacheConfig(block_size=8, num_gpu_blocks=34)
        sched = SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=32, debug_invariants=True)
    else:
        cache = CacheConfig(block_size=8, cpu_kv_cache_gib=0.01)
        # Interpreted Triton pays for every padded token: smaller token buckets there.
        sched = SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=32 if backend == "triton" else 256, debug_invariants=True
        )
    return EngineConfig(
        model=ModelConfig(model=path, dtype="float32", attention_backend=backend),
        parallel=ParallelConfig(device="cpu"),
        cache=cache,
        scheduler=sched,
    )


def run_padded(config: EngineConfig, prompts, max_tokens=MAX_TOKENS):
    """Greedy tokens per prompt with every step padded to its bucket, and the (real rows, bucket) of
    every padded step."""
    padded_steps: list[tuple[int, Bucket]] = []
    with LocalExecutor(config) as executor:
        engine = EngineCore(config, executor)
        runner = executor.worker.model_runner.graph_runner
        assert runner.graphs is None  # never captured on the CPU
        runner.pad_to_buckets = True
        real_select = runner.plan.select

        def spy(num_reqs, num_tokens, max_query_len):
            bucket, reason = real_select(num_reqs, num_tokens, max_query_len)
            assert bucket is not None, reason
            padded_steps.append((num_reqs, num_tokens, bucket))
            return bucket, reason

        runner.plan.select = spy
        for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            engine.add_request(Request(f"g{i}", p, sp, eos_token_id=2))
        tokens: dict[str, list[int]] = {}
        for _ in range(2000):
            if not engine.has_unfinished():
                break
            for out in engine.step():
                assert out.error is None, out.error
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert not engine.has_unfinished()
        stats = engine.stats()
    return [tokens[f"g{i}"] for i in range(len(prompts))], padded_steps, stats


# The interpreted Triton case runs on the hybrid model only: its full and sliding-window groups both take
# the kernels' padded path there (a second interpreted family cost 80 s of CI for no new path).
@pytest.mark.parametrize(
    "family,backend,tight",
    [("qwen3", "torch", False), ("qwen3_hybrid", "triton", False), ("qwen3_hybrid", "torch", True)],
)
def test_padded_decode_matches_hf(reference, family, tight, backend):
    # Interpreted Triton (its layer kernels most) cost 3 minutes on all eight requests of the 4-layer model;
    # three of 5, 33 and 50 tokens still mix chunks into decodes and decode 3 rows in a bucket of 4 (a
    # padding row), and the 2-layer variant still has one full and one sliding-window group.
    path, prompts, expected = reference(f"{family}_2l" if backend == "triton" else family)
    pick = [0, 2, 5] if backend == "triton" else list(range(len(prompts)))
    max_tokens = [MAX_TOKENS[i] for i in pick]
    got, padded_steps, stats = run_padded(make_config(path, backend, tight), [prompts[i] for i in pick], max_tokens)
    for i, g, n in zip(pick, got, max_tokens, strict=True):
        assert g == expected[i][:n], f"{family} {backend} tight={tight}: prompt {i}: {g} vs HF {expected[i]}"
    if family == "qwen3_hybrid":
        assert stats["num_kv_cache_groups"] == 2, stats  # a full and a sliding-window group, both padded
    assert any(b.decode for _, _, b in padded_steps), "no decode step took the padded path"
    assert any(not b.decode and b.num_tokens > t for _, t, b in padded_steps), "no padded mixed step"
    if tight:
        # Steps here come between chunked prefills and preemptions.
        assert stats["num_preemptions"] > 0 and stats["num_partial_prefills"] > 0, stats
    else:
        assert any(b.num_seqs > n for n, _, b in padded_steps if b.decode), f"no padding rows: {padded_steps}"


class RecordedGraphs:
    """Stands in for StepGraphs on the CPU: 'capture' runs the warm-up a real capture runs and keeps the
    step function of each bucket, 'replay' runs it again. The function takes nothing but the bucket
    (it reads the runner's static buffers, as a graph reads their addresses), so if per-step
    preparation wrote anywhere the capture did not look, the replayed outputs would be wrong."""

    def __init__(self, device):
        self.recorded = {}
        self.replays = []
        self.runner = None

    @property
    def captured(self):
        return sorted(self.recorded)

    def __contains__(self, bucket):
        return bucket in self.recorded

    def capture(self, buckets, prepare, forward):
        for bucket in sorted(buckets, reverse=True):
            prepare(bucket)
            forward(bucket)
            self.recorded[bucket] = forward
        return True

    def replay(self, bucket):
        self.replays.append((self.runner.input_batch.num_reqs, bucket))
        return self.recorded[bucket](bucket)

    def clear(self):
        self.recorded.clear()


@pytest.mark.parametrize("async_on", [False, True])
def test_replay_path_on_captured_buffers_matches_hf(reference, monkeypatch, async_on):
    """The runner's capture hook and replay branch (execute_model), with a recording stand-in for the
    CUDA graph: tokens equal HF, replays happen, including padded ones."""
    import actors.worker.forward as rg
    import actors.worker.model_runner as mr

    path, prompts, expected = reference("qwen3_hybrid")
    made = []

    def fake_graphs(device):
        made.append(RecordedGraphs(device))
        made[-1].runner = current_runner[0]
        return made[-1]

    current_runner = [None]
    monkeypatch.setattr(rg, "StepGraphs", fake_graphs)
    monkeypatch.setattr(rg.GraphRunner, "graphs_unavailable", lambda self: None)
    real_init = mr.ModelRunner.initialize_kv_cache

    def init_kv(self, cfg):
        current_runner[0] = self
        return real_init(self, cfg)

    monkeypatch.setattr(mr.ModelRunner, "initialize_kv_cache", init_kv)
    config = make_config(path, "torch", tight=False)
    config = config.replace(async_scheduling=async_on)
    with LocalExecutor(config) as executor:
        engine = EngineCore(config, executor)
        runner = executor.worker.model_runner.graph_runner
        assert runner.graphs is made[-1]
        assert runner.graphs.captured == sorted(runner.plan.buckets())
        assert runner.plan.decode_sizes == [1, 2, 4, 8, 16]
        for i, (p, n) in enumerate(zip(prompts, MAX_TOKENS, strict=True)):
            engine.add_request(Request(f"g{i}", p, SamplingParams(max_tokens=n, ignore_eos=True)))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None, out.error
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        replays = runner.graphs.replays
    for i, exp in enumerate(expected):
        assert tokens[f"g{i}"] == exp[: MAX_TOKENS[i]], f"prompt {i}"
    assert any(b.num_seqs > n for n, b in replays if b.decode), replays
    assert any(not b.decode for n, b in replays), replays
    assert engine.stats()["graph_step_share"] == 1.0, engine.stats()
