"""`ray.transport: shm` across Ray nodes (tests/multinode.py: raylets on this machine, the driver on a
head without CPUs): both ranks of a TP=2 engine sit on other nodes than the driver, so every step goes
over ZMQ. Greedy output equals the single-node run's; a killed rank on another node is replaced within
the restart budget and every request still ends once, whole."""

import pytest
import ray
from multinode import ENGINE, local_cluster
from waits import wait_until

from actors.messages import RequestSpec
from cluster import LLM, SamplingParams
from cluster.config import EngineConfig
from cluster.replicas.engine_group import EngineGroup

pytestmark = pytest.mark.timeout(300)
PROMPTS = ["Hello, my name is", "a b c d e f"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(a=1, b=1) as c:
        yield c


def generate(**kw):
    llm = LLM(**ENGINE, **kw)
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_tp2_across_nodes_over_zmq_gives_the_single_node_tokens(cluster):
    assert generate(tensor_parallel_size=2, placement_strategy="STRICT_SPREAD", transport="shm") == generate(
        tensor_parallel_size=1, transport="actor_calls"
    )


def test_a_killed_rank_on_another_node_is_replaced(cluster):
    config = EngineConfig().replace(
        tensor_parallel_size=2,
        placement_strategy="STRICT_SPREAD",
        transport="shm",
        step_timeout_s=10,
        placement_timeout_s=30,
        max_worker_restarts=1,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        num_gpu_blocks=512,
    )
    group = EngineGroup(config, worker_cls="actors.worker.noop.NoopWorker")
    specs = [RequestSpec(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=150, ignore_eos=True)) for i in range(3)]
    tokens: dict[str, list[int]] = {s.request_id: [] for s in specs}
    finished: list[str] = []
    killed: list[bool] = []

    def step():
        if not killed and sum(map(len, tokens.values())) > 30:
            ray.get(group.drivers[0].kill_worker.remote(1))
            killed.append(True)
        for o in group.poll(timeout_s=0.3):
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                assert o.error is None, o.error
                finished.append(o.request_id)
        assert group.fatal is None, group.fatal

    try:
        group.submit(specs)
        wait_until(lambda: len(finished) == len(specs), 180, step=step, what="every request finishing")
        assert sorted(finished) == sorted(tokens) and all(len(t) == 150 for t in tokens.values())
        assert killed and group.stats()[0]["worker_restarts"] == 1
    finally:
        group.shutdown()
