"""Waiting for an engine's placement group to be whole again after a node went away.

Ray reschedules the bundles of a lost node by itself once some node has the resources; until then the
group is RESCHEDULING. A rebuild must not start workers into it before that (their tasks would queue
for as long as no node comes), so the driver waits here, with a timeout, and hands its requests to the
other replicas when the wait runs out (actors/driver.py).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)

POLL_S = 0.25
PROBE_S = 10.0  # a bundle's probe task waits this long for its node at most, before asking again


def placement_whole(pg: Any) -> bool:
    """Every bundle reserved, each on a node that is alive now. The node check covers the moment
    between a node's death and the group's state saying so."""
    import ray

    table = ray.util.placement_group_table(pg)
    if table.get("state") != "CREATED":
        return False
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    nodes = table.get("bundles_to_node_id", {})
    return len(nodes) == len(table.get("bundles", {})) and all(n in alive for n in nodes.values())


def bundles_answer(pg: Any, timeout_s: float) -> bool:
    """A 0-CPU task runs in every bundle within timeout_s. A worker's death can be seen before the GCS
    declares its node dead (its connection breaks at once): until then the group still reads whole,
    and only a task sent there tells that the bundle is gone."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    n = len(pg.bundle_specs)
    task = ray.remote(num_cpus=0, max_retries=0)(_here)
    refs = [task.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
            .remote() for i in range(n)]
    ready, pending = ray.wait(refs, num_returns=n, timeout=timeout_s)
    for ref in pending:
        try:
            ray.cancel(ref, force=True)
        except Exception as e:  # noqa: BLE001 - already gone with its node
            logger.debug("cancel probe: %s", e)
    return not pending


def _here() -> bool:
    return True


def wait_for_placement(pg: Any, timeout_s: float | None, stopped: Callable[[], bool]) -> bool:
    """True once the group is whole and every bundle answers; False when timeout_s (None: no limit)
    runs out or `stopped()`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not stopped():
        left = None if deadline is None else deadline - time.monotonic()
        try:
            if placement_whole(pg) and bundles_answer(pg, PROBE_S if left is None else max(min(left, PROBE_S), 0.1)):
                return True
        except Exception as e:  # noqa: BLE001 - the GCS is briefly unreachable: ask again
            logger.debug("placement group state: %s", e)
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return False
