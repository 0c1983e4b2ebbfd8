"""Waiting for an engine's placement group to be whole again after a node went away.

Ray reschedules the bundles of a lost node by itself once some node has the resources; until then the
group is RESCHEDULING. A rebuild must not start workers into it before that (their tasks would queue
for as long as no node comes), so the driver waits here, with a timeout, and hands its requests to the
other replicas when the wait runs out (actors/driver/actor.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)

POLL_S = 0.25
PROBE_S = 60.0  # a bundle's probe task waits this long at most while its node still reads alive


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


def bundles_answer(pg: Any) -> bool:
    """A 0-CPU task runs in every bundle. A worker's death can be seen before the GCS declares its node
    dead (its connection breaks at once): until then the group still reads whole, and only a task sent
    there tells that a bundle is gone. Waits as long as the group still reads whole (a task on a live
    but loaded node may take a while to get a worker process), up to PROBE_S."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    n = len(pg.bundle_specs)
    task = ray.remote(num_cpus=0, max_retries=0)(_here)
    refs = [
        task.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote()
        for i in range(n)
    ]
    deadline = time.monotonic() + PROBE_S
    pending = refs
    while pending and time.monotonic() < deadline:
        _, pending = ray.wait(refs, num_returns=n, timeout=POLL_S * 2)
        if pending and not placement_whole(pg):
            break
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
        try:
            if placement_whole(pg) and bundles_answer(pg):
                return True
        except Exception as e:  # noqa: BLE001 - the GCS is briefly unreachable: ask again
            logger.debug("placement group state: %s", e)
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return False
