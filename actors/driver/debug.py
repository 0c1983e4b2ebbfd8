"""What the driver offers beside the step path: killing a worker (`kvray stress`), calling one worker's
method (benchmarks read step timings and compile events; tests reach a worker's fault seams), the
workers' profiles, and the block pool's books (the stress run's check that a drain leaks nothing).

Plain functions over the engine the driver holds; EngineDriver exposes each as an actor method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actors.driver.engine_core import EngineCore


def kill_worker(engine: EngineCore, rank: int) -> None:
    """Kill one TP worker actor, as a crashed process would: `kvray stress` checks recovery this way."""
    import ray

    ray.kill(_worker_actors(engine)[rank], no_restart=True)


def worker_call(engine: EngineCore, rank: int, method: str, *args: Any) -> Any:
    """Call one worker's method and wait for its answer."""
    import ray

    return ray.get(getattr(_worker_actors(engine)[rank], method).remote(*args))


def start_profile(engine: EngineCore, trace_dir: str, num_steps: int, skip_steps: int) -> None:
    """Every worker traces its next `num_steps` steps after `skip_steps` (see Worker.start_profile)."""
    engine.executor.collective_rpc("start_profile", trace_dir, num_steps, skip_steps)


def stop_profile(engine: EngineCore) -> list[str]:
    """End the workers' traces; the files written (on each worker's node)."""
    return [p for paths in engine.executor.collective_rpc("stop_profile") for p in paths]


def pool_books(engine: EngineCore | None, replica: int, no_live_request: bool) -> dict[str, Any]:
    """The block pool's books: free (uncached) + cached-free + held must equal the usable blocks.

    After a drain nothing may be held: `held` and `ref_count_total` are 0, and the manager's own
    consistency check (`invariant_error`) passes with no live request. The caller keeps the engine
    still meanwhile (the free queue must not change while it is walked).
    """
    if engine is None:
        return {"replica": replica, "error": "engine not started"}
    manager = engine.kv_cache_manager
    idle = not engine.has_unfinished() and no_live_request
    error = None
    if idle:
        try:
            manager.check_invariants([])
        except AssertionError as e:
            error = str(e)
    return {"replica": replica, **manager.pool_accounting(), "idle": idle, "invariant_error": error}


def _worker_actors(engine: EngineCore) -> list[Any]:
    from actors.executor.ray_workers import RayExecutor

    executor = engine.executor
    if not isinstance(executor, RayExecutor):
        raise TypeError(f"the engine runs on {type(executor).__name__}, not on Ray worker actors")
    return executor.workers
