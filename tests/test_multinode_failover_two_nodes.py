"""A lost node with no node to replace it, on the smallest cluster that shows it (tests/multinode.py): a
head without CPUs and two nodes of one CPU, one data-parallel replica (TP=1) on each, the default
transport. The README promises that the replica's requests move to the surviving one; a stranded request
once left `generate` waiting past 240 s. Its own cluster: tests/test_multinode_failures.py holds a
three-node one for the whole module.
"""

import pytest
from multinode import N, Outputs, local_cluster, node_of, run, specs
from waits import wait_until

from cluster.config import EngineConfig
from cluster.replicas.engine_group import EngineGroup
from cluster.replicas.failover import UP

pytestmark = pytest.mark.timeout(420)


def test_two_nodes_one_replica_each_a_lost_node_moves_its_requests_within_the_placement_timeout():
    """The setting the README's promise was found broken in: a head and two nodes, one replica on each
    (DP=2), the default transport, and no node to replace the one that goes away. Its replica's requests
    must continue on the other replica once its placement wait (parallel.placement_timeout_s) runs out,
    well before the step timeout a stranded request would wait out, and every request must end exactly
    once with the reference tokens."""
    placement_timeout_s, step_timeout_s = 4, 120
    with local_cluster(a=1, b=1) as two:
        config = EngineConfig().replace(
            model="tiny-random",
            device="cpu",
            data_parallel_size=2,
            max_num_seqs=2,
            max_num_batched_tokens=64,
            cpu_kv_cache_gib=0.01,
            step_timeout_s=step_timeout_s,
            placement_timeout_s=placement_timeout_s,
            max_worker_restarts=1,
        )
        g = EngineGroup(config)
        try:
            assert sorted(node_of(two, g, r) for r in (0, 1)) == ["a", "b"]  # one replica per node
            ref = run(g, "two-ref")
            lost_replica = 1
            lost = node_of(two, g, lost_replica)
            batch = specs("two-failover")
            assert g.submit(batch) == {}
            out = Outputs(g, batch)
            wait_until(lambda: out.num_tokens >= 4, 120, step=out.collect, what="the first tokens")
            assert any(owner == lost_replica for owner in g.failover.owner.values())  # it holds requests when it goes
            two.remove(lost)
            # Node death is seen within a few seconds (FAST_HEALTH_CHECKS); a stranded request would wait
            # for the step timeout and beyond (240 s and more were seen).
            wait_until(
                lambda: g.failover.moved_away[lost_replica] > 0,
                placement_timeout_s + step_timeout_s / 2,
                step=out.collect,
                what=f"replica {lost_replica}'s requests moving to the other replica",
            )
            assert g.state[lost_replica] == "rebuilding" and g.state[1 - lost_replica] == UP
            wait_until(lambda: len(out.finished) == N, 300, step=out.collect, what="every request finishing")
            assert out.in_order() == ref
        finally:
            g.shutdown()
