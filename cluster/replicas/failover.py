"""What the client does when an engine replica goes away, so that no request is lost or answered twice.

Each replica is `up` (takes requests), `rebuilding` (its driver waits for resources after a node went
away: it refuses requests and gave its own back), `starting` (a new driver actor replaces one that
died) or `down` (for good: past its restart budgets). A request whose replica goes away, as its driver
died, gave it back or failed for good, waits in `pending` and goes to the least-loaded replica that is
up, as soon as there is one.

The client keeps, per unfinished request, the tokens it has streamed so far (actors/driver/live_requests.py,
the same books the driver keeps across a worker restart): a greedy request goes on from them on its new
engine, a sampled one starts over and the tokens already streamed are checked and dropped. So the
stream a caller sees is unbroken, and every request ends exactly once.

`ReplicaFailover` is an object EngineGroup holds: it keeps the books (which replica owns which request,
each replica's state) and reaches the driver actors only through the small `DriverControl` interface
EngineGroup hands it, so the actors' lifetime stays with EngineGroup.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from actors.driver.live_requests import LiveRequests
from actors.messages import DOWN, REBUILDING, PollResult, RequestSpec, error_output
from kvcore.messages import EngineCoreOutput

logger = logging.getLogger(__name__)

UP, REBUILDING_STATE, STARTING, DOWN_STATE = "up", "rebuilding", "starting", "down"
DRIVER_CALL_GRACE_S = 30.0  # beyond parallel.step_timeout_s, for a call into a driver actor


class ReplicaLost(Exception):
    """A driver actor died or stopped answering."""


@dataclass(frozen=True)
class FailoverLimits:
    """The config values failover reads (from `parallel`)."""

    max_driver_restarts: int
    placement_timeout_s: float
    driver_call_timeout_s: float  # parallel.step_timeout_s + DRIVER_CALL_GRACE_S


class DriverControl(Protocol):
    """What failover needs of the driver actors; EngineGroup, which owns them, provides it."""

    def driver(self, replica: int) -> Any:
        """Replica's current driver actor handle."""

    def retire_driver(self, replica: int) -> None:
        """Kill replica's driver for good (a hung one must not come back) and forget its pending polls."""

    def start_driver(self, replica: int, generation: int) -> Any:
        """Start a new driver actor for replica (its `generation`-th restart); returns its `start` ref."""

    def driver_started(self, replica: int, info: dict[str, Any]) -> None:
        """A new driver for replica started; `info` is what its `start` returned."""


def call_driver(ref: Any, replica: int, timeout_s: float) -> Any:
    """The answer of a call into a driver actor, or ReplicaLost."""
    # The driver answers these calls between steps (its step loop never holds their lock long): a
    # driver silent for this long is hung, and the caller must hear it rather than wait forever.
    try:
        return ray.get(ref, timeout=timeout_s)
    except RayActorError as e:
        raise ReplicaLost(f"the driver actor of engine replica {replica} died: {str(e).splitlines()[0]}") from None
    except GetTimeoutError:
        raise ReplicaLost(
            f"the driver actor of engine replica {replica} did not answer within {timeout_s:g}s"
        ) from None


