"""Pipeline parallelism's pieces that need no worker: the config fields and their rules, the layer split,
the stage bundles and the `kvray info` plan (with each stage's KV cache), the batch-queue scheduler (no
request in two in-flight steps, the first stage's tokens, the same tokens as the synchronous scheduler
under preemption), the engine's queue with async scheduling, the step's wire form, and the KV-cache
layout each stage holds."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from actors.config.engine import ConfigError, EngineConfig
from actors.config.model_rules import pipeline_layer_partition, stage_layer_range
from actors.driver.engine_core import EngineCore
from actors.executor.base import Executor
from actors.models.decoder import attention_layer_name
from actors.models.kv_memory import kv_cache_report, layer_specs_from_hf_config
from actors.transport.codec import decode_step, encode_step
from actors.worker.kv_cache_sizing import own_groups, own_kv_cache_config
from actors.worker.noop import FAKE_TOKEN, NoopWorker
from cluster.info import plan
from cluster.replicas.placement import bundles_for
from kvcore.messages import ModelRunnerOutput, SchedulerOutput
from kvcore.sched.pipeline_steps import PipelineScheduler
from kvcore.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    bytes_per_block,
    make_kv_cache_config,
)
from tests.scheduler_helpers import drain, make_request, make_scheduler
from tests.test_hybrid_kv_memory import GEMMA3_12B

# ---------------------------------------------------------------- config


def test_pipeline_fields_and_their_rules():
    c = EngineConfig().replace(pipeline_parallel_size=2, tensor_parallel_size=2, pp_layer_partition=[3, 1])
    assert c.parallel.pp_layer_partition == (3, 1) and c.parallel.ranks_per_engine == 4
    assert not c.use_async_scheduling  # null: on for CUDA only
    assert c.replace(async_scheduling=True).use_async_scheduling  # with the batch queue (EngineCore)
    assert c.replace(device="cuda").use_async_scheduling
    for bad, rule in (
        (dict(pipeline_parallel_size=0), "pipeline_parallel_size=0: must be in"),
        (dict(pipeline_parallel_size=2, pp_layer_partition=[2]), "one layer count per stage"),
        (dict(pipeline_parallel_size=2, pp_layer_partition=[2, 0]), "each an integer >= 1"),
    ):
        with pytest.raises(ConfigError, match=rule):
            EngineConfig().replace(**bad)


def test_layer_split_even_by_default_and_the_override_checked_against_the_model():
    c3 = EngineConfig().replace(pipeline_parallel_size=3)
    assert pipeline_layer_partition(c3, 7) == [2, 2, 3]  # the remainder on the last stages
    assert [stage_layer_range(c3, 7, s) for s in range(3)] == [(0, 2), (2, 4), (4, 7)]
    with pytest.raises(ConfigError, match="must be <= the model's num_hidden_layers=2"):
        pipeline_layer_partition(c3, 2)
    c = EngineConfig().replace(pipeline_parallel_size=2, pp_layer_partition=[3, 1])
    assert stage_layer_range(c, 4, 1) == (3, 4)
    with pytest.raises(ConfigError, match=r"must sum to the model's num_hidden_layers=5 .* sums to 4"):
        pipeline_layer_partition(c, 5)


# ---------------------------------------------------------------- placement


def nodes(**cpus: int) -> list[dict]:
    return [{"node_id": n, "alive": True, "resources": {"CPU": float(c)}} for n, c in cpus.items()]


def test_a_bundle_per_stage_keeps_its_tensor_parallel_ranks_on_one_node():
    c = EngineConfig().replace(pipeline_parallel_size=2, tensor_parallel_size=2, device="cpu")
    assert bundles_for(c) == [{"CPU": 2.0}, {"CPU": 2.0}]
    assert [c.parallel.bundle_of_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert c.parallel.stage_placement_strategy == "PACK"  # stages spill to other nodes when one is full
    on, why = plan(c, nodes(a=2, b=2))
    assert why is None and on == [["a", "b"]]
    on, why = plan(c, nodes(a=4, b=2))
    assert why is None and on == [["a", "a"]]  # both stages fit one node: packed
    spread = c.replace(placement_strategy="STRICT_SPREAD")
    assert plan(spread, nodes(a=4, b=2)) == ([["a", "b"]], None)
    on, why = plan(c, nodes(a=1, b=1, c=1, d=1))
    assert on == [[None, None]]
    assert "a pipeline stage's 2 tensor-parallel rank(s) must share one node" in why


def test_without_stages_the_bundles_stay_one_per_rank():
    c = EngineConfig().replace(tensor_parallel_size=2, device="cpu")
    assert bundles_for(c) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert c.parallel.stage_placement_strategy == "STRICT_PACK"


# ---------------------------------------------------------------- the batch queue's scheduler


def make_pipeline_scheduler(depth: int = 2, **kw) -> PipelineScheduler:
    base = make_scheduler(**kw)  # the same manager and limits, as a PipelineScheduler
    return PipelineScheduler(
        base.kv_cache_manager,
        depth=depth,
        max_num_seqs=base.max_num_seqs,
        max_num_batched_tokens=base.max_num_batched_tokens,
        max_model_len=base.max_model_len,
        long_prefill_token_threshold=base.long_prefill_token_threshold,
        debug_invariants=True,
    )


def token_at(rid: str, pos: int) -> int:
    return 1000 + pos + 7 * int(rid[1:])


def answer(sched, out: SchedulerOutput) -> ModelRunnerOutput:
    """What the last stage samples, decided when the step runs (its output is applied later)."""
    ids, sampled = [], []
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        ids.append(rid)
        sampled.append([token_at(rid, req.num_tokens)] if req.num_computed_tokens >= req.num_tokens else [])
    return ModelRunnerOutput(ids, sampled, out.step_id)


def run_queue(sched: PipelineScheduler, depth: int, max_steps: int = 5000) -> dict[str, list[int]]:
    """The engine's batch queue: submit while there is room, else apply the oldest step."""
    tokens: dict[str, list[int]] = {}
    queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and not queue:
            return tokens
        if len(queue) < depth and sched.has_unfinished_requests():
            out = sched.schedule()
            in_flight = {rid for so, _ in queue for rid in so.num_scheduled_tokens}
            assert not in_flight & set(out.num_scheduled_tokens), "a request in two in-flight steps"
            for rid, ids in (out.pipeline_token_ids or {}).items():
                req = sched.requests[rid]
                assert ids == req.all_token_ids[req.num_computed_tokens - len(ids) : req.num_computed_tokens]
            if out.num_scheduled_tokens:
                queue.append((out, answer(sched, out)))
                if len(queue) < depth:
                    continue
            else:
                sched.update_from_output(out, ModelRunnerOutput([], [], out.step_id))
        if queue:
            so, mro = queue.popleft()
            for o in sched.update_from_output(so, mro):
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("the queue did not drain")


