"""The driver's books on its unfinished requests, and what they need to survive a TP-group restart.

Every request the driver accepted has a LiveRequest until it finishes: its spec, its arrival, the tokens
published so far. After a worker restart `restart` turns each back into a Request for the new group,
and `drop_replayed` keeps the client's stream unbroken. Not thread-safe: the driver holds its
condition lock around every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

from actors.messages import RequestSpec, error_output
from kvcore.messages import EngineCoreOutput, RequestTiming
from kvcore.request import Request


@dataclass
class LiveRequest:
    """The driver's record of an unfinished request: enough to re-queue it on a new TP group."""

    spec: RequestSpec
    arrival: float
    output_token_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    # After a restart a sampled request runs again from its prompt (its generator restarts with it);
    # the first `replay` tokens it regenerates were already published and are dropped.
    replay: int = 0


def continued(spec: RequestSpec, done: list[int]) -> RequestSpec:
    """The spec that goes on from `done`, the tokens produced so far: they join its outputs (so output
    positions, penalties' counts and the token limits go on where they were)."""
    if not done:
        return spec
    return replace(spec, output_token_ids=[*spec.output_token_ids, *done])


def make_request(spec: RequestSpec, done: list[int], eos_token_id: int | None) -> Request:
    """The engine's Request for a spec: the outputs it already has (another engine's, and `done`, those
    produced here before a restart) are its first output tokens."""
    spec = continued(spec, done)
    request = Request(spec.request_id, spec.prompt_token_ids, spec.sampling_params, eos_token_id=eos_token_id)
    if spec.output_token_ids:
        request.append_output_token_ids(list(spec.output_token_ids))
    return request


class LiveRequests:
    def __init__(self) -> None:
        self._live: dict[str, LiveRequest] = {}
        self._silenced: set[str] = set()  # aborted by the driver itself; their abort output is dropped
        self.num_replayed = 0  # sampled requests re-run from their prompt after a restart

    def __contains__(self, rid: object) -> bool:
        return rid in self._live

    def __len__(self) -> int:
        return len(self._live)

    def ids(self) -> Iterator[str]:
        return iter(list(self._live))

    def add(self, spec: RequestSpec, now: float) -> None:
        self._live[spec.request_id] = LiveRequest(spec, now)

    def record(self, o: EngineCoreOutput, now: float) -> RequestTiming | None:
        """Book one published output; a finished request leaves the books with its timing."""
        live = self._live.get(o.request_id)
        if live is None:
            return None
        if o.new_token_ids and live.first_token_at is None:
            live.first_token_at = now
        live.output_token_ids.extend(o.new_token_ids)
        return self.retire(o.request_id, now) if o.finished else None

    def retire(self, rid: str, now: float) -> RequestTiming | None:
        live = self._live.pop(rid, None)
        if live is None:
            return None
        ttft = None if live.first_token_at is None else live.first_token_at - live.arrival
        return RequestTiming(ttft, now - live.arrival, len(live.spec.prompt_token_ids), len(live.output_token_ids))

    def clear(self) -> list[str]:
        """Forget every request (the replica is down); their ids."""
        ids = list(self._live)
        self._live.clear()
        return ids

    def restart(self, rid: str, eos_token_id: int | None) -> Request:
        """The request to run again on a new TP group, so that the client sees one unbroken stream.

        A greedy request goes on from its tokens so far (they join the prompt). A sampled one cannot:
        its generator is lost with the worker, and a fresh one seeded alike would draw the first tokens
        again. So it starts over from its prompt, and the tokens already published are regenerated,
        checked and dropped (`drop_replayed`).
        """
        return make_request(self.resume_spec(rid), [], eos_token_id)

    def resume_spec(self, rid: str) -> RequestSpec:
        """What to send a new engine (another replica, a new driver) for a request whose engine was
        lost, so that the stream the client already has goes on unbroken: as `restart`, as a spec."""
        live = self._live[rid]
        if live.spec.sampling_params.greedy:
            return continued(live.spec, live.output_token_ids)
        live.replay = len(live.output_token_ids)
        self.num_replayed += 1 if live.replay else 0
        return live.spec

    def drop_replayed(
        self, outputs: list[EngineCoreOutput], abort: Callable[[list[str]], None]
    ) -> list[EngineCoreOutput]:
        """Strip the tokens of replaying requests that the client already has.

        A replay that differs from what was sent cannot be taken back: that request ends with an error,
        is aborted through `abort`, and the echo of that abort is dropped later.
        """
        kept = []
        for o in outputs:
            if o.request_id in self._silenced:  # ended with an error already: drop its abort echo
                if o.finished:
                    self._silenced.discard(o.request_id)
                continue
            live = self._live.get(o.request_id)
            if live is None or live.replay == 0 or not o.new_token_ids:
                kept.append(o)
                continue
            start = len(live.output_token_ids) - live.replay
            n = min(live.replay, len(o.new_token_ids))
            if o.new_token_ids[:n] != live.output_token_ids[start : start + n]:
                # Not the same stream (a numerical difference): tokens sent cannot be taken back.
                if not o.finished:
                    self._silenced.add(o.request_id)
                    abort([o.request_id])
                kept.append(
                    error_output(
                        o.request_id,
                        (
                            f"request {o.request_id!r}: after a worker restart the replayed tokens differ from "
                            f"the ones already sent (at output position {start}); it cannot go on consistently"
                        ),
                    )
                )
                continue
            live.replay -= n
            rest = o.new_token_ids[n:]
            if rest or o.finished:
                kept.append(replace(o, new_token_ids=rest))
        return kept
