"""The control-plane broadcast: one SchedulerOutput to every rank, the answering rank's reply back (rank 0,
or with pipeline stages the last stage's first TP rank, which samples).

Three transports with one contract (`broadcast(so) -> the answering rank's ModelRunnerOutput | None`,
`submit(so)` / `collect(handle)` for several steps in flight, `close()`):
- CompiledGraphTransport: a Ray Compiled Graph (InputNode -> every worker's execute_model ->
  MultiOutputNode), compiled once; each step writes the message once to shared-memory channels, which
  skips the per-call task submission of plain actor calls (~0.2 ms vs ~1.3 ms a round trip).
- ActorCallTransport: plain `.remote()` calls, the fallback.
- ShmTransport (actors/transport/shm.py): a shared-memory ring on the driver's node, ZMQ across nodes.
actors/transport/factory.py picks one by `ray.transport`.
A dead worker or a step longer than `step_timeout_s` raises WorkerFailure naming the rank, within
seconds; after a failure the transport stays broken (every later call raises the same error), since the
surviving ranks may be stuck in a collective waiting for the lost one.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import ray
from ray.exceptions import RayActorError, RayChannelError, RayChannelTimeoutError, RayTaskError

from actors.errors import CollectiveError, StepError, WorkerFailure
from kvcore.messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

PING_TIMEOUT_S = 2.0  # how long a live actor may take to answer ping() while we diagnose a failure


def diagnose(workers: Sequence[Any], timeout_s: float = PING_TIMEOUT_S) -> tuple[int | None, str]:
    """Which rank is at fault: the first that is dead, else the first that does not answer a ping."""
    refs = [w.ping.remote() for w in workers]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    ready_set = set(ready)
    for rank, ref in enumerate(refs):
        if ref in ready_set:
            try:
                ray.get(ref)
            except RayActorError as e:
                return rank, f"its actor died ({first_line(e)})"
            except Exception as e:  # noqa: BLE001 - any error of a ping says this rank is broken
                return rank, f"ping raised {type(e).__name__}: {first_line(e)}"
    for rank, ref in enumerate(refs):
        if ref not in ready_set:
            return rank, f"did not answer a ping within {timeout_s:g}s"
    return None, "every rank is alive"


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    for line in text.splitlines():
        if "actor is dead" in line.lower() or "killed" in line.lower():
            return line.strip()
    return text.splitlines()[0] if text else type(e).__name__


def gather_ranks(
    refs: Sequence[Any], method: str, timeout_s: float, on_timeout: Callable[[list[int]], WorkerFailure]
) -> list[Any]:
    """Every rank's answer to `method`, in rank order, waiting at most timeout_s in all.

    Answers are taken one at a time so that a dead rank is reported at once, even while the others are
    stuck in a collective waiting for it. A timeout raises `on_timeout(pending ranks)`. A rank that
    raised is reported once every rank has answered (see step_failure): if the others wait for it in a
    collective, their collective timeout (shorter than the step's) makes them answer too.
    """
    rank_of = {ref: r for r, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    errors: list[tuple[int, str, bool]] = []
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise on_timeout(sorted(rank_of[r] for r in pending))
        rank = rank_of[ready[0]]
        try:
            results[rank] = ray.get(ready[0])
        except RayActorError as e:
            raise WorkerFailure(rank, f"its actor died during {method} ({_summary(e)})") from None
        except RayTaskError as e:
            errors.append((rank, _cause(e), isinstance(e.cause, CollectiveError)))
    if errors:
        raise step_failure(sorted(errors), method)
    return results


def step_failure(errors: list[tuple[int, str, bool]], method: str = "execute_model") -> StepError | WorkerFailure:
    """What the ranks that raised mean, from (rank, error, is a CollectiveError) in rank order.

    Without a failed collective it is a StepError (every rank alive and in step: the poison hunt runs).
    A failed collective leaves the group out of step, so it is a WorkerFailure (the group is rebuilt),
    naming the rank that failed on its own, whose peers then timed out waiting for it."""
    stuck = [r for r, _, collective in errors if collective]
    if not stuck:
        return StepError(errors[0][0], f"{method} raised {errors[0][1]}")
    alone = [(r, text) for r, text, collective in errors if not collective]
    if alone:
        return WorkerFailure(
            alone[0][0],
            f"its {method} raised {alone[0][1]} while rank(s) {stuck} waited for "
            f"it in a collective until parallel.collective_timeout_s; the "
            f"tensor-parallel group is out of step and is rebuilt",
        )
    return WorkerFailure(
        stuck[0],
        f"a tensor-parallel collective failed in {method} ({errors[0][1]}); the group is out of step and is rebuilt",
    )


def _cause(e: RayTaskError) -> str:
    text = repr(e.cause)
    return text if len(text) <= 300 else text[:300] + "..."


def _summary(e: BaseException) -> str:
    """First and last lines of a Ray error: what happened, and (for a failed __init__) the cause."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


class Transport:
    """What every transport shares: the broadcast contract and its failure books (once failed, every
    later call raises the same WorkerFailure). ShmTransport (actors/transport/shm.py) builds on it too.
    `answer_rank`: whose output a step returns (the last pipeline stage's first TP rank)."""

    answer_rank = 0  # also for instances assembled without __init__ (benchmarks/host/bench_control_plane_phases.py)

    def __init__(self, workers: Sequence[Any], step_timeout_s: float, answer_rank: int = 0) -> None:
        self.workers = list(workers)
        self.step_timeout_s = step_timeout_s
        # Whose output a step returns: rank 0, or with pipeline stages the last stage's first TP rank.
        self.answer_rank = answer_rank
        self.failure: WorkerFailure | None = None

    def broadcast(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Send the step to every rank and return the answering rank's output (within step_timeout_s)."""
        handle = self._guard(self._submit, so)
        return self._guard(self._collect, so, handle)

    def submit(self, so: SchedulerOutput) -> tuple[SchedulerOutput, Any]:
        """Send the step without waiting (pipeline parallelism keeps several in flight); collect() in
        submission order."""
        return so, self._guard(self._submit, so)

    def collect(self, submitted: tuple[SchedulerOutput, Any]) -> ModelRunnerOutput | None:
        so, handle = submitted
        out: ModelRunnerOutput | None = self._guard(self._collect, so, handle)
        return out

    def _guard(self, fn: Any, *args: Any) -> Any:
        # After a failure the transport stays broken: survivors may sit in a collective.
        if self.failure is not None:
            raise self.failure
        try:
            return fn(*args)
        except WorkerFailure as f:
            self.failure = f
            raise

    def _submit(self, so: SchedulerOutput) -> Any:
        raise NotImplementedError

    def _collect(self, so: SchedulerOutput, handle: Any) -> ModelRunnerOutput:
        """Wait for the step (at most step_timeout_s from now) and return rank 0's answer."""
        raise NotImplementedError

    def _fail_hang(self, step_id: int) -> WorkerFailure:
        rank, why = diagnose(self.workers)
        if rank is not None and "did not answer" not in why:
            return WorkerFailure(rank, f"{why} (while running step {step_id})")
        return WorkerFailure(
            rank, f"step {step_id} did not finish within parallel.step_timeout_s={self.step_timeout_s:g}s ({why})"
        )

    def close(self) -> None:
        pass


class ActorCallTransport(Transport):
    name = "actor_calls"

    def _submit(self, so: SchedulerOutput) -> Any:
        # Calls from one caller to an actor run in submission order, so queued steps stay ordered.
        return [w.execute_model.remote(so) for w in self.workers]

    def _collect(self, so: SchedulerOutput, refs: Any) -> ModelRunnerOutput:
        return gather_ranks(
            refs, "execute_model", self.step_timeout_s, on_timeout=lambda _ranks: self._fail_hang(so.step_id)
        )[self.answer_rank]


class CompiledGraphTransport(Transport):
    name = "compiled_graph"

    def __init__(
        self, workers: Sequence[Any], step_timeout_s: float, answer_rank: int = 0, max_in_flight: int = 1
    ) -> None:
        super().__init__(workers, step_timeout_s, answer_rank)
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as inp:
            dag = MultiOutputNode([w.execute_model.bind(inp) for w in self.workers])
        # One execution in flight at a time (async scheduling overlaps inside the workers instead), or one
        # per pipeline stage (the engine's batch queue).
        try:
            self.graph = dag.experimental_compile(
                _submit_timeout=step_timeout_s, _max_inflight_executions=max(1, max_in_flight)
            )
        except RayActorError as e:  # a worker died before its channels were set up
            rank, why = diagnose(self.workers)
            raise WorkerFailure(rank, f"{why} (while compiling the step graph: {first_line(e)})") from None

    def _submit(self, so: SchedulerOutput) -> Any:
        try:
            return self.graph.execute(so)
        except RayChannelTimeoutError:
            raise self._fail_hang(so.step_id) from None
        except RayChannelError as e:
            raise self._fail_dead(so.step_id, e) from None

    def _collect(self, so: SchedulerOutput, refs: Any) -> ModelRunnerOutput:
        deadline = time.monotonic() + self.step_timeout_s
        results: list[Any] = []
        errors: list[tuple[int, str, bool]] = []
        # Every rank's ref is read (not only rank 0's) so no result is left buffered in the graph, also
        # when a rank raised: the graph stays usable for the next step.
        for rank, ref in enumerate(refs):
            try:
                results.append(ref.get(timeout=max(0.01, deadline - time.monotonic())))
            except RayChannelTimeoutError:
                raise self._fail_hang(so.step_id) from None
            except (RayChannelError, RayActorError) as e:
                # The graph reports a death on whichever output it reads first: ask who is gone.
                raise self._fail_dead(so.step_id, e) from None
            except RayTaskError as e:
                results.append(None)
                errors.append((rank, _cause(e), isinstance(e.cause, CollectiveError)))
        if errors:
            raise step_failure(errors)
        return results[self.answer_rank]

    def _fail_dead(self, step_id: int, e: BaseException) -> WorkerFailure:
        rank, why = diagnose(self.workers)
        if rank is None:
            why = f"the compiled graph's channel failed ({first_line(e)})"
        return WorkerFailure(rank, f"{why} (while running step {step_id})")

    def close(self, kill_actors: bool = False) -> None:
        try:
            self.graph.teardown(kill_actors=kill_actors)
        except Exception as e:  # noqa: BLE001 - a graph broken by a dead actor may fail to tear down
            logger.debug("compiled graph teardown: %s", e)