def test_in_flight_requests_are_not_scheduled_again_and_take_turns():
    sched = make_pipeline_scheduler(depth=2, num_blocks=64)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 8, max_tokens=4, start=50 * i))
    first = sched.schedule()
    assert set(first.num_scheduled_tokens) == {"r0", "r1"}  # its share: half of the live requests
    assert first.pipeline_token_ids == {}  # prompts only: the first stage has them
    second = sched.schedule()
    assert set(second.num_scheduled_tokens) == {"r2", "r3"}
    third = sched.schedule()
    assert third.num_scheduled_tokens == {}  # every request is in flight
    sched.update_from_output(third, ModelRunnerOutput([], [], third.step_id))
    sched.update_from_output(first, answer(sched, first))
    fourth = sched.schedule()
    assert set(fourth.num_scheduled_tokens) == {"r0", "r1"}
    # each decode embeds the token the last stage sampled, which the first stage never saw
    assert fourth.pipeline_token_ids == {f"r{i}": [token_at(f"r{i}", 8)] for i in range(2)}
    assert sched.num_running == 4


@pytest.mark.parametrize("depth", [2, 3])
def test_the_queue_gives_the_synchronous_tokens_under_preemption(depth):
    kw = dict(num_blocks=14, block_size=4, max_num_batched_tokens=24, max_num_seqs=6, max_model_len=64)
    reqs = [(f"r{i}", 6 + 3 * i, 10) for i in range(6)]
    sync = make_scheduler(**kw)
    for rid, n, m in reqs:
        sync.add_request(make_request(rid, n, max_tokens=m, start=100 * int(rid[1:])))
    expected = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in drain(sync, token_at).items()}
    pipe = make_pipeline_scheduler(depth, **kw)
    for rid, n, m in reqs:
        pipe.add_request(make_request(rid, n, max_tokens=m, start=100 * int(rid[1:])))
    got = run_queue(pipe, depth)
    assert got == expected
    assert pipe.stats()["num_preemptions"] > 0, "the pool was meant to force preemption"


