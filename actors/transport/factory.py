"""Pick the control-plane transport named by `ray.transport` (its three kinds: actors/transport/broadcast.py
and actors/transport/shm.py). A module of its own so that shm.py builds on broadcast.py without a circle."""

from __future__ import annotations

from typing import Any, Sequence

from actors.transport.broadcast import ActorCallTransport, CompiledGraphTransport, Transport
from actors.transport.shm import ShmTransport


def make_transport(
    kind: str, workers: Sequence[Any], step_timeout_s: float, answer_rank: int = 0, max_in_flight: int = 1
) -> Transport:
    """`answer_rank`: whose output a step returns; `max_in_flight`: steps submitted and not yet collected."""
    if kind == "compiled_graph":
        return CompiledGraphTransport(workers, step_timeout_s, answer_rank, max_in_flight)
    if kind == "actor_calls":
        return ActorCallTransport(workers, step_timeout_s, answer_rank)
    if kind == "shm":
        return ShmTransport(workers, step_timeout_s, answer_rank=answer_rank, max_in_flight=max_in_flight)
    raise ValueError(f"ray.transport={kind!r}: must be compiled_graph, actor_calls or shm")
