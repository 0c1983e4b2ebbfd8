"""Failures surface fast and clearly: a killed worker actor, a worker process that exits, a worker that
hangs past the step timeout, a placement the cluster can never or not now satisfy; and within the
restart budget a killed worker is replaced with every request still answered exactly once."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import threading

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from waits import wait_until, within

from actors.messages import RequestSpec
from cluster import LLM, SamplingParams
from cluster.config import EngineConfig
from cluster.replicas.engine_group import EngineFailure, EngineGroup
from cluster.replicas.placement import PlacementError, start_local_ray

NOOP = "actors.worker.noop.NoopWorker"
LONG = SamplingParams(max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    start_local_ray(num_cpus=6, include_dashboard=False)
    yield
    ray.shutdown()


def noop_config(**kw):
    base = dict(
        tensor_parallel_size=2,
        step_timeout_s=3,
        placement_timeout_s=10,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        num_gpu_blocks=512,
    )
    return EngineConfig().replace(**{**base, **kw})


def drain_until_fatal(group, limit_s):
    wait_until(
        lambda: group.fatal is not None, limit_s, step=lambda: group.poll(timeout_s=0.2), what="the replica's failure"
    )


def test_killed_worker_gives_every_caller_a_clear_error_within_seconds():
    llm = LLM(
        model="tiny-random",
        tensor_parallel_size=2,
        max_num_batched_tokens=128,
        max_num_seqs=4,
        cpu_kv_cache_gib=0.01,
        step_timeout_s=20,
        transport="compiled_graph",
    )
    try:
        driver = llm.engines.drivers[0]

        def kill_once_decoding():  # not earlier: a kill while the first step compiles is another case
            wait_until(lambda: ray.get(driver.stats.remote())["num_output_tokens"] > 0, 120, what="the first tokens")
            ray.get(driver.kill_worker.remote(1))

        threading.Thread(target=kill_once_decoding, daemon=True).start()
        # The requests still have most of their 400 tokens to go at the kill; the bound only catches a hang.
        with pytest.raises(EngineFailure) as e:
            within(120, llm.generate, ["abc", "defg"], LONG)
        assert "worker rank 1 failed" in str(e.value) and "died" in str(e.value), str(e.value)
        # Later callers are refused with the same reason, at once.
        out = llm.generate(["x"], SamplingParams(max_tokens=2))[0]
        assert out.outputs[0].finish_reason == "error" and "is down" in out.error and "rank 1" in out.error
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "transport,fault,expected",
    [
        ("actor_calls", "exit", ["worker rank 1 failed"]),
        ("compiled_graph", "hang", ["parallel.step_timeout_s=3"]),
    ],
    ids=["process-exit", "hang-past-step-timeout"],
)
def test_a_failing_worker_ends_the_replica_naming_the_cause(transport, fault, expected):
    group = EngineGroup(noop_config(transport=transport), worker_cls=NOOP)
    try:
        ray.get(group.drivers[0].worker_call.remote(1, "inject_fault", fault, 3))
        group.submit([RequestSpec("r0", [1, 2, 3], LONG)])
        drain_until_fatal(group, 120)
        assert all(x in group.fatal for x in expected), group.fatal
        assert "worker rank 1" in group.fatal or "a worker failed" in group.fatal, group.fatal
    finally:
        group.shutdown()


def test_restart_budget_rebuilds_the_tp_group_and_loses_nothing():
    group = EngineGroup(noop_config(transport="compiled_graph", max_worker_restarts=1), worker_cls=NOOP)
    try:
        specs = [
            RequestSpec(f"r{i}", list(range(1, 20 + i)), SamplingParams(max_tokens=300, ignore_eos=True))
            for i in range(6)
        ]
        group.submit(specs)
        tokens: dict[str, list[int]] = {s.request_id: [] for s in specs}
        finished = []
        killed = False

        def step():
            nonlocal killed
            if not killed and sum(map(len, tokens.values())) > 0:
                ray.get(group.drivers[0].kill_worker.remote(0))
                killed = True
            for o in group.poll(timeout_s=0.5):
                tokens[o.request_id].extend(o.new_token_ids)
                if o.finished:
                    assert o.error is None, o.error
                    finished.append(o.request_id)
            assert group.fatal is None, group.fatal

        wait_until(lambda: len(finished) == len(specs), 180, step=step, what="every request finishing")
        assert sorted(finished) == sorted(tokens)  # every request exactly once
        assert all(len(t) == 300 for t in tokens.values()), {k: len(v) for k, v in tokens.items()}
        assert killed and group.stats()[0]["worker_restarts"] == 1
    finally:
        group.shutdown()


def test_impossible_placement_fails_at_once_with_what_was_asked_and_what_exists():
    # Were it waited for, the placement timeout would outlast the bound.
    with pytest.raises(PlacementError) as e:
        within(
            120, EngineGroup, EngineConfig().replace(device="cuda", tensor_parallel_size=99, placement_timeout_s=3600)
        )
    msg = str(e.value)
    assert "asked for 99 bundle(s) {'GPU': 1.0}" in msg and "the cluster does not have that many" in msg
    assert "The cluster has {" in msg and "'CPU': 6.0" in msg


def test_placement_not_satisfiable_now_fails_within_its_timeout():
    blocker = placement_group([{"CPU": 1.0}] * 5, strategy="PACK")
    ray.get(blocker.ready())
    try:
        with pytest.raises(PlacementError) as e:
            within(120, EngineGroup, EngineConfig().replace(tensor_parallel_size=3, placement_timeout_s=2))
        assert "not satisfied within parallel.placement_timeout_s=2s" in str(e.value)
        assert "free now" in str(e.value)
    finally:
        remove_placement_group(blocker)


def test_a_driver_killed_from_outside_leaves_no_placement_group_behind():
    # TP=4 of the 6 CPUs: were the first group's bundles leaked, the second could not be placed.
    group = EngineGroup(noop_config(tensor_parallel_size=4), worker_cls=NOOP)
    pg = group.pgs[0]
    ray.kill(group.drivers[0], no_restart=True)
    group.shutdown()
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    again = EngineGroup(noop_config(tensor_parallel_size=4), worker_cls=NOOP)
    try:
        again.submit([RequestSpec("r0", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))])
        done = []
        wait_until(
            lambda: done,
            120,
            step=lambda: done.extend(i for i in again.poll(timeout_s=0.5) if i.finished),
            what="the request on the second group finishing",
        )
        assert [d.request_id for d in done] == ["r0"] and done[0].error is None
    finally:
        again.shutdown()
