"""Across nodes for real: a Ray cluster of several raylets on this machine (tests/multinode.py), a
head without CPUs and two worker nodes of two CPUs each. A TP=2 engine whose ranks sit on different
nodes (STRICT_SPREAD, gloo) and DP=2 replicas on different nodes give the same greedy tokens as the
single-node run; `kvray info` lists the nodes and where each engine's bundles would go."""

import json

import pytest
from multinode import ENGINE, bundle_nodes, local_cluster

from cluster import LLM, SamplingParams
from cluster.cli import main

pytestmark = pytest.mark.timeout(240)

PROMPTS = ["Hello, my name is", "The capital of France", "a b c d e f", "Once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(a=1, b=1) as c:
        yield c


def generate(**kw):
    llm = LLM(**ENGINE, **kw)
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        return [list(o.outputs[0].token_ids) for o in outs], [bundle_nodes(pg) for pg in llm.engines.pgs]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def single_node(cluster):
    """DP=2 at TP=1 on one-CPU nodes: each replica is a single-node engine on its own node, and the
    prompts are spread over both (least-loaded dispatch alternates)."""
    return generate(tensor_parallel_size=1, data_parallel_size=2)


def test_dp2_replicas_sit_on_two_nodes(cluster, single_node):
    _, where = single_node
    assert sorted(cluster.node_name(r[0]) for r in where) == ["a", "b"]


def test_tp2_ranks_on_two_nodes_give_the_single_node_tokens(cluster, single_node):
    tokens, where = generate(tensor_parallel_size=2, placement_strategy="STRICT_SPREAD")
    assert sorted(cluster.node_name(n) for n in where[0]) == ["a", "b"]
    assert tokens == single_node[0]


def test_kvray_info_lists_the_nodes_and_the_spread_placement(cluster, capsys):
    argv = [
        "info",
        "--config",
        "configs/local.yaml",
        "--set",
        f"ray.address={cluster.address}",
        "--set",
        "parallel.tensor_parallel_size=2",
        "--set",
        "parallel.placement_strategy=STRICT_SPREAD",
    ]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    nodes = {n["node_id"]: n for n in report["cluster"]["nodes"]}
    assert len(nodes) == 3 and all(n["alive"] for n in nodes.values())
    assert {n["labels"].get("kvray-node") for n in nodes.values()} == {None, "a", "b"}
    placed = report["placement"]["engines_on"][0]
    assert sorted(cluster.node_name(n) for n in placed) == ["a", "b"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    for name in ("a", "b"):
        row = next(line for line in table.splitlines() if line.startswith(cluster.nodes[name].node_id[:12]))
        assert f"kvray-node={name}" in row and ("e0r0" in row or "e0r1" in row), table
