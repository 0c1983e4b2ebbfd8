"""What the client and a driver actor send each other: requests in, outputs back. Their wire form is
derived from their fields by kvcore/wire.py (`@message`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcore.kv_cache.block_pool import CacheEvents
from kvcore.messages import EngineCoreOutput
from kvcore.request import SamplingParams
from kvcore.wire import message

# How a driver words a refusal that is the replica's state, not the request's fault (the client sends
# such a request elsewhere): "engine replica <r> is down: <why>" / "engine replica <r> is rebuilding: <why>".
DOWN = "is down"
REBUILDING = "is rebuilding"

# The client id of a driver's only client when there is one (`kvray run`, LLM): several ingress replicas of
# `kvray serve` share a driver, each under its own id, each with its own outbox in the driver's mailbox.
DEFAULT_CLIENT = ""
MAX_CLIENT_ID_LEN = 128


@message
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
    # Who submitted it: its outputs, timing and a "returned" notice go to this client's outbox only.
    client_id: str = DEFAULT_CLIENT


@message
@dataclass
class PollResult:
    """A driver's outputs for one client since that client's last poll (a request's last one carries its
    timing), and the replica's state. Sent every step: its outputs travel as plain tuples (kvcore/wire.py), so Ray's
    cloudpickle calls its Python-level reducer_override once for the message, not once per output."""

    outputs: list[EngineCoreOutput]
    fatal: str | None = None  # set once the replica is down for good
    # Unfinished requests the driver gave back: its TP group lost its resources (a node went away) and
    # could not be rebuilt within parallel.placement_timeout_s. The client sends them elsewhere.
    returned: list[str] = field(default_factory=list)
    # False while the replica waits for resources to rebuild on; it refuses requests meanwhile.
    available: bool = True
    # The prefix cache's changes since the last poll, in order (a KV-aware router's index of the replica).
    cache_events: list[CacheEvents] = field(default_factory=list)
    # The driver's unfinished requests, every client's (an ingress sees the load the others put there).
    num_live: int = 0


def error_output(rid: str, message: str) -> EngineCoreOutput:
    """A request's last output when it ends in an error."""
    return EngineCoreOutput(rid, [], finished=True, finish_reason="error", error=message)
