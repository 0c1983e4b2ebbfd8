"""ReplicaFailover on its own, through its DriverControl seam: what moves where when a replica's driver is
lost, restarts within parallel.max_driver_restarts, and the group going down past them."""

from __future__ import annotations

from typing import Any

import pytest
import ray

from actors.messages import RequestSpec
from cluster.replicas.failover import DOWN_STATE, STARTING, UP, FailoverLimits, ReplicaFailover
from cluster.replicas.placement import start_local_ray
from kvcore.request import SamplingParams


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    start_local_ray(num_cpus=1, include_dashboard=False)
    yield
    ray.shutdown()


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class FakeDriver:
    """Accepts every request; its answers are object refs, as an actor's are."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self.add_requests = _Remote(self._add)
        self.start = _Remote(lambda: ray.put({"started": True}))

    def _add(self, batch: list[RequestSpec]) -> Any:
        self.received += [s.request_id for s in batch]
        return ray.put([None] * len(batch))


class FakeDrivers:
    """The DriverControl EngineGroup would be, with what failover asked of it written down."""

    def __init__(self, n: int) -> None:
        self.drivers = [FakeDriver() for _ in range(n)]
        self.retired: list[int] = []
        self.started: list[tuple[int, int]] = []
        self.infos: dict[int, dict[str, Any]] = {}

    def driver(self, replica: int) -> Any:
        return self.drivers[replica]

    def retire_driver(self, replica: int) -> None:
        self.retired.append(replica)

    def start_driver(self, replica: int, generation: int) -> Any:
        self.started.append((replica, generation))
        self.drivers[replica] = FakeDriver()
        return self.drivers[replica].start.remote()

    def driver_started(self, replica: int, info: dict[str, Any]) -> None:
        self.infos[replica] = info


def specs(*ids: str) -> list[RequestSpec]:
    return [RequestSpec(rid, [1, 2, 3], SamplingParams(max_tokens=4)) for rid in ids]


def test_a_lost_replica_restarts_its_driver_and_its_requests_move_to_the_one_that_is_up():
    control = FakeDrivers(2)
    fo = ReplicaFailover(2, FailoverLimits(1, 60.0, 30.0), control)
    assert fo.submit(specs("a", "b", "c", "d")) == {}
    assert fo.outstanding == [2, 2]
    lost = sorted(rid for rid, r in fo.owner.items() if r == 0)

    fo.replica_lost(0, "the driver actor of engine replica 0 died: test")
    assert control.retired == [0] and control.started == [(0, 1)]
    assert fo.state == [STARTING, UP] and fo.driver_restarts == [1, 0]
    assert sorted(fo.pending) == lost and fo.moved_away == [2, 0] and fo.outstanding == [0, 2]

    fo.dispatch_pending()
    assert fo.pending == [] and fo.outstanding == [0, 4]
    assert sorted(control.drivers[1].received) == ["a", "b", "c", "d"]

    ray.wait(fo.starting_refs(), num_returns=1)
    fo.check_starting()
    assert fo.state == [UP, UP] and control.infos == {0: {"started": True}}
    assert fo.replica_stats(0) == {"driver_restarts": 1, "requests_moved_away": 2, "state": UP}


def test_past_the_restart_budget_a_replica_is_down_and_with_none_left_requests_are_refused():
    control = FakeDrivers(2)
    fo = ReplicaFailover(2, FailoverLimits(0, 60.0, 30.0), control)
    fo.replica_lost(0, "replica 0 gone")
    assert control.started == [] and fo.state == [DOWN_STATE, UP]
    fo.check_fatal()
    assert fo.fatal is None
    fo.replica_lost(1, "replica 1 gone")
    fo.check_fatal()
    assert fo.fatal == "replica 1 gone"
    errors = fo.submit(specs("x"))
    assert errors["x"].startswith("every engine replica") and "replica 1 gone" in errors["x"]
