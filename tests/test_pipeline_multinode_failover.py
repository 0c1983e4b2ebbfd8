"""A lost stage node with no node to take its place (tests/multinode.py: a head without CPUs and four nodes
of one CPU): two data-parallel replicas of two pipeline stages each, every stage on its own node
(STRICT_SPREAD), so each replica spans two nodes and no CPU is left over. The node under replica 0's last
stage goes away mid-run: the replica's other stage lives on, but the replica cannot be placed again, so once
its placement wait (parallel.placement_timeout_s) runs out its requests continue on replica 1, well before a
step timeout, and every request ends exactly once with the no-fault tokens. Its own cluster: the other
pipeline node test (tests/test_pipeline_multinode.py) keeps a spare node for the whole module.
"""

import pytest
from multinode import PP_TOKENS, N, Outputs, bundle_nodes, local_cluster, run, specs
from waits import wait_until

from cluster.config import EngineConfig
from cluster.replicas.engine_group import EngineGroup
from cluster.replicas.failover import UP

pytestmark = pytest.mark.timeout(420)


def test_a_lost_stage_node_without_a_spare_moves_the_replicas_requests_to_the_other_replica():
    placement_timeout_s, step_timeout_s = 4, 120
    with local_cluster(a=1, b=1, c=1, d=1) as four:
        config = EngineConfig().replace(
            model="tiny-random",
            device="cpu",
            data_parallel_size=2,
            pipeline_parallel_size=2,
            placement_strategy="STRICT_SPREAD",
            max_num_seqs=2,
            max_num_batched_tokens=64,
            cpu_kv_cache_gib=0.01,
            step_timeout_s=step_timeout_s,
            placement_timeout_s=placement_timeout_s,
            max_worker_restarts=1,
        )
        g = EngineGroup(config)
        try:
            stages = [[four.node_name(n) for n in bundle_nodes(g.pgs[r])] for r in (0, 1)]
            assert sorted(stages[0] + stages[1]) == ["a", "b", "c", "d"], stages  # a node per stage, none spare
            ref = run(g, "pp-ref", tokens=PP_TOKENS)
            assert all(len(t) == PP_TOKENS for t in ref)
            batch = specs("pp-failover", PP_TOKENS)
            assert g.submit(batch) == {}
            out = Outputs(g, batch)
            wait_until(lambda: out.num_tokens >= 4, 120, step=out.collect, what="the first tokens")
            assert any(owner == 0 for owner in g.failover.owner.values())  # it holds requests when its node goes
            four.remove(stages[0][1])  # replica 0's last stage; its first stage's node stays up
            # Node death is seen within a few seconds (FAST_HEALTH_CHECKS); the rebuild then waits
            # placement_timeout_s for two free nodes that never come (8 s in all here, unloaded). The bound
            # stays below the collective timeout (step_timeout_s / 2), which a surviving stage stuck in a
            # send to the lost one would cost, and far below the step timeout a stranded request waits out.
            wait_until(
                lambda: g.failover.moved_away[0] > 0,
                placement_timeout_s + 20,
                step=out.collect,
                what="replica 0's requests moving to replica 1",
            )
            assert g.state[0] == "rebuilding" and g.state[1] == UP, g.state
            wait_until(lambda: len(out.finished) == N, 300, step=out.collect, what="every request finishing")
            assert out.in_order() == ref
        finally:
            g.shutdown()
