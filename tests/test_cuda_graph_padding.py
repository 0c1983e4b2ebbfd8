"""The inputs a decode CUDA graph replays, run eagerly on the CPU.

On the GPU a decode-only batch is padded to the next captured bucket: padding rows run token 0 at
position 0 with seq_len 1 and slot -1, and the attention metadata carries the capture-time host ints
(max_query_len 1, max_seq_len = max_model_len, so the Triton kernel may take its split-KV path). The
runner's `_pad_decode_to_bucket` switch builds exactly those inputs without a graph, so here greedy
outputs of the padded path must equal HF transformers token for token: padding rows write no KV and
disturb no real row, on one KV-cache group and on a hybrid model (full + sliding-window groups), with
the torch reference attention and with the Triton kernels under TRITON_INTERPRET=1, in a roomy pool
and in a tight one (chunked prefill and preemption between padded decode steps).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import hf_models as H
from actors.cuda_graphs import bucket_for, capture_sizes
from actors.engine_core import EngineCore
from actors.local_executor import LocalExecutor
from cluster.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
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


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return H.greedy_references(tmp_path_factory.mktemp, NEW_TOKENS)


def make_config(path: str, backend: str, tight: bool) -> EngineConfig:
    if tight:
        cache = CacheConfig(block_size=8, num_gpu_blocks=34)
        sched = SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=32, debug_invariants=True)
    else:
        cache = CacheConfig(block_size=8, cpu_kv_cache_gib=0.01)
        sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, debug_invariants=True)
    return EngineConfig(model=ModelConfig(model=path, dtype="float32", attention_backend=backend),
                        parallel=ParallelConfig(device="cpu"), cache=cache, scheduler=sched)


def run_padded(config: EngineConfig, prompts):
    """Greedy tokens per prompt with decode batches padded to buckets, and the (real, padded) batch
    sizes the padded path saw."""
    padded_steps: list[tuple[int, int]] = []
    with LocalExecutor(config) as executor:
        engine = EngineCore(config, executor)
        runner = executor._worker.model_runner
        assert runner.graphs is None  # never captured on the CPU
        runner._pad_decode_to_bucket = True
        real_pad_rows = runner._pad_rows

        def spy(num_reqs, size):
            padded_steps.append((num_reqs, size))
            return real_pad_rows(num_reqs, size)

        runner._pad_rows = spy
        for i, (p, n) in enumerate(zip(prompts, MAX_TOKENS)):
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


@pytest.mark.parametrize("family,backend,tight", [
    ("qwen3", "torch", False), ("qwen3", "triton", False), ("qwen3_hybrid", "triton", False),
    ("qwen3_hybrid", "torch", True)])
def test_padded_decode_matches_hf(reference, family, tight, backend):
    path, prompts, expected = reference(family)
    got, padded_steps, stats = run_padded(make_config(path, backend, tight), prompts)
    for i, (g, exp) in enumerate(zip(got, expected)):
        assert g == exp[:MAX_TOKENS[i]], f"{family} {backend} tight={tight}: prompt {i}: {g} vs HF {exp}"
    assert padded_steps, "no decode-only step took the padded path"
    if tight:
        # Decode-only steps here come between chunked prefills and preemptions (their sizes happen to
        # be buckets; the roomy runs check rows of padding).
        assert stats["num_preemptions"] > 0 and stats["num_partial_prefills"] > 0, stats
    else:
        assert any(size > n for n, size in padded_steps), f"no batch smaller than its bucket: {padded_steps}"


class RecordedGraphs:
    """Stands in for DecodeGraphs on the CPU: 'capture' keeps the very tensors a CUDA graph would hold
    by address (the static buffer views and the attention metadata built at capture time) and 'replay'
    runs the model on them again. So if the runner's per-step preparation wrote anywhere other than
    where the capture looked, the replayed outputs would be wrong."""

    def __init__(self, runner, sizes):
        self.runner = runner
        self.sizes = sorted(sizes)
        self.recorded = {}
        self.replays = []

    @property
    def captured_sizes(self):
        return sorted(self.recorded)

    def __contains__(self, size):
        return size in self.recorded

    def capture(self, prepare, forward):
        r = self.runner
        for size in sorted(self.sizes, reverse=True):
            prepare(size)
            forward(size)  # the warm-up the real capture runs
            self.recorded[size] = (r._decode_metadata(size), r.input_ids.gpu[:size], r.positions.gpu[:size])
        return True

    def replay(self, size):
        from actors.forward_context import ForwardContext, set_forward_context

        md, ids, pos = self.recorded[size]
        self.replays.append((self.runner.input_batch.num_reqs, size))
        with set_forward_context(ForwardContext(attn_metadata=md, layer_to_group=self.runner.layer_to_group)):
            return self.runner.model(ids, pos)

    def clear(self):
        self.recorded.clear()


@pytest.mark.parametrize("async_on", [False, True])
def test_replay_path_on_captured_buffers_matches_hf(reference, monkeypatch, async_on):
    """The runner's capture hook and replay branch (execute_model), with a recording stand-in for the
    CUDA graph: tokens equal HF, replays happen, including padded ones."""
    import actors.model_runner as mr

    path, prompts, expected = reference("qwen3_hybrid")
    made = []

    def fake_graphs(sizes, device):
        made.append(RecordedGraphs(current_runner[0], sizes))
        return made[-1]

    current_runner = [None]
    monkeypatch.setattr(mr, "DecodeGraphs", fake_graphs)
    monkeypatch.setattr(mr.ModelRunner, "_graphs_unavailable", lambda self: None)
    real_init = mr.ModelRunner.initialize_kv_cache

    def init_kv(self, cfg):
        current_runner[0] = self
        return real_init(self, cfg)

    monkeypatch.setattr(mr.ModelRunner, "initialize_kv_cache", init_kv)
    config = make_config(path, "torch", tight=False)
    config = config.replace(async_scheduling=async_on)
    with LocalExecutor(config) as executor:
        engine = EngineCore(config, executor)
        runner = executor._worker.model_runner
        assert runner.graphs is made[-1] and runner._pad_decode_to_bucket
        assert runner.graphs.captured_sizes == runner.cudagraph_sizes == [1, 2, 4, 8, 16]
        for i, (p, n) in enumerate(zip(prompts, MAX_TOKENS)):
            engine.add_request(Request(f"g{i}", p, SamplingParams(max_tokens=n, ignore_eos=True)))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None, out.error
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        replays = runner.graphs.replays
    for i, exp in enumerate(expected):
        assert tokens[f"g{i}"] == exp[:MAX_TOKENS[i]], f"prompt {i}"
    assert any(size > n for n, size in replays), replays
