"""The client's one streaming loop over an EngineGroup: the batch job (cluster/job/runner.py), LLM.generate
(cluster/llm.py), the stress test and its reference run (cluster/stress/run.py) each say what to submit and
what to make of an output; `Stream.loop` submits what is due, polls, hands every output over and sends
the aborts asked for, until nothing is left to submit or in flight. A fix to streaming is made here once.
"""

from __future__ import annotations

import time

from actors.messages import RequestSpec
from cluster.client.output_processor import OutputProcessor, ParentRequest
from cluster.replicas.engine_group import EngineFailure, EngineGroup
from kvcore.messages import EngineCoreOutput


class Stalled(EngineFailure):
    """No output for stall_s with requests in flight and none left to submit: an engine that stops
    producing without failing must not hang its client forever."""


class Stream:
    """Subclasses give `due`, `in_flight` and what they need of the other hooks; `loop` is the loop."""

    poll_s: float = 0.5  # one poll's wait for outputs
    stall_s: float | None = None  # None: wait as long as the engines are up

    def __init__(self, engines: EngineGroup) -> None:
        self.engines = engines

    def due(self) -> list[RequestSpec] | None:
        """The requests to submit now (maybe none); None once no more will come."""
        raise NotImplementedError

    def in_flight(self) -> int:
        """How many requests are submitted and not ended."""
        raise NotImplementedError

    def refused(self, errors: dict[str, str]) -> None:
        """engines.submit refused these ({request_id: error}; maybe none): bad requests, or every replica
        down (then `fatal` is set)."""

    def take(self, out: EngineCoreOutput) -> None:
        """One output: new tokens; the last one of a request is `finished`."""

    def aborts(self) -> list[str]:
        """Requests to abort now."""
        return []

    def between_polls(self) -> None:
        """After each poll's outputs and aborts (the stress test kills workers here)."""

    def loop(self) -> None:
        """Until nothing is left to submit or in flight. Raises EngineFailure once the group is down for
        good (after handing over what came back before), Stalled past stall_s."""
        exhausted, last_output = False, time.monotonic()
        while True:
            specs = None if exhausted else self.due()
            exhausted = specs is None
            if specs:
                self.refused(self.engines.submit(specs))
            idle = not self.in_flight()
            if idle and exhausted:
                return
            # Nothing in flight and nothing submitted: the poll is the wait for the next arrival. A batch
            # refused whole is followed by the next one at once (the `refused` hook decides whether a
            # refusal while the group is down ends the stream).
            if idle and specs:
                continue
            last_output = self._poll(last_output)
            if self.engines.fatal is not None:
                raise EngineFailure(self.engines.fatal)
            if exhausted and self.stall_s is not None and time.monotonic() - last_output > self.stall_s:
                raise Stalled(f"no output for {self.stall_s:.0f}s with {self.in_flight()} request(s) open")

    def _poll(self, last_output: float) -> float:
        got = self.engines.poll(timeout_s=self.poll_s)
        if got:
            last_output = time.monotonic()
        for out in got:
            self.take(out)
        aborts = self.aborts()
        if aborts:
            self.engines.abort(aborts)
        self.between_polls()
        return last_output


class ProcessedStream(Stream):
    """A stream whose outputs go through an OutputProcessor (detokenization, stop strings, n samples, as
    LLM.generate makes them): a stop string matched here aborts its request on the engine."""

    def __init__(self, engines: EngineGroup, processor: OutputProcessor) -> None:
        super().__init__(engines)
        self.processor = processor
        self._aborts: list[str] = []

    def finished(self, parent: ParentRequest, refused: bool) -> None:
        """Every sample of a request has ended (refused: one was refused at submission)."""
        raise NotImplementedError

    def refused(self, errors: dict[str, str]) -> None:
        for request_id, error in errors.items():
            parent = self.processor.fail(request_id, error)
            if parent is not None:
                self.finished(parent, refused=True)

    def take(self, out: EngineCoreOutput) -> None:
        parent, abort = self.processor.process_output(out)
        if abort:
            self._aborts.append(out.request_id)  # a stop string ended it here: free its engine slot
        if parent is not None:
            self.finished(parent, refused=False)

    def aborts(self) -> list[str]:
        aborts, self._aborts = self._aborts, []
        return aborts