class ReplicaFailover:
    """Which replica owns which request, each replica's state, and what moves where when one goes away."""

    def __init__(self, n: int, limits: FailoverLimits, drivers: DriverControl) -> None:
        self.limits = limits
        self.drivers = drivers
        self.live = LiveRequests()  # every unfinished request: its spec and the tokens streamed so far
        self.pending: list[str] = []
        self.outstanding = [0] * n
        self.owner: dict[str, int] = {}
        self.fatal: str | None = None
        self.state = [UP] * n
        self.why: list[str | None] = [None] * n
        self.driver_restarts = [0] * n
        self.moved_away = [0] * n  # requests this replica lost to a failure and another one took
        self._starting: dict[Any, int] = {}
        self._stranded_since: float | None = None
        self._refused_late: dict[str, str] = {}  # refused by the replica a request was moved to

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, specs: list[RequestSpec]) -> dict[str, str]:
        """Take requests into the books and send them; returns {request_id: error} for refused ones."""
        errors: dict[str, str] = {}
        rids = []
        now = time.monotonic()
        for spec in specs:
            if self.fatal is not None:
                errors[spec.request_id] = f"every engine replica {DOWN}: {self.fatal}"
            elif spec.request_id in self.live:
                errors[spec.request_id] = (
                    f"request {spec.request_id!r}: request_id is already in use by an unfinished request"
                )
            else:
                self.live.add(spec, now)
                rids.append(spec.request_id)
        errors.update(self._dispatch(rids))
        self.check_fatal()
        return errors

    def abort(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """Take requests out of the books; returns, per replica, those its driver must abort."""
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            if rid in self.owner:
                by_replica.setdefault(self.owner[rid], []).append(rid)
            if rid in self.pending:
                self.pending.remove(rid)
            # Out of the books now: were its replica lost before the abort lands, it must not move.
            self.live.retire(rid, time.monotonic())
        return by_replica

    def take_refused(self) -> list[EngineCoreOutput]:
        """Error outputs of moved requests their new replica refused for their own sake."""
        items = [error_output(rid, err) for rid, err in self._refused_late.items()]
        self._refused_late.clear()
        return items

    def polled_replicas(self) -> list[int]:
        """Replicas whose driver answers polls (up, or rebuilding and giving requests back)."""
        return [r for r, s in enumerate(self.state) if s in (UP, REBUILDING_STATE)]

    def starting_refs(self) -> list[Any]:
        """The `start` refs of new drivers not started yet."""
        return list(self._starting)

    def accept(self, r: int, res: PollResult) -> list[EngineCoreOutput]:
        """Replica r's poll result into the books; returns the outputs the caller gets."""
        items: list[EngineCoreOutput] = []
        # Outputs of requests moved away from r since are stale; unknown ids (aborted) pass through.
        kept = self.live.drop_replayed(
            [o for o in res.outputs if self.owner.get(o.request_id) == r or o.request_id not in self.live],
            lambda ids: self.drivers.driver(r).abort.remote(ids),
        )
        for o in kept:
            if res.fatal is not None and o.finish_reason == "error" and o.error == res.fatal:
                continue  # in-flight casualties of the replica's failure: they move, below
            self.live.record(o, time.monotonic())
            if o.finished:
                self._unown(o.request_id)
            items.append(o)
        if res.returned:
            self.pending += self._orphans(r, res.returned)
        if res.fatal is not None:
            self._set_state(r, DOWN_STATE, res.fatal)
            self.pending += self._orphans(r)
        elif not res.available:
            self._set_state(r, REBUILDING_STATE, self.why[r] or "waiting for resources to rebuild on")
        elif self.state[r] == REBUILDING_STATE:
            self._set_state(r, UP, None)
        return items

    def replica_lost(self, r: int, why: str) -> None:
        """Replica r's driver died or hung: replace it, and its requests wait to go elsewhere."""
        self.pending += self._lose(r, why)

    def call(self, ref: Any, replica: int) -> Any:
        """The answer of a call into replica's driver, bounded; ReplicaLost when it died or hung."""
        return call_driver(ref, replica, self.limits.driver_call_timeout_s)

    def replica_stats(self, r: int) -> dict[str, Any]:
        return {
            "driver_restarts": self.driver_restarts[r],
            "requests_moved_away": self.moved_away[r],
            "state": self.state[r],
        }

    # ---- sending ----------------------------------------------------------------------------
    def _dispatch(self, rids: list[str]) -> dict[str, str]:
        """Send requests to the least-loaded replicas that are up; the rest wait in `pending`.
        Returns {request_id: error} for requests refused for their own sake."""
        errors: dict[str, str] = {}
        while rids:
            up = [r for r, s in enumerate(self.state) if s == UP]
            if not up:
                self.pending.extend(rids)
                break
            per_replica: dict[int, list[RequestSpec]] = {}
            for rid in rids:
                r = min(up, key=lambda i: self.outstanding[i])
                self.outstanding[r] += 1
                self.owner[rid] = r
                per_replica.setdefault(r, []).append(self.live.resume_spec(rid))
            refs = {r: self.drivers.driver(r).add_requests.remote(batch) for r, batch in per_replica.items()}
            rids = []
            for r, ref in refs.items():
                try:
                    answers = self.call(ref, r)
                except ReplicaLost as e:
                    rids += self._lose(r, str(e))
                    continue
                for spec, err in zip(per_replica[r], answers, strict=True):
                    if err is None:
                        continue
                    state = _replica_state(err, r)
                    if state is not None:  # the replica's state, not the request's fault: elsewhere
                        self._set_state(r, state, err)
                        rids.append(self._unown(spec.request_id))
                    else:
                        self._unown(spec.request_id)
                        self.live.retire(spec.request_id, time.monotonic())
                        errors[spec.request_id] = err
        return errors

    def dispatch_pending(self) -> None:
        """Send waiting requests, once a replica is up."""
        if self.pending and any(s == UP for s in self.state):
            rids, self.pending = self.pending, []
            for rid, err in self._dispatch(rids).items():
                # Refused on its second engine for its own sake (the first accepted it): it ends here.
                self._refused_late[rid] = err

    def _unown(self, rid: str) -> str:
        r = self.owner.pop(rid, None)
        if r is not None:
            self.outstanding[r] -= 1
        return rid

    # ---- losing a replica -------------------------------------------------------------------
    def _orphans(self, r: int, rids: list[str] | None = None) -> list[str]:
        """Take requests (by default every one) away from replica r; they go elsewhere."""
        rids = [rid for rid, owner in self.owner.items() if owner == r] if rids is None else rids
        # An aborted request (out of the books already) only leaves the replica's count.
        rids = [rid for rid in map(self._unown, rids) if rid in self.live]
        self.moved_away[r] += len(rids)
        return rids

    def _lose(self, r: int, why: str) -> list[str]:
        """Replica r's driver is gone: start a new one within parallel.max_driver_restarts. Returns its
        requests, to be sent elsewhere."""
        self.drivers.retire_driver(r)
        budget = self.limits.max_driver_restarts
        if self.driver_restarts[r] < budget:
            self.driver_restarts[r] += 1
            logger.warning(
                "%s; starting a new driver (restart %d of parallel.max_driver_restarts=%d)",
                why,
                self.driver_restarts[r],
                budget,
            )
            self._starting[self.drivers.start_driver(r, self.driver_restarts[r])] = r
            self._set_state(r, STARTING, why)
        else:
            self._set_state(
                r,
                DOWN_STATE,
                why if budget == 0 else f"{why} (after {budget} of parallel.max_driver_restarts={budget} restarts)",
            )
        return self._orphans(r)

    def _set_state(self, r: int, state: str, why: str | None) -> None:
        if self.state[r] != state:
            if state != UP:
                logger.warning("engine replica %d is %s: %s", r, state, why)
            else:
                logger.warning("engine replica %d takes requests again", r)
        self.state[r], self.why[r] = state, why

    def check_starting(self) -> None:
        """Replicas whose new driver started take requests again."""
        if not self._starting:
            return
        ready, _ = ray.wait(list(self._starting), num_returns=len(self._starting), timeout=0)
        for ref in ready:
            r = self._starting.pop(ref)
            try:
                self.drivers.driver_started(r, ray.get(ref))
                self._set_state(r, UP, None)
            except Exception as e:  # noqa: BLE001 - the new driver could not build its engine
                self._set_state(r, DOWN_STATE, f"a new driver for engine replica {r} failed to start: {e}")

    def check_fatal(self) -> None:
        """The group is down once no replica is up or coming back; or when requests have waited for a
        rebuilding one longer than parallel.placement_timeout_s (beyond the driver's own wait)."""
        if self.fatal is not None:
            return
        if all(s == DOWN_STATE for s in self.state):
            self.fatal = next(w for w in reversed(self.why) if w is not None)
            return
        stranded = bool(self.pending) and not any(s in (UP, STARTING) for s in self.state)
        if not stranded:
            self._stranded_since = None
            return
        now = time.monotonic()
        self._stranded_since = self._stranded_since or now
        limit = self.limits.placement_timeout_s
        if now - self._stranded_since > limit:
            self.fatal = (
                f"no engine replica could take {len(self.pending)} request(s) within "
                f"parallel.placement_timeout_s={limit:g}s: "
                + "; ".join(f"replica {r} {s}: {w}" for r, (s, w) in enumerate(zip(self.state, self.why, strict=True)))
            )


def _replica_state(err: str, r: int) -> str | None:
    """DOWN_STATE / REBUILDING_STATE when a driver's refusal is about the replica, else None."""
    for marker, state in ((DOWN, DOWN_STATE), (REBUILDING, REBUILDING_STATE)):
        if err.startswith(f"engine replica {r} {marker}:"):
            return state
    return None
