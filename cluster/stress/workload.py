"""The stress run's workload: long-tailed prompt and output lengths, families of prompts that share long
prefixes, a mix of greedy and seeded sampling, and a share of requests to abort mid-flight.

Everything is drawn from one seed, so a failing run can be replayed exactly.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvcore.request import SamplingParams


@dataclass
class StressRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_s: float  # seconds after the start at which it is submitted
    abort_after: int | None = None  # abort once this many output tokens arrived (0: right away)
    family: int | None = None  # the shared prefix it starts with, if any


@dataclass(frozen=True)
class WorkloadShape:
    """Limits the workload must respect so that every request fits the engine under test."""

    vocab_size: int
    max_total_tokens: int  # prompt + max_tokens, within max_model_len and the KV pool
    eos_token_id: int | None = None


def long_tail(rng: random.Random, median: float, cap: int, sigma: float = 0.9) -> int:
    """A log-normal draw: mostly near `median`, now and then many times it; clipped to [1, cap]."""
    return max(1, min(cap, int(rng.lognormvariate(math.log(median), sigma))))


def max_total_tokens(max_model_len: int, usable_blocks: int, block_size: int, num_groups: int) -> int:
    """The longest request (prompt + output) that the scheduler will accept on this pool.

    Every KV-cache group holds its own blocks out of the one pool; keep a block per group spare so a
    request never needs the whole pool to itself.
    """
    per_group = max(1, usable_blocks // max(1, num_groups) - 1)
    return max(2, min(max_model_len, per_group * block_size))


def make_workload(
    n: int, seed: int, shape: WorkloadShape, abort_rate: float = 0.1, duration_s: float = 0.0
) -> list[StressRequest]:
    if n < 1:
        raise ValueError(f"--requests={n}: must be >= 1")
    if not 0.0 <= abort_rate <= 1.0:
        raise ValueError(f"--abort-rate={abort_rate}: must be in [0, 1]")
    if duration_s < 0:
        raise ValueError(f"--duration={duration_s}: must be >= 0 seconds")
    rng = random.Random(seed)
    limit = shape.max_total_tokens
    vocab = [t for t in range(shape.vocab_size) if t != shape.eos_token_id]
    # Long shared prefixes: up to half the longest request, so the suffix and the output still fit.
    families = [
        [rng.choice(vocab) for _ in range(long_tail(rng, limit / 5, limit // 2))] for _ in range(max(2, n // 20))
    ]
    arrivals = sorted(rng.uniform(0.0, duration_s) for _ in range(n)) if duration_s > 0 else [0.0] * n
    out = []
    for i in range(n):
        family = rng.randrange(len(families)) if rng.random() < 0.75 else None
        prefix = families[family] if family is not None else []
        suffix = [rng.choice(vocab) for _ in range(long_tail(rng, 12 if prefix else 48, limit))]
        prompt = (prefix + suffix)[: limit - 1]
        max_tokens = long_tail(rng, 24, limit - len(prompt))
        abort_after = rng.randint(0, max(0, max_tokens - 1)) if rng.random() < abort_rate else None
        out.append(StressRequest(f"stress-{i}", prompt, _sampling(rng, max_tokens), arrivals[i], abort_after, family))
    return out


def _sampling(rng: random.Random, max_tokens: int) -> SamplingParams:
    # Most ignore EOS so that output lengths follow the long tail drawn above; a few may stop early.
    ignore_eos = rng.random() < 0.8
    if rng.random() < 0.5:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return SamplingParams(
        temperature=rng.choice([0.7, 1.0]),
        top_k=rng.choice([0, 20]),
        top_p=rng.choice([1.0, 0.9]),
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        seed=rng.randrange(1 << 31),
    )
