"""Pipeline stages across nodes for real (tests/multinode.py: a head without CPUs and raylets of two CPUs
each, on this machine): a TP=2 x PP=2 engine puts each stage's two ranks on one node and the two stages
on two nodes (STRICT_SPREAD over the stage bundles), and gives the single-node greedy and seeded tokens;
when the node under a stage goes away mid-run, the stage's bundle moves to the spare node, the whole
engine's group is rebuilt there, and every request finishes exactly once with the reference tokens."""

import pytest
from multinode import PP_TOKENS, bundle_nodes, local_cluster, run

from cluster.config import EngineConfig
from cluster.replicas.engine_group import EngineGroup

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(a=2, b=2, c=2) as c:
        yield c


def engine_config(**kw):
    return EngineConfig().replace(
        model="tiny-random",
        device="cpu",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        cpu_kv_cache_gib=0.01,
        step_timeout_s=60,
        placement_timeout_s=30,
        transport="actor_calls",
        **kw,
    )


@pytest.fixture(scope="module")
def reference(cluster):
    group = EngineGroup(engine_config())
    try:
        return run(group, "ref", tokens=PP_TOKENS)
    finally:
        group.shutdown()


def test_each_stage_on_its_own_node_and_a_lost_stage_node_rebuilt_on_the_spare(cluster, reference):
    group = EngineGroup(
        engine_config(
            tensor_parallel_size=2, pipeline_parallel_size=2, placement_strategy="STRICT_SPREAD", max_worker_restarts=2
        )
    )
    try:
        stages = [cluster.node_name(n) for n in bundle_nodes(group.pgs[0])]
        assert len(stages) == 2 and len(set(stages)) == 2, stages  # a bundle (a stage's 2 ranks) per node
        assert run(group, "pp", tokens=PP_TOKENS) == reference
        spare = ({"a", "b", "c"} - set(stages)).pop()
        lost = stages[1]
        assert run(group, "lost", action=lambda: cluster.remove(lost), tokens=PP_TOKENS) == reference
        now = [cluster.node_name(n) for n in bundle_nodes(group.pgs[0])]
        assert now == [stages[0], spare], now
        assert group.stats()[0]["worker_restarts"] == 1
    finally:
        group.shutdown()
