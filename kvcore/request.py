"""Request, SamplingParams and RequestStatus: the scheduler's view of one generation."""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any


class RequestValidationError(ValueError):
    """A request field breaks a rule; the message names the field and the rule."""


def _check(cond: bool, field_name: str, value: Any, rule: str) -> None:
    if not cond:
        raise RequestValidationError(f"SamplingParams.{field_name}={value!r}: {rule}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """Per-request sampling settings, validated on construction (vLLM's names and meanings)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables top-k
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        _check(isinstance(t, (int, float)) and not isinstance(t, bool), "temperature", t, "must be a number")
        _check(math.isfinite(t) and t >= 0, "temperature", t, "must be finite and >= 0")
        p = self.top_p
        _check(isinstance(p, (int, float)) and not isinstance(p, bool), "top_p", p, "must be a number")
        _check(0 < p <= 1, "top_p", p, "must be in (0, 1]")
        _check(_is_int(self.top_k), "top_k", self.top_k, "must be an integer")
        _check(self.top_k >= -1, "top_k", self.top_k, "must be >= -1 (0 or -1 disables top-k)")
        _check(_is_int(self.max_tokens), "max_tokens", self.max_tokens, "must be an integer")
        _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "must be a bool")
        _check(isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids", self.stop_token_ids,
               "must be a list of non-negative integers")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "must be a list of non-negative integers")
        self.stop_token_ids = list(self.stop_token_ids)
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "must be an integer or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON-like dict; an unknown key is an error that names it."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise RequestValidationError(
                f"SamplingParams: unknown field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**d)


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One generation request as the scheduler and the KV-cache manager see it.

    `all_token_ids` is prompt + output; `num_computed_tokens` counts tokens whose KV is in the cache
    (advanced by the scheduler); `block_hashes` holds the chained hashes of its full blocks, filled
    incrementally by the KV-cache manager.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_id: int | None = None, arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first schedule; -1 = not scheduled yet
        self.num_preemptions = 0
        self.block_hashes: list[Any] = []
        self.stop_reason: int | None = None
        self.error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
