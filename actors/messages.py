"""What the client and a driver actor send each other: requests in, outputs and timings back."""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from kvcore.kv_cache.block_pool import CacheEvents
from kvcore.messages import ENGINE_CORE_OUTPUT_FIELDS, EngineCoreOutput
from kvcore.request import SamplingParams

# How a driver words a refusal that is the replica's state, not the request's fault (the client sends
# such a request elsewhere): "engine replica <r> is down: <why>" / "engine replica <r> is rebuilding: <why>".
DOWN = "is down"
REBUILDING = "is rebuilding"


@dataclass
class RequestSpec:
    """What a client sends: the driver builds the Request itself (its own clock for timings)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Tokens another engine already produced for this request (and the client already has): the new
    # engine goes on after them as outputs, not as prompt, so output positions (the seeded sampler's
    # counter), penalties' counts, min_tokens and max_tokens continue where they were.
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestTiming:
    """Per finished request, measured on the driver: seconds from arrival."""

    ttft_s: float | None
    e2e_s: float
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass
class PollResult:
    outputs: list[EngineCoreOutput]
    timings: dict[str, RequestTiming] = field(default_factory=dict)
    fatal: str | None = None  # set once the replica is down for good
    # Unfinished requests the driver gave back: its TP group lost its resources (a node went away) and
    # could not be rebuilt within parallel.placement_timeout_s. The client sends them elsewhere.
    returned: list[str] = field(default_factory=list)
    # False while the replica waits for resources to rebuild on; it refuses requests meanwhile.
    available: bool = True
    # The prefix cache's changes since the last poll, in order (a KV-aware router's index of the replica).
    cache_events: list[CacheEvents] = field(default_factory=list)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Sent every step to the client (a few hundred outputs): as plain tuples, Ray's cloudpickle calls
        # its Python-level reducer_override once for the message instead of once per object. 256 outputs:
        # dumps 739 -> 91 us, loads 248 -> 102 us on the CPU machine. Shared objects (a step's
        # LogprobsBatch) still pickle once, with their out-of-band buffers.
        rows = list(map(_output_fields, self.outputs))
        timings = {k: (t.ttft_s, t.e2e_s, t.num_prompt_tokens, t.num_output_tokens) for k, t in self.timings.items()}
        return _rebuild_poll, (rows, timings, self.fatal, self.returned, self.available, self.cache_events)


_output_fields = attrgetter(*ENGINE_CORE_OUTPUT_FIELDS)


def _rebuild_poll(
    rows: list[tuple[Any, ...]],
    timings: dict[str, tuple[Any, ...]],
    fatal: str | None,
    returned: list[str],
    available: bool,
    cache_events: list[CacheEvents] | None = None,
) -> PollResult:
    # In ENGINE_CORE_OUTPUT_FIELDS' order (kvcore.messages checks it against the dataclass; the wire test
    # round-trips every field with distinct values).
    new = object.__new__
    outputs = []
    for row in rows:
        o = new(EngineCoreOutput)
        (
            o.request_id,
            o.new_token_ids,
            o.finished,
            o.finish_reason,
            o.stop_reason,
            o.error,
            o.num_cached_tokens,
            o.step_logprobs,
            o.prompt_logprobs,
        ) = row
        outputs.append(o)
    return PollResult(
        outputs, {k: RequestTiming(*t) for k, t in timings.items()}, fatal, returned, available, cache_events or []
    )


def error_output(rid: str, message: str) -> EngineCoreOutput:
    """A request's last output when it ends in an error."""
    return EngineCoreOutput(rid, [], finished=True, finish_reason="error", error=message)
