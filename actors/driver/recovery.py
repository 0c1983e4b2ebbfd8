"""The driver's recovery from a failed step (mixed into EngineDriver, actors/driver/engine_driver.py, beside the poison
hunt of actors/driver/poison.py): a StepError with every worker alive goes to the hunt; a worker death
rebuilds the TP group within parallel.max_worker_restarts, after waiting for the placement group to be
whole again (past parallel.placement_timeout_s the replica hands its requests back to the client);
past the budget, every live request fails. Runs on the step loop, under the engine lock.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

from actors.driver.live_requests import LiveRequests
from actors.driver.placement_wait import wait_for_placement
from actors.driver.poison import PoisonHunt
from actors.errors import StepError, WorkerFailure
from actors.messages import RequestSpec

if TYPE_CHECKING:
    from actors.config.engine import EngineConfig
    from actors.driver.metrics import EngineMetrics

logger = logging.getLogger("actors.driver.engine_driver")  # the driver's log, as before the split


class DriverRecovery:
    config: EngineConfig
    engine: Any
    pg: Any
    replica: int
    _cv: threading.Condition
    _inbox: list[RequestSpec]
    _live: LiveRequests
    _hunt: PoisonHunt
    _metrics: EngineMetrics | None
    _restarts: int
    _returned: list[str]
    _stop: bool
    _unavailable: str | None
    # EngineDriver and PoisonIsolation provide these.
    _isolate: Callable[[StepError], None]
    _build_engine: Callable[[], None]
    _readd: Callable[[str], None]
    _fail_all: Callable[[str], None]

    def _recover(self, error: Exception) -> bool:
        """A step raised with every worker alive: find the poison request (actors/driver/poison.py). A worker
        died or hung: rebuild the TP group and re-queue in-flight requests, within the restart budget,
        which only worker deaths spend (also a death during a rebuild)."""
        if isinstance(error, StepError):
            try:
                self._isolate(error)
                return True
            except Exception as e:  # noqa: BLE001 - the reset failed: a worker is gone after all
                logger.warning("engine replica %d: resetting the workers failed: %s", self.replica, e)
                error = e
        budget = self.config.parallel.max_worker_restarts
        # Only a worker failure is cured by new workers; an engine bug (a broken invariant) is fatal.
        while self._restarts < budget and isinstance(error, WorkerFailure):
            self._restarts += 1
            logger.warning(
                "engine replica %d: %s; rebuilding the TP group (restart %d of %d)",
                self.replica,
                error,
                self._restarts,
                budget,
            )
            try:
                self._rebuild()
                return True
            except Exception as e:  # noqa: BLE001 - a death during the rebuild spends the next restart
                error = e
        self._fail_all(
            f"{type(error).__name__}: {error}"
            if budget == 0
            else f"{type(error).__name__}: {error} (after {self._restarts} of "
            f"parallel.max_worker_restarts={budget} restarts)"
        )
        return False

    def _rebuild(self) -> None:
        try:
            self.engine.shutdown()
        except Exception as e:  # noqa: BLE001 - the old workers may be gone already
            logger.debug("engine shutdown: %s", e)
        self._await_resources()
        self._build_engine()
        with self._cv:
            if self._unavailable is not None:
                logger.warning("engine replica %d: rebuilt; it takes requests again", self.replica)
            self._unavailable = None
        self._hunt = PoisonHunt()  # every live request is re-queued on the new group
        with self._cv:
            pending = {s.request_id for s in self._inbox}
            for rid in self._live.ids():
                if rid not in pending:
                    self._readd(rid)
        assert self._metrics is not None  # restarts happen on the loop that start() began
        self._metrics.record_restart()

    def _await_resources(self) -> None:
        """Wait for the placement group to be whole (Ray reschedules a lost node's bundles by itself).
        Past parallel.placement_timeout_s, every live request goes back to the client, which sends it
        to the other replicas; this replica refuses requests and goes on waiting (a node may join)."""
        if self.pg is None:  # no reservation to wait for (a driver built without one, as in unit tests)
            return
        timeout_s = self.config.parallel.placement_timeout_s
        if wait_for_placement(self.pg, timeout_s, lambda: self._stop):
            return
        if not self._stop:
            why = (
                f"its placement group was not whole again within parallel.placement_timeout_s={timeout_s:g}s "
                "(a node it used is gone)"
            )
            logger.warning(
                "engine replica %d: %s; its requests go to the other replicas until it is rebuilt", self.replica, why
            )
            with self._cv:
                self._unavailable = why
                self._returned.extend(self._live.clear())
                self._inbox.clear()
                self._cv.notify_all()
        if not wait_for_placement(self.pg, None, lambda: self._stop):
            raise RuntimeError("the driver was shut down while it waited for resources")
