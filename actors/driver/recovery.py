"""The driver's recovery from a failed step: a StepError with every worker alive goes to the poison hunt
(actors/driver/poison.py); a worker death rebuilds the TP group within parallel.max_worker_restarts,
after waiting for the placement group to be whole again (past parallel.placement_timeout_s the replica
hands its requests back to the client); past the budget, every live request fails.

The driver holds one Recovery and calls `recover` from its step loop, under its engine lock. What
recovery needs of the driver, which owns the engine, it gets as EngineHooks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from actors.config.engine import EngineConfig
from actors.driver.mailbox import Mailbox
from actors.driver.placement_wait import wait_for_placement
from actors.driver.poison import EngineSteps, PoisonIsolation
from actors.errors import StepError, WorkerFailure

logger = logging.getLogger("actors.driver.actor")  # the driver's log: recovery is its story


@dataclass(frozen=True)
class EngineHooks:
    """What recovery asks of the driver, which owns the engine."""

    engine: Callable[[], EngineSteps]  # the engine now (a rebuild replaces it)
    shut_down: Callable[[], None]  # stop the engine's workers (they may be dead already)
    build: Callable[[], None]  # a new engine on new workers
    requeue: Callable[[str], None]  # one live request onto the engine, by recompute
    record_restart: Callable[[], None]  # count a rebuild in the metrics


class Recovery:
    def __init__(
        self,
        config: EngineConfig,
        replica: int,
        placement_group: Any,
        mailbox: Mailbox,
        isolation: PoisonIsolation,
        hooks: EngineHooks,
    ) -> None:
        self.config = config
        self.replica = replica
        self.pg = placement_group
        self._mailbox = mailbox
        self._isolation = isolation
        self._hooks = hooks
        self.restarts = 0  # worker restarts spent of parallel.max_worker_restarts

    def recover(self, error: Exception) -> bool:
        """A step raised. With every worker alive (a StepError): find the poison request. A worker died
        or hung: rebuild the TP group and re-queue in-flight requests, within the restart budget, which
        only worker deaths spend (also a death during a rebuild). -> False once the replica is down for
        good (every live request then has its error output)."""
        if isinstance(error, StepError):
            try:
                self._isolation.isolate(self._hooks.engine(), error)
                return True
            except Exception as e:  # noqa: BLE001 - the reset failed: a worker is gone after all
                logger.warning("engine replica %d: resetting the workers failed: %s", self.replica, e)
                error = e
        budget = self.config.parallel.max_worker_restarts
        # Only a worker failure is cured by new workers; an engine bug (a broken invariant) is fatal.
        while self.restarts < budget and isinstance(error, WorkerFailure):
            self.restarts += 1
            logger.warning(
                "engine replica %d: %s; rebuilding the TP group (restart %d of %d)",
                self.replica,
                error,
                self.restarts,
                budget,
            )
            try:
                self._rebuild()
                return True
            except Exception as e:  # noqa: BLE001 - a death during the rebuild spends the next restart
                error = e
        why = (
            f"{type(error).__name__}: {error}"
            if budget == 0
            else f"{type(error).__name__}: {error} (after {self.restarts} of "
            f"parallel.max_worker_restarts={budget} restarts)"
        )
        self._mailbox.fail_all(f"engine replica {self.replica} failed: {why}")
        return False

    def _rebuild(self) -> None:
        try:
            self._hooks.shut_down()
        except Exception as e:  # noqa: BLE001 - the old workers may be gone already
            logger.debug("engine shutdown: %s", e)
        self._await_resources()
        self._hooks.build()
        if self._mailbox.resume():
            logger.warning("engine replica %d: rebuilt; it takes requests again", self.replica)
        self._isolation.reset()  # every live request is re-queued on the new group
        for rid in self._mailbox.waiting_in_engine():
            self._hooks.requeue(rid)
        self._hooks.record_restart()

    def _await_resources(self) -> None:
        """Wait for the placement group to be whole (Ray reschedules a lost node's bundles by itself).
        Past parallel.placement_timeout_s, every live request goes back to the client, which sends it
        to the other replicas; this replica refuses requests and goes on waiting (a node may join)."""
        if self.pg is None:  # no reservation to wait for (a driver built without one, as in unit tests)
            return
        timeout_s = self.config.parallel.placement_timeout_s
        if wait_for_placement(self.pg, timeout_s, self._stopping):
            return
        if not self._mailbox.stopping:
            why = (
                f"its placement group was not whole again within parallel.placement_timeout_s={timeout_s:g}s "
                "(a node it used is gone)"
            )
            logger.warning(
                "engine replica %d: %s; its requests go to the other replicas until it is rebuilt", self.replica, why
            )
            self._mailbox.hand_back(why)
        if not wait_for_placement(self.pg, None, self._stopping):
            raise RuntimeError("the driver was shut down while it waited for resources")

    def _stopping(self) -> bool:
        return self._mailbox.stopping
