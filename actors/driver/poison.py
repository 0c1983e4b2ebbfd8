"""Poison isolation: which request makes a step fail, found by running the step's requests in halves.

A step can fail with every worker alive (StepError): a request whose input the worker cannot handle
raises there on every rank. Rebuilding the TP group does not cure that, and re-queueing every request
would fail the same way after each rebuild. So the driver resets the workers' request state (cheap:
no weights are reloaded), and this module decides what runs next:

- the requests of the failed step are the suspects; one half of them (the probe) runs, the rest of the
  live requests are held back in the driver;
- the probe passes once each of its requests has produced a token or finished; then the next group
  of suspects runs, and when none is left every held request is released;
- a failing group of two or more is split again; a request that fails a step alone twice is the cause:
  it fails with an error output and is never re-queued (the first time it is given one more try, so a
  transient error does not condemn it).

Every request recovered this way runs again by recompute (see LiveRequests.restart). Not thread-safe:
the driver calls it from its step loop only.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from actors.driver.mailbox import Mailbox
from actors.errors import StepError
from kvcore.messages import EngineCoreOutput

logger = logging.getLogger(__name__)

MAX_LONE_FAILURES = 2  # a request that fails a step alone this many times is the cause


class EngineSteps(Protocol):
    """What the isolation asks of the engine (actors/driver/engine_core.py)."""

    def running_request_ids(self) -> list[str]: ...

    def reset_requests(self) -> None: ...


@dataclass
class Verdict:
    """What the driver does after a failed step: fail `culprits` with `error`, re-queue `run` now,
    keep `held` out until `release` names them."""

    culprits: list[str] = field(default_factory=list)
    run: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)


class PoisonHunt:
    def __init__(self) -> None:
        self._probe: set[str] = set()  # the group running now
        self._passed: set[str] = set()  # probe members that produced a token since they were re-queued
        self._groups: deque[list[str]] = deque()  # suspect groups still to run alone, in order
        self._held: list[str] = []  # live requests kept out while the hunt runs
        self._lone_failures: Counter[str] = Counter()

    @property
    def active(self) -> bool:
        return bool(self._probe or self._groups or self._held)

    def is_held(self, rid: str) -> bool:
        return rid in self._held

    def step_failed(self, in_step: Iterable[str], live: Iterable[str]) -> Verdict:
        """A step failed with every worker alive. `in_step`: the live requests it ran (the engine's
        running ones); `live`: every request the driver still answers for."""
        in_step = list(dict.fromkeys(in_step))
        suspects = [r for r in in_step if r in self._probe] or in_step
        verdict = Verdict()
        if len(suspects) == 1:
            rid = suspects[0]
            self._lone_failures[rid] += 1
            if self._lone_failures[rid] >= MAX_LONE_FAILURES:
                verdict.culprits.append(rid)
                self._lone_failures.pop(rid)
            else:
                self._groups.appendleft([rid])
        elif suspects:
            half = len(suspects) // 2
            self._groups.appendleft(suspects[half:])
            self._groups.appendleft(suspects[:half])
        gone = set(verdict.culprits)
        self._held = [r for r in dict.fromkeys([*self._held, *live]) if r not in gone]
        self._probe, self._passed = set(), set()
        verdict.run = self._next_group()
        verdict.held = list(self._held)
        return verdict

    def progressed(self, rid: str, finished: bool) -> list[str]:
        """A probe request produced a token (or finished); -> the requests to re-queue now, if the
        probe has passed (the next group, or every held request when no suspect group is left)."""
        if rid not in self._probe:
            return []
        self._passed.add(rid)
        if finished:
            self._lone_failures.pop(rid, None)
        return self._advance()

    def forget(self, rid: str) -> list[str]:
        """The request ended outside the hunt (an abort, an error): it takes no part in it any more.
        -> the requests to re-queue now (its group may have passed without it)."""
        self._lone_failures.pop(rid, None)
        if rid in self._held:
            self._held.remove(rid)
        self._groups = deque(g for g in ([r for r in g if r != rid] for g in self._groups) if g)
        if rid not in self._probe:
            return []
        self._probe.discard(rid)
        self._passed.discard(rid)
        return self._advance()

    def _advance(self) -> list[str]:
        if self._passed < self._probe:
            return []
        return self._next_group()

    def _next_group(self) -> list[str]:
        while self._groups:
            group = [r for r in self._groups.popleft() if r in self._held]
            if group:
                self._held = [r for r in self._held if r not in group]
                self._probe, self._passed = set(group), set()
                return group
        released, self._held = self._held, []
        self._probe, self._passed = set(), set()
        return released


class PoisonIsolation:
    """The driver's side of the hunt: what a StepError does to the engine and to the books on live
    requests. The driver holds one and calls it from its step loop, under its engine lock."""

    def __init__(self, replica: int, mailbox: Mailbox, requeue: Callable[[str], None]) -> None:
        """`requeue(rid)` hands a live request to the engine again by recompute (an error there ends the
        request, see Mailbox.requeue)."""
        self.replica = replica
        self._mailbox = mailbox
        self._requeue = requeue
        self._hunt = PoisonHunt()

    def reset(self) -> None:
        """A new TP group: every live request is re-queued on it, so no hunt goes on."""
        self._hunt = PoisonHunt()

    def isolate(self, engine: EngineSteps, error: StepError) -> None:
        """Reset the workers' request state (a WorkerFailure from that is a real failure: it propagates),
        fail the culprit if the hunt has found it, and re-queue what runs next by recompute."""
        in_step = engine.running_request_ids()
        engine.reset_requests()
        verdict = self._hunt.step_failed(in_step, self._mailbox.waiting_in_engine())
        logger.warning(
            "engine replica %d: a step with %d request(s) raised (%s); isolating: %d fail, %d run, %d held back",
            self.replica,
            len(in_step),
            error.reason,
            len(verdict.culprits),
            len(verdict.run),
            len(verdict.held),
        )
        for rid in verdict.culprits:
            self._mailbox.finish_with_error(
                rid,
                f"request {rid!r} failed: every step that ran it alone raised "
                f"({error.reason}); it fails alone, the other requests go on",
            )
        self._requeue_all(verdict.run)

    def progress(self, outputs: list[EngineCoreOutput]) -> None:
        """A step's outputs: a probe that passed lets the next group (or every held request) run."""
        if not self._hunt.active:
            return
        for o in outputs:
            if o.new_token_ids or o.finished:
                self._requeue_all(self._hunt.progressed(o.request_id, o.finished))

    def abort_held(self, aborts: list[str]) -> list[str]:
        """Aborts of requests the hunt holds back (the engine does not know them) end here;
        -> the aborts for the engine."""
        if not self._hunt.active:
            return aborts
        rest = []
        for rid in aborts:
            if not self._hunt.is_held(rid):
                rest.append(rid)
                continue
            self._mailbox.end(rid, EngineCoreOutput(rid, [], True, "abort"))
            self._requeue_all(self._hunt.forget(rid))
        return rest

    def _requeue_all(self, rids: list[str]) -> None:
        # A request that cannot be re-queued fails alone (Mailbox.requeue); the hunt then goes on without it.
        todo = list(rids)
        while todo:
            rid = todo.pop(0)
            self._requeue(rid)
            if rid not in self._mailbox:
                todo += self._hunt.forget(rid)
