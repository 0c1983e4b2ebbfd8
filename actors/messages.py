"""What the client and a driver actor send each other: requests in, outputs and timings back."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvcore.messages import EngineCoreOutput
from kvcore.request import SamplingParams


@dataclass
class RequestSpec:
    """What a client sends: the driver builds the Request itself (its own clock for timings)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


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


def error_output(rid: str, message: str) -> EngineCoreOutput:
    """A request's last output when it ends in an error."""
    return EngineCoreOutput(rid, [], finished=True, finish_reason="error", error=message)
