"""Node failure on a real multi-node cluster (tests/multinode.py): nodes a, b, c of one CPU each, an
engine of two data-parallel replicas (TP=1) on two of them, the third spare. Each round runs the same
greedy and seeded requests and must give the reference tokens, every request exactly once:

1. the node under replica 0 goes away mid-run: its placement group is rescheduled on the spare node
   and its TP group rebuilt there;
2. the node under replica 1 goes away with no spare left: replica 1 cannot rebuild, its requests
   move to replica 0;
3. a new node joins: replica 1 rebuilds on it and takes requests again;
4. replica 0's driver actor is killed mid-run: a new driver takes its place, its requests move.
"""

import pytest
import ray
from multinode import TOKENS, local_cluster, node_of, run
from waits import wait_until

from cluster.config import EngineConfig
from cluster.replicas.engine_group import EngineGroup
from cluster.replicas.failover import UP

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(a=1, b=1, c=1) as c:
        yield c


@pytest.fixture(scope="module")
def group(cluster):
    config = EngineConfig().replace(
        model="tiny-random",
        device="cpu",
        data_parallel_size=2,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        cpu_kv_cache_gib=0.01,
        step_timeout_s=60,
        placement_timeout_s=4,
        max_worker_restarts=3,
        transport="actor_calls",
    )
    g = EngineGroup(config)
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def reference(group):
    ref = run(group, "ref")
    assert all(len(t) == TOKENS for t in ref)
    return ref


def test_a_lost_node_rebuilds_the_replica_on_the_spare_node(cluster, group, reference):
    used = {node_of(cluster, group, 0), node_of(cluster, group, 1)}
    spare = ({"a", "b", "c"} - used).pop()
    lost = node_of(cluster, group, 0)
    assert run(group, "rebuild", action=lambda: cluster.remove(lost)) == reference

    def rebuilt() -> bool:
        # The requests may all finish on replica 1 before replica 0's new group is placed, and the driver
        # counts the restart only once the workers on the new placement are built, after Ray placed it.
        try:
            return node_of(cluster, group, 0) != lost and group.stats()[0].get("worker_restarts", 0) >= 1
        except StopIteration:  # still the old group, on the node that is gone
            return False

    wait_until(rebuilt, 120, what="replica 0 rebuilt after its node was lost")
    assert node_of(cluster, group, 0) == spare
    assert group.stats()[0]["worker_restarts"] == 1


def test_with_no_spare_node_the_requests_move_to_the_other_replica(cluster, group, reference):
    lost = node_of(cluster, group, 1)
    assert run(group, "failover", action=lambda: cluster.remove(lost)) == reference
    assert group.state[1] == "rebuilding" and group.failover.moved_away[1] > 0, (group.state, group.failover.moved_away)


def test_a_node_that_joins_later_is_used_again(cluster, group, reference):
    cluster.add("d")
    wait_until(
        lambda: group.state[1] == UP,
        120,
        step=lambda: group.poll(timeout_s=0.5),
        what="replica 1 rebuilding on the new node",
    )
    assert node_of(cluster, group, 1) == "d"
    before = group.stats()[1]["num_output_tokens"]
    assert run(group, "rejoined") == reference
    assert group.stats()[1]["num_output_tokens"] > before


def test_a_killed_driver_is_replaced_and_its_requests_move(cluster, group, reference):
    assert run(group, "driver", action=lambda: ray.kill(group.drivers[0], no_restart=True)) == reference
    assert group.failover.driver_restarts[0] == 1
    wait_until(
        lambda: group.state[0] == UP,
        120,
        step=lambda: group.poll(timeout_s=0.5),
        what="the new driver of replica 0 starting",
    )