class LaggingStages(Executor):
    """The engine's stages in process: one no-op worker plays the last stage, answering each step with the
    previous one's output as async scheduling's workers do, and the executor checks what the driver sends:
    no request in two steps whose outputs the driver has not applied (queued, or held by the workers)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.worker = NoopWorker(config.replace(pipeline_parallel_size=1), 0, 1, None)  # no stage to wait for
        assert self.worker.lag_outputs
        self.unapplied: dict[int, set[str]] = {}  # step id -> its requests, output not yet with the driver
        self.queued = 0  # steps submitted and not yet collected
        self.most_queued = 0

    def collective_rpc(self, method, *args, **kwargs):
        return [getattr(self.worker, method)(*args, **kwargs)]

    def execute_model(self, so):
        raise AssertionError("a pipelined engine submits its steps")

    def submit_step(self, so):
        busy = set().union(*self.unapplied.values()) if self.unapplied else set()
        assert not busy & set(so.num_scheduled_tokens), f"step {so.step_id} reschedules in-flight requests"
        if so.num_scheduled_tokens:
            self.unapplied[so.step_id] = set(so.num_scheduled_tokens)
        self.queued += 1
        self.most_queued = max(self.most_queued, self.queued)
        return self.worker.execute_model(so)  # the last stage answers with the step before it

    def collect_step(self, handle):
        self.queued -= 1
        if handle is not None:
            self.unapplied.pop(handle.step_id)
        return handle

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("pp", [2, 4])
def test_async_scheduling_keeps_the_queue_full_and_each_request_in_one_step(pp):
    config = EngineConfig().replace(
        pipeline_parallel_size=pp, async_scheduling=True, device="cpu", num_gpu_blocks=256, max_num_seqs=16
    )
    executor = LaggingStages(config)
    engine = EngineCore(config, executor)
    assert engine.async_scheduling and engine.pipeline_depth == pp + 1
    for i in range(12):
        engine.add_request(make_request(f"r{i}", 5 + i, max_tokens=6 + i % 3))
    tokens: dict[str, list[int]] = {}
    finished: list[str] = []
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finished.append(o.request_id)
    assert not engine.has_unfinished() and not executor.unapplied
    assert sorted(finished) == sorted(f"r{i}" for i in range(12))  # each exactly once
    assert tokens == {f"r{i}": [FAKE_TOKEN] * (6 + i % 3) for i in range(12)}
    # The driver never waited on an output it did not need: the workers had pp + 1 steps queued.
    assert executor.most_queued == pp + 1


# ---------------------------------------------------------------- wire form and KV layout


def test_the_step_carries_the_first_stage_tokens_over_the_wire():
    sched = make_pipeline_scheduler()
    sched.add_request(make_request("r0", 5))
    so = sched.schedule()
    so.pipeline_token_ids = {"r0": [11, 12]}
    back = decode_step(encode_step(so))
    assert back.pipeline_token_ids == {"r0": [11, 12]} and back.num_scheduled_tokens == so.num_scheduled_tokens
    so.pipeline_token_ids = None
    assert decode_step(encode_step(so)).pipeline_token_ids is None


def test_each_stage_holds_its_layers_of_the_engine_groups():
    full = FullAttentionSpec(4, 1, 8, torch.float32)
    window = SlidingWindowSpec(4, 1, 8, torch.float32, sliding_window=8)
    specs = {f"l{i}": (window if i % 2 else full) for i in range(6)}  # groups [l0 l2 l4] and [l1 l3 l5]
    config = make_kv_cache_config(specs, num_blocks=10)
    stage0 = {n: specs[n] for n in ("l0", "l1", "l2")}
    cut = own_kv_cache_config(config, set(stage0))
    assert [g.layer_names for g in cut.kv_cache_groups] == [["l0", "l2"], ["l1"]]
    assert cut.num_blocks == 10 and cut.num_memory_slots == 2
    assert cut.layer_to_group() == {"l0": 0, "l2": 0, "l1": 1}  # the engine's group ids
    stage1 = {n: specs[n] for n in ("l3", "l4", "l5")}
    assert [g.layer_names for g in own_groups(specs, stage1)] == [["l4"], ["l3", "l5"]]
    lone = KVCacheConfig(10, [KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["l1"], window)])
    assert [g.layer_names for g in own_kv_cache_config(lone, {"l1"}).kv_cache_groups] == [[], ["l1"]]


def test_kvray_info_shows_each_stage_layers_and_refuses_a_split_the_model_cannot_take():
    from cluster.info import kv_cache_info, stage_layers, table

    layers, why = stage_layers(EngineConfig().replace(pipeline_parallel_size=2))
    assert why is None and len(layers) == 2 and min(layers) >= 1
    layers, why = stage_layers(EngineConfig().replace(pipeline_parallel_size=99))
    assert layers is None and "pipeline_parallel_size=99: must be <= the model's num_hidden_layers" in why
    c = EngineConfig().replace(pipeline_parallel_size=2, tensor_parallel_size=2, device="cpu")
    on, _ = plan(c, nodes(a=2, b=2))
    report = {
        "cluster": {"nodes": [{**n, "node_ip": "127.0.0.1"} for n in nodes(a=2, b=2)], "cluster_resources": {}},
        "placement": {
            "engines_on": on,
            "engines": 1,
            "workers_per_engine": 4,
            "stages": 2,
            "ranks_per_stage": 2,
            "stage_layers": [2, 2],
            "bundles_per_engine": bundles_for(c),
            "strategy": "PACK",
            "transport": "shm",
            "total_request": {"CPU": 4.0},
            "verdict": "fits",
        },
    }
    report["kv_cache"] = kv_cache_info(c)
    text = table(report)
    assert "e0s0" in text and "e0s1" in text, text
    assert "2 stage(s) of 2 tensor-parallel rank(s) on one node each, decoder layers per stage [2, 2]" in text
    # Each stage's KV cache: tiny-random's full and sliding layers alternate, one of each per stage.
    assert "KV cache per stage" in text, text
    assert "  s0: layers 0-1, groups g0: 1 x full, g1: 1 x sliding 32, " in text, text
    assert "  s1: layers 2-3, groups g0: 1 x full, g1: 1 x sliding 32, " in text, text
    assert "block count bound by s0 s1: the most bytes per block" in text, text
    assert "KV cache per stage" not in table(
        {**report, "kv_cache": kv_cache_info(EngineConfig().replace(device="cpu"))}
    )


@pytest.mark.parametrize(("partition", "bound"), [((44, 4), 0), ((4, 44), 1)])
def test_kv_cache_per_stage_and_the_stage_that_bounds_the_block_count(partition, bound):
    """Gemma-3 12B's layout over two uneven stages: each stage holds its layers of the engine's groups, a block
    costs it a page per layer of its largest cut group (as the workers size it), and the stage with the most
    bytes per block holds the fewest blocks: the engine's count."""
    budget = 8 << 30
    report = kv_cache_report(
        GEMMA3_12B, torch.bfloat16, 16, 1, 8192, 2048, budget_bytes=budget, partition=list(partition)
    )
    hybrid = report["hybrid"]
    specs = layer_specs_from_hf_config(GEMMA3_12B, torch.bfloat16, 16, 1)
    page = next(iter(specs.values())).page_size_bytes
    start = 0
    for st, count in zip(hybrid["stages"], partition, strict=True):
        assert st["layers"] == [start, start + count]
        own = {n: specs[n] for n in (attention_layer_name(i) for i in range(start, start + count))}
        assert st["bytes_per_block"] == bytes_per_block(own_groups(specs, own))  # what the stage's workers size
        assert st["num_blocks"] == budget // st["bytes_per_block"]
        start += count
    small = hybrid["stages"][1 - bound]
    assert small["groups"] == (["g4: 3 x sliding 1024", "g5: 1 x full"] if bound == 0 else ["g0: 4 x sliding 1024"])
    assert small["bytes_per_block"] == (3 if bound == 0 else 4) * page
    assert hybrid["stages"][bound]["bytes_per_block"] == 8 * page  # a whole group of 8 layers
    assert hybrid["block_count_bound_by"]["stages"] == [bound]
    assert hybrid["num_blocks"] == hybrid["stages"][bound]["num_blocks"]  # the engine's: the fewest
    assert report["all_full_attention"]["stages"][bound]["bytes_per_block"] == max(partition) * page
