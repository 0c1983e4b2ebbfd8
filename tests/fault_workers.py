"""Test doubles of the worker: a real Worker whose steps raise for chosen request ids, as a poison request
(an input the worker cannot handle) makes them raise. The product Worker carries no fault seam.

Named by its dotted path from the repository root (`worker_cls=POISONABLE`): the driver and the worker
actors import it there, through the PYTHONPATH that start_local_ray gives Ray's processes.
"""

from __future__ import annotations

from typing import Any

from actors.worker.actor import Worker
from kvcore.messages import ModelRunnerOutput, SchedulerOutput

POISONABLE = "tests.fault_workers.PoisonableWorker"


class PoisonableWorker(Worker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_for: set[str] = set()  # steps that run one of these ids raise
        self.fail_before = False

    def fail_steps_with(self, request_ids: list[str], before_run: bool = False) -> None:
        """Every later step that runs one of these request ids raises ValueError on this rank; after the
        runner ran, or with `before_run` before its forward (so the other ranks wait for this one in a
        collective)."""
        self.fail_for = set(request_ids)
        self.fail_before = before_run

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        bad = sorted(self.fail_for.intersection(scheduler_output.num_scheduled_tokens))
        if bad and self.fail_before:
            # Before the forward: the other ranks enter its collectives and wait for this one.
            raise ValueError(f"injected fault: rank {self.rank} fails a step with request(s) {bad} before its forward")
        out = super().execute_model(scheduler_output)
        if bad:
            # After the runner ran, as a real fault would leave it: its state has moved on.
            raise ValueError(f"injected fault: a step with request(s) {bad} raises")
        return out
