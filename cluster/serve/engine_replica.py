"""One engine replica as a Ray Serve replica: its driver actor and placement group, from start to drain.

The engine replicas are a Serve deployment of their own (cluster/serve/app.py): parallel.data_parallel_size
of them, or as many as Ray Serve's autoscaling asks for (cluster/serve/autoscaling.py). They outlive any
ingress replica and are shared by all of them. Each starts its driver as EngineGroup does for `kvray run`
(cluster/replicas/engine_group.py: start_replica), then registers it with the fleet
(cluster/serve/fleet.py), where every ingress finds it. Nothing reaches it through Serve: the ingresses
call its driver directly.

When Ray Serve stops it (a scale-down, or the app going away), it drains before it goes:
  1. it says DRAINING in the fleet: every ingress stops sending to it and moves its requests that have
     no token yet to other replicas (AsyncEngineClient.drain);
  2. its running streams finish, for at most serve.autoscaling.drain_timeout_s;
  3. those still running are handed back (the driver's hand_back): each ingress moves them on,
     token-exact (cluster/serve/migration.py);
  4. once every ingress has polled what the driver still had for it, it leaves the fleet, and its
     driver (workers with it) and placement group go.
With no other replica to take them (the app is going away), step 3 ends those streams with an error
event instead, as a replica down does.

A replica whose driver died, or is down for good (its worker-restart budget spent), fails Ray Serve's
health check: Serve replaces it, and the new one joins the fleet under a new id. The ingresses have moved
its streams on already (cluster/serve/engine_client.py); this restores the capacity.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray.exceptions import RayActorError

from cluster.config import DEFAULT_WORKER_CLS, EngineConfig
from cluster.replicas.engine_group import StartedReplica, start_replica, stop_driver
from cluster.replicas.placement import remove, resolve_device
from cluster.serve.autoscaling import OUTSTANDING_METRIC
from cluster.serve.fleet import DRAINING, FleetMember
from cluster.serve.loopback import bind_internal_grpc_to_loopback

logger = logging.getLogger(__name__)

FLEET_CALL_BOUND_S = 10.0  # the fleet may be stopping beside it (the app going away)
DELIVERY_BOUND_S = 30.0  # how long a leaving replica waits for the ingresses to poll what it still holds
HEALTH_CALL_BOUND_S = 10.0  # a driver busier than this is busy, not dead
DEFAULT_DRAIN_TIMEOUT_S = 60.0  # without serve.autoscaling (the app going away)


class EngineReplica:
    """The engine replicas' deployment class (cluster/serve/app.py wraps it with serve.deployment)."""

    # Ray Serve awaits an async constructor (its start waits on the driver's); mypy wants __init__ sync.
    async def __init__(  # type: ignore[misc]
        self, config: EngineConfig, fleet: Any, worker_cls: str = DEFAULT_WORKER_CLS, loopback_only: bool = False
    ) -> None:
        if loopback_only:
            bind_internal_grpc_to_loopback()
        self.config = resolve_device(config)
        self.fleet = fleet
        self.replica, tag = await fleet.reserve.remote()
        self.started: StartedReplica | None = await asyncio.to_thread(
            start_replica, self.config, self.replica, tag, worker_cls
        )
        self.member = FleetMember(self.replica, self.started.driver, self.started.info)
        await fleet.register.remote(self.member)
        logger.info("engine replica %d is up", self.replica)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metric: the engine requests this replica holds, every ingress's."""
        if self.started is None:
            return {OUTSTANDING_METRIC: 0.0}
        stats = await self.started.driver.stats.remote()
        return {OUTSTANDING_METRIC: float(stats.get("num_live_requests", 0))}

    async def check_health(self) -> None:
        """Ray Serve's health check: raises when the driver is dead or down for good (Serve replaces the
        replica). A driver too busy to answer in time is healthy."""
        started = self.started
        if started is None:
            return
        try:
            stats = await asyncio.wait_for(started.driver.stats.remote(), HEALTH_CALL_BOUND_S)
        except asyncio.TimeoutError:
            return
        except RayActorError as e:
            raise RuntimeError(
                f"engine replica {self.replica}: its driver actor died: {str(e).splitlines()[0]}"
            ) from None
        if stats.get("fatal"):
            raise RuntimeError(f"engine replica {self.replica} is down: {stats['fatal']}")
        await self._stay_registered()

    async def _stay_registered(self) -> None:
        """The fleet restarted (its live set is empty then): register again."""
        try:
            view = await asyncio.wait_for(self.fleet.view.remote(), FLEET_CALL_BOUND_S)
        except Exception as e:  # noqa: BLE001 - the fleet restarting: the next check tries again
            logger.debug("fleet.view: %s", e)
            return
        if self.started is not None and all(m.replica != self.replica for m in view.members):
            logger.warning(
                "engine replica %d: not in the fleet's live set (it restarted); registering again", self.replica
            )
            await self.fleet.register.remote(self.member)

    async def __del__(self) -> None:
        started, self.started = self.started, None
        if started is None:
            return
        try:
            await self._drain(started)
        except Exception as e:  # noqa: BLE001 - the driver may be gone already; it goes anyway
            logger.warning("engine replica %d: drain: %s: %s", self.replica, type(e).__name__, e)
        try:
            await asyncio.wait_for(self.fleet.leave.remote(self.replica), FLEET_CALL_BOUND_S)
        except Exception as e:  # noqa: BLE001 - the fleet may be going away with the app
            logger.debug("fleet.leave: %s", e)
        await asyncio.to_thread(stop_driver, self.config, started.driver)
        remove(started.pg)
        logger.info("engine replica %d is gone", self.replica)

    async def _drain(self, started: StartedReplica) -> None:
        a = self.config.serve.autoscaling
        drain_s = a.drain_timeout_s if a is not None else DEFAULT_DRAIN_TIMEOUT_S
        try:
            await asyncio.wait_for(self.fleet.set_state.remote(self.replica, DRAINING), FLEET_CALL_BOUND_S)
        except asyncio.TimeoutError:
            logger.warning("engine replica %d: the fleet did not answer; draining without it", self.replica)
        driver = started.driver
        deadline = time.monotonic() + drain_s
        live = await self._live(driver)
        while live and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            live = await self._live(driver)
        if live:
            logger.warning(
                "engine replica %d: %d request(s) still running after drain_timeout_s=%g; they move on",
                self.replica,
                live,
                drain_s,
            )
            await driver.hand_back.remote(f"engine replica {self.replica} is being removed")
        deadline = time.monotonic() + DELIVERY_BOUND_S
        while await driver.num_undelivered.remote() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    @staticmethod
    async def _live(driver: Any) -> int:
        stats = await driver.stats.remote()
        return int(stats.get("num_live_requests", 0))
