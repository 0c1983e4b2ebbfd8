"""Stream migration: the ingress's books on every engine request in flight, enough to go on elsewhere.

The ingress sees every token an engine delivers, so the state a migration needs lives here and outlives
any driver: per engine request, the spec first sent and the tokens delivered since. When a replica cannot
go on (its driver died, it failed for good past its restart budget, it handed its requests back because
its placement could not be rebuilt), each of its unfinished requests goes to another replica as a
continuation: the same request id and prompt, with the delivered tokens as outputs it already has
(RequestSpec.output_token_ids). The new engine counts them as outputs, not prompt, so its output
positions (the counter of the seeded sampler's per-token randomness, actors/sample/kernel.py), the
penalties' counts, min_tokens and max_tokens go on where they were, and the derived seed of an unseeded
request (engine seed, request id) is the same. What the client side holds (the output processor's
detokenizer, stop-string hold-back, logprobs so far, the n siblings) stays in the request's Generation,
which never notices the move: greedy and seeded streams continue token-exact, with no gap, no repeat and
no error.

The same continuation moves requests off a replica that is draining (scale-down), running or not yet
started. Prompt logprobs come with a request's first output: one that already answered does not ask
again. A request the ingress gave up on (a stop string ended it and it was aborted, or its client left) is
settled: it is not moved, only released.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from actors.messages import RequestSpec
from kvcore.messages import EngineCoreOutput


@dataclass
class InFlight:
    spec: RequestSpec  # as first sent (a continuation is derived from it, never stored)
    delivered: list[int] = field(default_factory=list)  # tokens delivered to the request's inbox
    answered: bool = False  # an output arrived (with the first one, the prompt logprobs when asked)
    settled: bool = False  # the ingress no longer wants it: lost with its replica, it is only released


class FlightBook:
    """Every engine request the ingress sent and that has not finished, by request id."""

    def __init__(self) -> None:
        self._flights: dict[str, InFlight] = {}

    def __len__(self) -> int:
        return len(self._flights)

    def add(self, spec: RequestSpec) -> None:
        self._flights[spec.request_id] = InFlight(spec)

    def record(self, o: EngineCoreOutput) -> None:
        """An output on its way to the request's inbox."""
        f = self._flights.get(o.request_id)
        if f is not None:
            f.delivered.extend(o.new_token_ids)
            f.answered = True

    def settle(self, request_id: str) -> None:
        f = self._flights.get(request_id)
        if f is not None:
            f.settled = True

    def settled(self, request_id: str) -> bool:
        f = self._flights.get(request_id)
        return f is None or f.settled

    def answered(self, request_id: str) -> bool:
        f = self._flights.get(request_id)
        return f is not None and f.answered

    def pop(self, request_id: str) -> None:
        self._flights.pop(request_id, None)

    def continuation(self, request_id: str) -> RequestSpec:
        """The spec that continues this request on a new engine, right after what was delivered."""
        f = self._flights[request_id]
        spec = f.spec
        if not f.answered:
            return spec
        sp = spec.sampling_params
        if sp.prompt_logprobs is not None:
            sp = replace(sp, prompt_logprobs=None)
        delivered = [*spec.output_token_ids, *f.delivered]
        # The same client: its outputs must reach this ingress's outbox on the new replica.
        return RequestSpec(spec.request_id, spec.prompt_token_ids, sp, delivered, client_id=spec.client_id)
