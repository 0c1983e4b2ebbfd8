"""`ray.transport: shm` end to end on a local Ray: greedy output equals HF at TP=1 and TP=2 (gloo); a
rank that fails a step before a collective, a rank that hangs past the step timeout, a rank whose step
raises, and a killed worker within the restart budget each end as on the other transports (a clear
error naming the cause, or a recovery that loses nothing). No-op workers where the model does not
matter. One Ray for the module."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import hf_models as H
import pytest
import ray
from fault_workers import POISONABLE
from waits import wait_until

from actors.messages import RequestSpec
from cluster import LLM, SamplingParams
from cluster.config import EngineConfig
from cluster.replicas.engine_group import EngineGroup
from cluster.replicas.placement import start_local_ray

pytestmark = pytest.mark.timeout(300)
NOOP = "actors.worker.noop.NoopWorker"
NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    start_local_ray(num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return H.greedy_references(tmp_path_factory.mktemp, NEW_TOKENS)


def shm_llm(path, tp, **kw):
    return LLM(
        model=path,
        device="cpu",
        dtype="float32",
        block_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        cpu_kv_cache_gib=0.01,
        step_timeout_s=60,
        tensor_parallel_size=tp,
        transport="shm",
        **kw,
    )


def test_shm_tp1_greedy_matches_hf(reference):
    path, prompts, expected = reference("qwen3")
    llm = shm_llm(path, 1)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected[:4]
    finally:
        llm.shutdown()


def test_shm_tp2_greedy_matches_hf_and_a_rank_failing_before_its_forward_is_rebuilt(reference):
    """TP=2 over gloo. Then rank 1 fails a step before its forward: rank 0 waits in the all-reduce until
    parallel.collective_timeout_s, the driver names rank 1 and rebuilds the group (one restart); the
    requests still get HF's tokens."""
    path, prompts, expected = reference("qwen3")
    llm = shm_llm(path, 2, collective_timeout_s=4, max_worker_restarts=1, worker_cls=POISONABLE)
    try:
        batch = [{"prompt_token_ids": p} for p in prompts[:4]]
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected[:4]
        assert llm.stats()[0]["worker_restarts"] == 0
        bad = str(int(outs[-1].request_id) + 2)  # the second request of the next call
        ray.get(llm.engines.drivers[0].worker_call.remote(1, "fail_steps_with", [bad], True))
        again = llm.generate(batch[:2], GREEDY, use_tqdm=False)
        assert again[1].request_id == bad and [o.error for o in again] == [None, None]
        assert [o.outputs[0].token_ids for o in again] == expected[:2]
        assert llm.stats()[0]["worker_restarts"] == 1  # the rebuilt group has no fault
    finally:
        llm.shutdown()


def noop_group(**kw):
    base = dict(
        tensor_parallel_size=2,
        step_timeout_s=3,
        placement_timeout_s=10,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        num_gpu_blocks=512,
        transport="shm",
    )
    return EngineGroup(EngineConfig().replace(**{**base, **kw}), worker_cls=NOOP)


def drain(group, specs, limit_s, on_step=lambda: None):
    """Every request's tokens, once each has finished (or the replica failed)."""
    tokens: dict[str, list[int]] = {s.request_id: [] for s in specs}
    finished: list[str] = []

    def step():
        on_step()
        for o in group.poll(timeout_s=0.3):
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                assert o.error is None, o.error
                finished.append(o.request_id)

    wait_until(
        lambda: len(finished) == len(specs) or group.fatal is not None,
        limit_s,
        step=step,
        what="every request finishing",
    )
    return tokens, finished


def test_a_rank_that_hangs_past_the_step_timeout_ends_the_replica_naming_it():
    group = noop_group()
    try:
        ray.get(group.drivers[0].worker_call.remote(1, "inject_fault", "hang", 3))
        group.submit([RequestSpec("r0", [1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))])
        wait_until(
            lambda: group.fatal is not None, 120, step=lambda: group.poll(timeout_s=0.2), what="the replica's failure"
        )
        for part in ["worker rank 1 failed", "parallel.step_timeout_s=3", "no answer from rank(s) [1]"]:
            assert part in group.fatal, group.fatal
    finally:
        group.shutdown()


def test_a_step_error_then_a_killed_worker_are_recovered_and_nothing_is_lost():
    """Rank 1 raises in one step (a StepError: requests re-run, no restart spent), later it is killed
    (a dead reader: the TP group is rebuilt within the restart budget); every request ends once, whole.

    Nothing here waits on a clock: a killed worker is seen by its failed ping, not by the step timeout,
    so both timeouts are far above what a loaded machine needs (a 3 s step timeout spent the one restart
    on a slow step, and a 10 s placement wait gave the requests back, when other test runs shared the
    host)."""
    group = noop_group(max_worker_restarts=1, step_timeout_s=60, placement_timeout_s=300)
    killed = []

    def kill_once():
        if not killed and group.stats()[0]["num_output_tokens"] > 100:
            assert group.stats()[0]["worker_restarts"] == 0  # the step error spent none
            ray.get(group.drivers[0].kill_worker.remote(1))
            killed.append(True)

    try:
        ray.get(group.drivers[0].worker_call.remote(1, "inject_fault", "raise", 4))
        specs = [
            RequestSpec(f"r{i}", list(range(1, 20 + i)), SamplingParams(max_tokens=200, ignore_eos=True))
            for i in range(4)
        ]
        group.submit(specs)
        tokens, finished = drain(group, specs, 180, on_step=kill_once)
        # On a loaded host the first poll may come after every request finished: the kill still comes,
        # and work after it makes the driver meet the dead rank and rebuild (in a run that killed
        # mid-way, the rebuild came already and this work just runs).
        kill_once()
        more = [RequestSpec(f"s{i}", [7, 8, 9 + i], SamplingParams(max_tokens=50, ignore_eos=True)) for i in range(2)]
        group.submit(more)
        more_tokens, more_finished = drain(group, more, 180)
        assert group.fatal is None, group.fatal
        assert sorted(finished) == sorted(tokens) and sorted(more_finished) == sorted(more_tokens)  # each once
        assert all(len(t) == 200 for t in tokens.values()), {k: len(v) for k, v in tokens.items()}
        assert all(len(t) == 50 for t in more_tokens.values()), {k: len(v) for k, v in more_tokens.items()}
        assert killed and group.stats()[0]["worker_restarts"] == 1
    finally:
        group.shutdown()
