"""The engine drivers' Ray actor names: `kvray-driver-<tag>-r<replica>[-<generation>]`.

The tag names the engine group or Serve app, the replica its id, the generation a driver that replaced
a dead one. `ray list actors` shows them; a restarted fleet reads the ids back (cluster/serve/fleet.py).
Kept apart from engine_group.py, which imports the engine: the fleet's process never needs it.
"""

from __future__ import annotations

import re

DRIVER_NAME_PREFIX = "kvray-driver-"


def driver_name(tag: str, replica: int, generation: int = 0) -> str:
    return f"{DRIVER_NAME_PREFIX}{tag}-r{replica}" + (f"-{generation}" if generation else "")


def replica_of(name: str, tag: str) -> int | None:
    """The replica id in the name of a driver of `tag`; None for any other name."""
    m = re.fullmatch(re.escape(DRIVER_NAME_PREFIX + tag) + r"-r(\d+)(?:-\d+)?", name)
    return int(m.group(1)) if m is not None else None
