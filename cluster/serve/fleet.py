"""The engine fleet: the live set of engine replicas that every ingress replica routes over.

A Serve deployment of one replica (cluster/serve/app.py). The engine replicas (cluster/serve/engine_replica.py,
a Serve deployment that Ray Serve scales) register here once their driver has started, say here when they
start draining, and leave when they go; the ingress replicas (cluster/serve/ingress.py) long-poll `view`
and keep their engine clients in step. It holds no engine itself: it outlives no replica and no ingress
depends on it for a request's path (an ingress talks to the drivers directly, through its own outbox).

States: UP (takes requests), DRAINING (being removed: takes none; its waiting requests move, its running
streams finish or move after serve.autoscaling.drain_timeout_s). A replica that left is absent.

Should Serve restart the fleet's replica, its live set starts empty under a new tag: each engine replica
registers again at its next health check (cluster/serve/engine_replica.py), and an ingress takes a
replica's absence for its leaving only from the tag it last saw the replica under (a replica that really
went meanwhile shows as its driver's death on the poll path). Ids stay unique: the app's tag, which
names its drivers, outlives a restart (it is the fleet's constructor argument), so a restarted fleet
starts its next id past every live driver of the app (their actor names carry their ids), and a
registration moves it past its own.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

from cluster.replicas.driver_names import replica_of
from cluster.serve.loopback import bind_internal_grpc_to_loopback

UP = "up"
DRAINING = "draining"


def highest_driver_id(namespace: str, tag: str) -> int:
    """The highest replica id among the live engine drivers of `tag` in `namespace` (-1: none)."""
    import ray

    ids = [
        r
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and (r := replica_of(a["name"], tag)) is not None
    ]
    return max(ids, default=-1)


@dataclass
class FleetMember:
    replica: int  # the fleet's id for it, never reused
    driver: Any  # its EngineDriver actor handle
    info: dict[str, Any] = field(default_factory=dict)  # what the driver's start() returned
    state: str = UP


@dataclass
class FleetView:
    version: int  # grows with every change
    members: list[FleetMember]
    # Ids handed out so far: an id below it that is not a member never started, or left.
    num_reserved: int = 0
    tag: str = ""  # the fleet's incarnation


class EngineFleet:
    """The registry (a Serve deployment's class). Async methods: they run on the replica's event loop,
    where the change future lives."""

    def __init__(self, loopback_only: bool = False, namespace: str | None = None, app_tag: str | None = None) -> None:
        """namespace, app_tag: where the app's drivers live and the tag that names them (cluster/serve/app.py
        picks it once per app); a fleet that Serve restarted finds their ids there."""
        if loopback_only:
            bind_internal_grpc_to_loopback()
        self.tag = uuid.uuid4().hex[:8]  # this incarnation: an ingress counts versions afresh under a new one
        self.app_tag = app_tag or self.tag  # names the app's drivers (`ray list actors`)
        self._members: dict[int, FleetMember] = {}
        found = highest_driver_id(namespace, app_tag) if namespace is not None and app_tag is not None else -1
        self._next_id = found + 1
        self._version = 0
        self._changed: asyncio.Future[None] | None = None

    async def reserve(self) -> tuple[int, str]:
        """-> (a new replica id, the tag for its driver's name)."""
        r = self._next_id
        self._next_id += 1
        return r, self.app_tag

    async def register(self, member: FleetMember) -> None:
        self._members[member.replica] = member
        self._next_id = max(self._next_id, member.replica + 1)
        self._bump()

    async def set_state(self, replica: int, state: str) -> None:
        member = self._members.get(replica)
        if member is not None and member.state != state:
            member.state = state
            self._bump()

    async def leave(self, replica: int) -> None:
        if self._members.pop(replica, None) is not None:
            self._bump()

    async def view(self, after_version: int = -1, timeout_s: float = 0.0) -> FleetView:
        """The live set, once its version is past `after_version` (or timeout_s has passed)."""
        if self._version <= after_version and timeout_s > 0:
            if self._changed is None or self._changed.done():
                self._changed = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._changed), timeout_s)
            except asyncio.TimeoutError:
                pass
        members = [self._members[r] for r in sorted(self._members)]
        return FleetView(self._version, members, self._next_id, self.tag)

    def _bump(self) -> None:
        self._version += 1
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
