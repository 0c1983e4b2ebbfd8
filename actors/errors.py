"""The engine's error vocabulary: what a step, a worker or a collective raises, in one place.

Every folder of actors/ imports these from here (as vLLM's v1/engine/exceptions.py), so that no folder
imports another one sideways only for an exception type. Torch-free: the driver process and the
client catch them too.
"""

from __future__ import annotations


class WorkerFailure(RuntimeError):
    """A tensor-parallel worker died, hung past the step timeout, or raised; `rank` is None if unknown.

    Every executor raises it, so that the driver's recovery (which rebuilds on it) sees one type."""

    def __init__(self, rank: int | None, reason: str) -> None:
        self.rank = rank
        self.reason = reason
        who = f"worker rank {rank}" if rank is not None else "a worker"
        super().__init__(f"{who} failed: {reason}")

    def __reduce__(self) -> tuple[type[WorkerFailure], tuple[int | None, str]]:
        # Crosses Ray actor boundaries: rebuilt from the two fields.
        return (WorkerFailure, (self.rank, self.reason))


class StepError(RuntimeError):
    """A step raised on one or more ranks while every rank stayed alive and answered.

    Not a WorkerFailure: new workers would not cure it (the cause is most likely a request), and the
    transport stays usable. `rank` is the first rank that raised."""

    def __init__(self, rank: int, reason: str) -> None:
        self.rank = rank
        self.reason = reason
        super().__init__(f"worker rank {rank}: {reason}")

    def __reduce__(self) -> tuple[type[StepError], tuple[int, str]]:
        # Crosses Ray actor boundaries: rebuilt from the two fields.
        return (StepError, (self.rank, self.reason))


class CollectiveError(RuntimeError):
    """A tensor-parallel collective failed (timed out waiting for a rank, or its peer went away): this
    rank's group is out of step and must be rebuilt. Torch-free because the driver's transport catches
    it and the driver process never imports torch."""
