"""Fault injection for `kvray stress --kill-nodes`: a whole Ray node goes away, as a lost host does.

A task pinned to the node SIGKILLs the node's raylet (its parent process chain leads there); every
worker on the node exits with it, and the GCS declares the node dead once its health checks fail. The
client's own node (the head under `ray job submit`, where the driver actors live) is never a target.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

log = logging.getLogger("kvray.stress")


def _kill_own_raylet() -> str:
    import psutil  # ray depends on it

    proc = psutil.Process(os.getpid()).parent()
    while proc is not None and proc.name() != "raylet":
        proc = proc.parent()
    if proc is None:
        return "no raylet among this worker's parents"
    os.kill(proc.pid, signal.SIGKILL)
    return f"killed raylet {proc.pid}"


def engine_nodes(pgs: list[Any]) -> dict[str, list[int]]:
    """Node id -> the replicas with a bundle on it (from each replica's placement group)."""
    out: dict[str, list[int]] = {}
    for r, pg in enumerate(pgs):
        for node in set(ray.util.placement_group_table(pg).get("bundles_to_node_id", {}).values()):
            out.setdefault(node, []).append(r)
    return out


def kill_node(node_id: str) -> None:
    """SIGKILL the raylet of that node (never the caller's own node)."""
    if node_id == ray.get_runtime_context().get_node_id():
        raise ValueError(f"node {node_id}: the client's own node is never killed")
    task = ray.remote(num_cpus=0, max_retries=0)(_kill_own_raylet).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    )
    try:
        log.info("kill node %s: %s", node_id[:12], ray.get(task.remote(), timeout=30))
    except ray.exceptions.RayError as e:  # the task dies with its raylet, as it should
        log.debug("kill node %s: %s", node_id[:12], str(e).splitlines()[0])
