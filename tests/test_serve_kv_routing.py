"""KV-aware routing across the replicas of `kvray serve` (local Ray, 127.0.0.1 only, two CPU replicas of
tiny-random): the engines publish their prefix caches' changes on the poll path, the ingress indexes
them, and a request goes to the replica holding its prefix, unless that replica is overloaded."""

import asyncio

import openai
import pytest
import ray

from tests.serve_helpers import SERVE_OVERRIDES, drivers, running_server

pytestmark = pytest.mark.timeout(600)
MODEL = "tiny-random"
PREFIX_A = [1 + (7 * i) % 240 for i in range(64)]  # four full blocks of 16
PREFIX_B = [3 + (11 * i) % 240 for i in range(64)]


@pytest.fixture(scope="module")
def server():
    with running_server({**SERVE_OVERRIDES, "serve.imbalance_threshold": 2}) as url:
        yield url


def _stats() -> dict[int, dict]:
    return {s["replica"]: s for s in (ray.get(d.stats.remote(), timeout=30) for d in drivers())}


def test_a_family_goes_to_the_replica_holding_its_prefix(server):
    c = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)

    def ask(prefix, k):
        c.completions.create(model=MODEL, prompt=prefix + [245 + k, 246 + k], max_tokens=1, temperature=0)

    ask(PREFIX_A, 0)
    first = _stats()
    holder_a = next(r for r, s in first.items() if s["num_output_tokens"] == 1)
    ask(PREFIX_B, 0)  # a new prefix: the replica holding fewer blocks
    second = _stats()
    holder_b = 1 - holder_a
    assert second[holder_b]["num_output_tokens"] == 1, second
    for k in range(1, 6):  # one at a time: no imbalance, each member to its family's holder
        ask(PREFIX_A, k)
        ask(PREFIX_B, k)
    after = _stats()
    assert after[holder_a]["num_output_tokens"] == 6 and after[holder_b]["num_output_tokens"] == 6, after
    # Each later member found its family's four blocks cached where it went.
    for r in (holder_a, holder_b):
        hits = after[r]["prefix_cache_hits"] - second[r]["prefix_cache_hits"]
        assert hits >= 5 * 64, (r, after[r])


def test_an_overloaded_holder_is_passed_over_for_the_least_loaded(server):
    async def run():
        c = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=180)
        streams = []
        try:
            for k in range(4):  # family A's holder takes three (threshold 2), the fourth goes elsewhere
                s = await c.completions.create(
                    model=MODEL,
                    prompt=PREFIX_A + [250 + k],
                    max_tokens=100,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                await s.__anext__()  # it is running before the next one is routed
                streams.append(s)
            return {r: s["num_live_requests"] for r, s in _stats().items()}
        finally:
            for s in streams:
                await s.close()
            await c.close()

    live = asyncio.run(run())
    assert sorted(live.values()) == [1, 3], live
