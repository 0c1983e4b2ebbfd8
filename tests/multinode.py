"""A real multi-node Ray cluster on this machine for tests: `ray.cluster_utils.Cluster`, one raylet per
node, each a separate Ray node with its own resources and labels, all on 127.0.0.1; and the node-loss
tests' requests and their run through an EngineGroup (every request exactly once, its tokens in order).

Every node (and the GCS) listens on the loopback address only: the nodes are started inside the switch
that keeps kvray's embedded Ray local (cluster/replicas/placement.py). The cluster records itself in a private
Ray temp dir, never in /tmp/ray, so no other Ray user on the machine finds or joins it, and the test
stops it with `Cluster.shutdown()` (its own processes only).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Iterator

import ray
from ray.cluster_utils import Cluster

from actors.messages import RequestSpec
from cluster.replicas.placement import LOOPBACK, loopback_node_ip
from kvcore.request import SamplingParams

# A killed node is noticed within a few seconds (Ray's default is 15 s): the failure tests wait for it.
# Not faster: on a loaded CI machine a live raylet can miss a check or two, and would be taken for dead.
FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 4,
}


class LocalCluster:
    """A head without CPUs (the client and the driver actors live there) and worker nodes."""

    def __init__(self, tmp: str, head_resources: dict[str, float] | None = None) -> None:
        self.tmp = tmp
        with loopback_node_ip():
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args=dict(
                    num_cpus=0,
                    resources=head_resources or {},  # a custom resource pins an actor to the head
                    node_ip_address=LOOPBACK,
                    temp_dir=tmp,
                    include_dashboard=False,
                    _system_config=FAST_HEALTH_CHECKS,
                ),
            )
        self.nodes: dict[str, Any] = {}

    @property
    def address(self) -> str:
        return self.cluster.address

    def add(self, name: str, num_cpus: int = 1) -> Any:
        """A worker node labelled kvray-node=<name>, with a custom resource of its name."""
        with loopback_node_ip():
            node = self.cluster.add_node(
                num_cpus=num_cpus, node_ip_address=LOOPBACK, resources={name: 1.0}, labels={"kvray-node": name}
            )
        self.nodes[name] = node
        return node

    def remove(self, name: str) -> None:
        """The node's raylet and every process on it killed at once, as a lost host."""
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)

    def node_name(self, node_id: str) -> str:
        """The name a node was added under, from its Ray node id."""
        return next(name for name, n in self.nodes.items() if n.node_id == node_id)

    def connect(self) -> None:
        with loopback_node_ip():
            ray.init(address=self.address, namespace="kvray-test-multinode", log_to_driver=False)


# A tiny-random CPU engine small enough for several replicas on the loopback nodes.
ENGINE = dict(
    model="tiny-random",
    device="cpu",
    max_num_seqs=4,
    max_num_batched_tokens=64,
    cpu_kv_cache_gib=0.01,
    step_timeout_s=60,
    placement_timeout_s=30,
)


@contextlib.contextmanager
def local_cluster(head_resources: dict[str, float] | None = None, **nodes: int) -> Iterator[LocalCluster]:
    """A connected LocalCluster with worker nodes {name: num_cpus}; shut down (and its temp dir removed)."""
    tmp = tempfile.mkdtemp(prefix="kvn-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    os.makedirs(os.path.join(tmp, "ray"))
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp  # where Cluster records its address (ray_current_cluster)
    c = None
    try:
        c = LocalCluster(tmp, head_resources)
        for name, cpus in nodes.items():
            c.add(name, cpus)
        c.connect()
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if c is not None:
            c.cluster.shutdown()
        if old is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old
        shutil.rmtree(tmp, ignore_errors=True)


def bundle_nodes(pg: Any) -> list[str]:
    """The Ray node id of each bundle of a placement group, in bundle order."""
    table = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    return [table[i] for i in sorted(table)]


def node_of(cluster: LocalCluster, group: Any, replica: int) -> str:
    """The name of the node under a replica's first bundle."""
    return cluster.node_name(bundle_nodes(group.pgs[replica])[0])


# ---- the node-loss tests' requests: greedy and seeded, each ending exactly once with its max_tokens
N = 6
# Long enough that a replica is still decoding when its node goes (the action fires after the first
# tokens): at 16, a replica sometimes finished all its requests first and never saw the loss. Pipeline
# engines pass fewer (`tokens=`): each of their tokens takes several times as long (PP_TOKENS).
TOKENS = 48
# A pipeline engine's batches take turns and each crosses every stage: a request gets a token every few
# tenths of a second on a 2-core machine, so 24 still leave seconds of decoding after the first tokens,
# when the node goes (removing it takes well under a second); 48 made these tests' runs twice as long.
PP_TOKENS = 24


def specs(tag: str, tokens: int = TOKENS) -> list[RequestSpec]:
    out = []
    for i in range(N):
        sp = (
            SamplingParams(max_tokens=tokens, ignore_eos=True)
            if i % 2 == 0
            else SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=tokens, ignore_eos=True)
        )
        out.append(RequestSpec(f"{tag}-{i}", [(7 * i + j) % 250 + 1 for j in range(6 + i)], sp))
    return out


class Outputs:
    """One batch's outputs as an EngineGroup delivers them: each request's tokens, and the requests that
    finished, in the order they did (each must finish once, without an error)."""

    def __init__(self, group: Any, batch: list[RequestSpec]) -> None:
        self.group, self.batch = group, batch
        self.tokens: dict[str, list[int]] = {s.request_id: [] for s in batch}
        self.finished: list[str] = []

    def collect(self) -> None:
        """One poll's outputs; the group must not be down for good."""
        for o in self.group.poll(timeout_s=0.5):
            self.tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                assert o.error is None, o.error
                self.finished.append(o.request_id)
        assert self.group.fatal is None, self.group.fatal

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.tokens.values()))

    def in_order(self) -> list[list[int]]:
        """Every request's tokens in submission order, once each has finished exactly once."""
        assert sorted(self.finished) == sorted(self.tokens)  # each exactly once
        return [self.tokens[s.request_id] for s in self.batch]


def run(
    group: Any,
    tag: str,
    action: Callable[[], Any] | None = None,
    deadline_s: float = 400,
    tokens: int = TOKENS,
) -> list[list[int]]:
    """Submit specs(tag, tokens) to an EngineGroup and poll until every request finished: each request's
    tokens, in submission order. `action` runs once, after the first tokens of the run; every request must
    end exactly once, without an error, within deadline_s."""
    batch = specs(tag, tokens)
    assert group.submit(batch) == {}
    out = Outputs(group, batch)
    deadline = time.monotonic() + deadline_s
    while len(out.finished) < N:
        # The state of every replica in the message: a hang here must say where it is.
        assert time.monotonic() < deadline, (
            f"round {tag!r}: {len(out.finished)} of {N} finished; states {group.state}, "
            f"pending {group.failover.pending}, owners {group.failover.owner}, {group.stats()}"
        )
        if action is not None and out.num_tokens >= 4:
            action, act = None, action
            act()
        out.collect()
    return out.in_order()
