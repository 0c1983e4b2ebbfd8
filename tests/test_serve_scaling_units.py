"""The scaling pieces of `kvray serve` without Ray: serve.ingress_replicas and serve.autoscaling (their
validation names the field and the rule), the deployments' options built from them, the autoscaling
policy's arithmetic, the engine client following the fleet's live set (join, drain, leave), and the
router's index growing with a new replica."""

from types import SimpleNamespace
from typing import Any

import pytest

from actors.config.section import ConfigError
from cluster.config import load_config
from cluster.serve.app import deployment_options, engine_deployment_options
from cluster.serve.autoscaling import OUTSTANDING_METRIC, POLICY, outstanding_requests_policy
from cluster.serve.engine_client import AsyncEngineClient
from cluster.serve.fleet import DRAINING, UP, FleetMember, FleetView
from cluster.serve.router import KVAwareRouter

SCALING = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4, "drain_timeout_s": 5}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"serve.ingress_replicas": 0}, "serve.ingress_replicas=0: must be in [1, 1024]"),
        ({"serve.autoscaling": {"min_replicas": 0}}, "serve.autoscaling.min_replicas=0: must be in [1, 1024]"),
        (
            {"serve.autoscaling": {"min_replicas": 3, "max_replicas": 2}},
            "serve.autoscaling.max_replicas=2: must be in [min_replicas, 1024]",
        ),
        (
            {"serve.autoscaling": {"target_ongoing_requests": 0}},
            "serve.autoscaling.target_ongoing_requests=0.0: must be in (0, 1e6]",
        ),
        (
            {"serve.autoscaling": {"metrics_interval_s": 5, "look_back_period_s": 1}},
            "serve.autoscaling.look_back_period_s=1.0: must be in [metrics_interval_s, 86400] seconds",
        ),
        (
            {"serve.autoscaling": {"max_replica": 2}},
            "serve.autoscaling={'max_replica': 2}: unknown field(s) ['max_replica']",
        ),
        ({"serve.autoscaling": 3}, "serve.autoscaling=3: must be a mapping of min_replicas"),
    ],
)
def test_bad_scaling_fields_are_refused_naming_the_field_and_the_rule(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("configs/local.yaml", overrides)
    assert message in str(e.value)


def test_the_deployments_take_their_sizes_from_the_config():
    fixed = load_config("configs/local.yaml", {"parallel.data_parallel_size": 2, "serve.ingress_replicas": 3})
    assert deployment_options(fixed)["num_replicas"] == 3
    assert engine_deployment_options(fixed)["num_replicas"] == 2
    scaled = load_config("configs/local.yaml", {"parallel.data_parallel_size": 5, "serve.autoscaling": SCALING})
    opts = engine_deployment_options(scaled)
    assert "num_replicas" not in opts
    a = opts["autoscaling_config"]
    assert (a["min_replicas"], a["max_replicas"], a["initial_replicas"]) == (1, 3, 3)  # 5 clamped to max
    assert a["target_ongoing_requests"] == 4 and a["policy"] == {"policy_function": POLICY}
    assert opts["graceful_shutdown_timeout_s"] > 5  # the drain fits in Serve's stop
    # The ingress's own limit covers every replica the engines may scale to.
    per = scaled.scheduler.max_num_seqs + scaled.serve.max_queued_requests
    assert deployment_options(scaled)["max_ongoing_requests"] >= 3 * per


def test_the_policy_asks_for_total_outstanding_over_the_target():
    def ctx(values: dict[str, float] | None) -> Any:
        metrics = None if values is None else {OUTSTANDING_METRIC: values}
        return SimpleNamespace(
            aggregated_metrics=metrics, config=SimpleNamespace(target_ongoing_requests=4.0), current_num_replicas=2
        )

    assert outstanding_requests_policy(ctx({"a": 6.0, "b": 4.0}))[0] == 2.5
    assert outstanding_requests_policy(ctx({"a": 0.0, "b": 0.0}))[0] == 0.0
    assert outstanding_requests_policy(ctx(None))[0] == 2  # nothing reported yet: stay


class _Driver:
    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.abort = SimpleNamespace(remote=self.aborted.extend)


def test_the_engine_client_follows_the_fleet():
    config = load_config("configs/local.yaml", {"serve.prefix_affinity": False})
    client = AsyncEngineClient(config, {"num_blocks": 16, "max_model_len": 256})
    d0, d2 = _Driver(), _Driver()
    client.sync(FleetView(1, [FleetMember(0, d0)], 1))
    assert len(client.books) == 1 and client.books[0].takes_requests
    # Replica 2 joins; id 1 never did (it failed to start): it stays down, never chosen.
    client.sync(FleetView(2, [FleetMember(0, d0), FleetMember(2, d2)], 3))
    assert [b.takes_requests for b in client.books] == [True, False, True]
    assert client.drivers[2] is d2 and len(client.router.index.held) == 3
    client.sync(FleetView(3, [FleetMember(0, d0, state=DRAINING), FleetMember(2, d2, state=UP)], 3))
    assert client.books[0].draining and not client.books[0].takes_requests
    client.sync(FleetView(4, [FleetMember(2, d2)], 3))
    assert client.books[0].down is not None and "left the fleet" in client.books[0].down
    assert client.num_live == 1 and client.fleet_version == 4


def test_the_router_grows_with_a_replica_and_routes_to_it():
    router = KVAwareRouter(1, 4, 16, imbalance_threshold=8)
    assert router.add_replica() == 1
    assert router.choose([1, 2, 3, 4, 5], [3, 0], [True, True]) == 1  # the new one is the least loaded


def test_the_fleet_hands_out_ids_tracks_states_and_wakes_a_long_poll():
    import asyncio

    from cluster.serve.fleet import EngineFleet

    async def run():
        fleet = EngineFleet()
        (r0, tag), (r1, _) = await fleet.reserve(), await fleet.reserve()
        assert (r0, r1) == (0, 1) and tag == fleet.tag
        waiting = asyncio.ensure_future(fleet.view(after_version=0, timeout_s=30))
        await asyncio.sleep(0)
        await fleet.register(FleetMember(r1, "driver-1"))
        view = await asyncio.wait_for(waiting, 10)  # woken by the change, not the timeout
        assert [m.replica for m in view.members] == [1] and view.tag == fleet.tag
        await fleet.set_state(1, DRAINING)
        assert (await fleet.view()).members[0].state == DRAINING
        await fleet.leave(1)
        assert (await fleet.view()).members == []
        # A fleet that restarted learns the replicas again from their registrations: ids stay unique.
        again = EngineFleet()
        await again.register(FleetMember(5, "driver-5"))
        assert (await again.reserve())[0] == 6

    asyncio.run(run())


def test_a_restarted_fleet_empty_for_a_moment_takes_no_replica_down():
    config = load_config("configs/local.yaml", {"serve.prefix_affinity": False})
    client = AsyncEngineClient(config, {"num_blocks": 16, "max_model_len": 256})
    d0 = _Driver()
    client.sync(FleetView(7, [FleetMember(0, d0)], 1, tag="old"))
    client.sync(FleetView(0, [], 0, tag="new"))  # restarted: nobody registered again yet
    assert client.books[0].down is None and client.fleet_version == 0
    client.sync(FleetView(1, [FleetMember(0, d0)], 1, tag="new"))  # it registered again
    client.sync(FleetView(2, [], 1, tag="new"))  # and now it really left
    assert client.books[0].down is not None


class _Remote:
    """A Ray method's `.remote`: here a coroutine, which the client awaits as it awaits an ObjectRef."""

    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Fleet:
    """The fleet as an ingress sees it: a long-poll view, here changed by the test."""

    def __init__(self, view: FleetView) -> None:
        import asyncio

        self.current, self.changed = view, asyncio.Event()
        self.view = _Remote(self._view)

    async def _view(self, after: int, timeout_s: float) -> FleetView:
        import asyncio

        if self.current.version <= after:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.current


class _LiveDriver:
    def __init__(self, replica: int) -> None:
        from actors.messages import PollResult

        async def outputs(timeout_s: float, client_id: str) -> PollResult:
            import asyncio

            await asyncio.sleep(0.01)
            return PollResult([])

        async def stats() -> dict[str, Any]:
            return {"replica": replica, "kv_cache_usage": 0.5}

        self.get_outputs, self.stats = _Remote(outputs), _Remote(stats)
        self.release_client = _Remote(lambda client_id: None)


def test_health_and_metrics_follow_the_fleet_before_any_request():
    """An ingress that has served no request yet still learns of a replica that joined after it came up:
    /health and /metrics read the live set, so they start the fleet watch (once failed in CI: replica 1
    registered after the ingress's first view and /metrics never showed it)."""
    import asyncio

    async def run():
        config = load_config("configs/local.yaml", {"serve.prefix_affinity": False})
        fleet = _Fleet(FleetView(1, [FleetMember(0, _LiveDriver(0))], 1))
        client = AsyncEngineClient(config, {"num_blocks": 16, "max_model_len": 256}, fleet=fleet)
        client.sync(fleet.current)
        try:
            assert client.healthy()
            fleet.current = FleetView(2, [FleetMember(0, _LiveDriver(0)), FleetMember(1, _LiveDriver(1))], 2)
            fleet.changed.set()
            for _ in range(200):
                if len(client.books) == 2:
                    break
                await asyncio.sleep(0.01)
            stats = await client.engine_stats()
            assert [s["replica"] for s in stats] == [0, 1] and client.num_live == 2
        finally:
            client.shutdown()

    asyncio.run(run())


def test_a_restarted_fleet_hands_out_ids_past_every_live_driver(monkeypatch):
    """Serve restarted the fleet: its live set is empty until the engine replicas register again, but an
    id reserved meanwhile must not be one a live driver of the app holds (its name carries it). Another
    app's or an LLM's drivers in the same namespace do not count: a new app starts at 0."""
    import asyncio

    import ray

    from cluster.replicas.driver_names import driver_name, replica_of
    from cluster.serve.fleet import EngineFleet

    live = [
        {"name": driver_name("a1b2c3d4", 0), "namespace": "kvray"},
        {"name": driver_name("a1b2c3d4", 4, generation=2), "namespace": "kvray"},
        {"name": driver_name("0f0f0f0f", 9), "namespace": "kvray"},  # an LLM's beside the server
        {"name": driver_name("a1b2c3d4", 7), "namespace": "elsewhere"},
        {"name": "SERVE_CONTROLLER_ACTOR", "namespace": "kvray"},
    ]
    monkeypatch.setattr(ray.util, "list_named_actors", lambda all_namespaces=False: live)
    assert [replica_of(a["name"], "a1b2c3d4") for a in live] == [0, 4, None, 7, None]
    restarted = EngineFleet(namespace="kvray", app_tag="a1b2c3d4")
    assert asyncio.run(restarted.reserve()) == (5, "a1b2c3d4") and restarted.tag != "a1b2c3d4"
    assert asyncio.run(EngineFleet(namespace="kvray", app_tag="new00000").reserve())[0] == 0
