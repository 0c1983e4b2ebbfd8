"""Fault injection and introspection on a driver actor: for tests, the stress run and profiling.

None of it is on the step path. It is mixed into EngineDriver so that each stays an actor method
(`driver.kill_worker.remote(rank)`).
"""

from __future__ import annotations

import threading
from typing import Any

from actors.driver.live_requests import LiveRequests


class DriverDebug:
    engine: Any
    replica: int
    _engine_lock: threading.Lock
    _cv: threading.Condition
    _live: LiveRequests

    def kill_worker(self, rank: int) -> None:
        """Kill one TP worker actor (as a crashed process would)."""
        import ray

        ray.kill(self.engine.executor.workers[rank], no_restart=True)

    def worker_call(self, rank: int, method: str, *args: Any) -> Any:
        """Call one worker's method (fault injection, introspection); not part of the step path."""
        import ray

        return ray.get(getattr(self.engine.executor.workers[rank], method).remote(*args))

    def start_profile(self, trace_dir: str, num_steps: int = 5, skip_steps: int = 0) -> None:
        """Every worker traces its next `num_steps` steps after `skip_steps` (see Worker.start_profile)."""
        self.engine.executor.collective_rpc("start_profile", trace_dir, num_steps, skip_steps)

    def stop_profile(self) -> list[str]:
        """End the workers' traces; the files written (on each worker's node)."""
        return [p for paths in self.engine.executor.collective_rpc("stop_profile") for p in paths]

    def kv_pool_accounting(self) -> dict[str, Any]:
        """The block pool's books: free (uncached) + cached-free + held must equal the usable blocks.

        After a drain nothing may be held: `held` and `ref_count_total` are 0, and the manager's own
        consistency check (`invariant_error`) passes with no live request.
        """
        # The free queue must not change while it is walked; a busy loop is "not idle yet", not an error.
        if not self._engine_lock.acquire(timeout=5.0):
            return {"replica": self.replica, "idle": False, "busy": True}
        try:
            return self._pool_books()
        finally:
            self._engine_lock.release()

    def _pool_books(self) -> dict[str, Any]:
        with self._cv:
            if self.engine is None:
                return {"replica": self.replica, "error": "engine not started"}
            manager = self.engine.kv_cache_manager
            idle = not self.engine.has_unfinished() and not self._live
            error = None
            if idle:
                try:
                    manager.check_invariants([])
                except AssertionError as e:
                    error = str(e)
            return {"replica": self.replica, **manager.pool_accounting(), "idle": idle, "invariant_error": error}
