"""The driver actor of one engine replica: EngineCore (scheduler + KV-cache manager) over a RayExecutor.

It is a threaded Ray actor. `start()` starts the TP workers in the placement group the client reserved
for it (the client owns and removes it, so a driver killed from outside leaks nothing); then a
background thread runs the step loop, while client calls (add_requests, abort, get_outputs, stats)
run on other actor threads. Client calls never wait for a step: new requests and aborts go through an
inbox that the loop drains before each step, and outputs wait in an outbox until the client polls.

The driver itself is inbox -> step -> outbox. What it keeps about each unfinished request, and how a
request survives a restart, is actors/driver/live_requests.py; fault injection and introspection are
actors/driver/debug.py; poison isolation is actors/driver/poison.py; the types the client sends and receives
are actors/messages.py.

Errors: a bad request finishes alone with an error output. A worker failure rebuilds the TP group and
re-queues every in-flight request while `parallel.max_worker_restarts` allows; past it, every live
request gets an error output, `get_outputs` reports the failure, and new requests are refused.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable

from actors.config.engine import DEFAULT_WORKER_CLS, EngineConfig
from actors.driver.debug import DriverDebug
from actors.driver.live_requests import LiveRequests, make_request
from actors.driver.poison import PoisonHunt, PoisonIsolation
from actors.driver.recovery import DriverRecovery
from actors.executor.base import WorkerFailure
from actors.messages import (  # noqa: F401 - re-exported
    DOWN,
    REBUILDING,
    PollResult,
    RequestSpec,
    error_output,
)
from actors.worker.gc_heap import freeze_startup_heap
from kvcore.messages import EngineCoreOutput, RequestTiming
from kvcore.request import RequestValidationError, SamplingParams, check_request_id, check_token_ids, validate

if TYPE_CHECKING:
    from actors.driver.metrics import EngineMetrics

logger = logging.getLogger(__name__)


class EngineDriver(DriverRecovery, PoisonIsolation, DriverDebug):
    def __init__(
        self, config: EngineConfig, placement_group: Any, replica: int = 0, worker_cls: str = DEFAULT_WORKER_CLS
    ) -> None:
        if os.environ.get("KVRAY_VERBOSE") != "1":
            # Tearing down a compiled graph whose worker died (kvray stress kills them on purpose) logs
            # "Error cancelling worker task" with two tracebacks; the failure is reported once, below.
            logging.getLogger("ray.dag.compiled_dag_node").setLevel(logging.CRITICAL)
        self.config = config
        self.replica = replica
        self.worker_cls = worker_cls
        self.pg = placement_group
        self.engine = None
        self.info: dict[str, Any] = {}
        self._cv = threading.Condition()
        # Held by the step loop while it touches the engine; a client call that walks the engine's
        # internals (kv_pool_accounting) takes it too. Order: _engine_lock before _cv, never after.
        self._engine_lock = threading.Lock()
        self._inbox: list[RequestSpec] = []
        self._abort_inbox: list[str] = []
        self._outbox: list[EngineCoreOutput] = []
        self._timings: dict[str, RequestTiming] = {}
        self._live = LiveRequests()
        self._fatal: str | None = None
        self._unavailable: str | None = None  # why, while it waits for resources to rebuild on
        self._returned: list[str] = []  # requests given back to the client meanwhile
        self._stop = False
        self._thread: threading.Thread | None = None
        self._restarts = 0
        self._hunt = PoisonHunt()
        self._peak_kv_usage = 0.0
        self._num_output_tokens = 0
        self._metrics: EngineMetrics | None = None

    # ---- set-up -----------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Start the workers, build the engine, start the loop."""
        from actors.driver.metrics import EngineMetrics

        try:
            self._build_engine()
        except BaseException:
            self._release()
            raise
        self._metrics = EngineMetrics(self.replica)
        freeze_startup_heap()
        self._thread = threading.Thread(target=self._loop, name=f"kvray-step-loop-{self.replica}", daemon=True)
        self._thread.start()
        return self.info

    def _build_engine(self) -> None:
        from actors.config.model_rules import validate_for_model
        from actors.driver.engine_core import EngineCore
        from actors.executor.ray_workers import RayExecutor

        executor = RayExecutor(self.config, self.pg, worker_cls=self.worker_cls)
        try:
            validate_for_model(self.config, executor.probe.hf_config)
            self.engine = EngineCore(self.config, executor)
        except BaseException:
            executor.shutdown()
            raise
        hf = executor.probe.hf_config
        eos = hf.get("eos_token_id")
        self.info = {
            "replica": self.replica,
            "node_ip": executor.probe.node_ip,
            "model_dir": executor.probe.model_dir,
            "vocab_size": hf.get("vocab_size"),
            "eos_token_id": eos[0] if isinstance(eos, list) and eos else eos,
            "num_blocks": self.engine.kv_cache_config.num_blocks,
            "max_model_len": self.engine.max_model_len,
            "transport": self.config.ray.transport,
        }

    # ---- client calls -----------------------------------------------------------------------
    def add_requests(self, specs: list[RequestSpec]) -> list[str | None]:
        """Queue requests; a refused one gets its message here (and no output), the rest go on.

        No error output is streamed for a refusal: its id may be a duplicate of a live request, whose
        own stream must not appear to end.
        """
        errors: list[str | None] = []
        with self._cv:
            for spec in specs:
                err = self._check(spec)
                if err is None:
                    self._live.add(spec, time.monotonic())
                    self._inbox.append(spec)
                errors.append(err)
            self._cv.notify_all()
        return errors

    def _check(self, spec: RequestSpec) -> str | None:
        """Everything a request carries is checked again here: a client's objects are not trusted."""
        rid = spec.request_id
        if self._fatal is not None:
            return f"engine replica {self.replica} {DOWN}: {self._fatal}"
        if self._unavailable is not None:
            return f"engine replica {self.replica} {REBUILDING}: {self._unavailable}"
        err = check_request_id(rid)
        if err is not None:
            return err
        if rid in self._live:
            return f"request {rid!r}: request_id is already in use by an unfinished request"
        if not isinstance(spec.sampling_params, SamplingParams):
            return f"request {rid!r}: sampling_params must be a SamplingParams"
        try:
            validate(spec.sampling_params)
        except RequestValidationError as e:
            return f"request {rid!r}: {e}"
        err = check_token_ids("prompt_token_ids", spec.prompt_token_ids, self.info.get("vocab_size"))
        return None if err is None else f"request {rid!r}: {err}"

    def abort(self, request_ids: Iterable[str]) -> None:
        with self._cv:
            self._abort_inbox.extend(request_ids)
            self._cv.notify_all()

    def get_outputs(self, timeout_s: float = 1.0) -> PollResult:
        """Outputs since the last call; waits up to timeout_s for the first one."""
        with self._cv:
            if not self._outbox and self._fatal is None and not self._returned:
                self._cv.wait(timeout_s)
            out, self._outbox = self._outbox, []
            returned, self._returned = self._returned, []
            for o in out:
                if o.finished and o.request_id in self._timings:
                    o.timing = self._timings.pop(o.request_id)
            return PollResult(out, self._fatal, returned, self._unavailable is None)

    def stats(self) -> dict[str, Any]:
        with self._cv:
            base = dict(self.engine.stats()) if self.engine is not None else {}
            base.update(
                replica=self.replica,
                worker_restarts=self._restarts,
                fatal=self._fatal,
                peak_kv_cache_usage=self._peak_kv_usage,
                num_output_tokens=self._num_output_tokens,
                num_live_requests=len(self._live),
                num_replayed=self._live.num_replayed,
            )
            return base

    # ---- the step loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._inbox and not self._abort_inbox and not self.engine.has_unfinished():
                    self._cv.wait(0.5)
                if self._stop:
                    return
                new, self._inbox = self._inbox, []
                aborts, self._abort_inbox = self._abort_inbox, []
            with self._engine_lock:
                try:
                    self._admit(new, aborts)
                    t0 = time.monotonic()
                    outputs = self.engine.step()
                    self._publish(outputs, time.monotonic() - t0)
                except Exception as e:  # noqa: BLE001 - a worker failure or an engine bug: never silent
                    # A dead worker (kvray stress kills them on purpose) is reported in one line; any
                    # other failure, or KVRAY_VERBOSE=1 (kvray -v), keeps its traceback.
                    logger.error(
                        "engine replica %d: step failed: %s",
                        self.replica,
                        e,
                        exc_info=not _worker_death(e) or os.environ.get("KVRAY_VERBOSE") == "1",
                    )
                    if not self._recover(e):
                        return

    def _admit(self, new: list[RequestSpec], aborts: list[str]) -> None:
        for spec in new:
            try:
                self.engine.add_request(make_request(spec, [], self.info.get("eos_token_id")))
            except Exception as e:  # noqa: BLE001 - one bad request fails alone
                self._finish_with_error(spec.request_id, f"request {spec.request_id!r} rejected: {e}")
        aborts = self._abort_held(aborts)
        if aborts:
            self.engine.abort(aborts)

    def _publish(self, outputs: list[EngineCoreOutput], step_time: float) -> None:
        outputs = self._drop_replayed(outputs)
        self._hunt_progress(outputs)
        now = time.monotonic()
        stats = self.engine.stats()
        new_tokens = 0
        with self._cv:
            for o in outputs:
                new_tokens += len(o.new_token_ids)
                self._book_timing(o.request_id, self._live.record(o, now))
                self._outbox.append(o)
            self._num_output_tokens += new_tokens
            self._peak_kv_usage = max(self._peak_kv_usage, float(stats.get("kv_cache_usage", 0.0)))
            if outputs:
                self._cv.notify_all()
        assert self._metrics is not None  # start() sets it before the loop runs
        self._metrics.record_step(stats, step_time, new_tokens)
        if not self.engine.has_unfinished():
            self._metrics.flush()  # idle from now on: export the last window at once

    def _book_timing(self, rid: str, timing: RequestTiming | None) -> None:
        if timing is not None:
            self._timings[rid] = timing

    def _finish_with_error(self, rid: str, message: str) -> None:
        self._end_held(rid, error_output(rid, message))

    # The PoisonIsolation hooks.
    def _live_ids(self) -> list[str]:
        return list(self._live.ids())

    def _end_held(self, rid: str, output: EngineCoreOutput) -> None:
        with self._cv:
            self._book_timing(rid, self._live.retire(rid, time.monotonic()))
            self._outbox.append(output)
            self._cv.notify_all()

    def _readd(self, rid: str) -> None:
        # One request that cannot be re-queued fails alone; the rebuilt group serves the rest.
        try:
            self.engine.add_request(self._live.restart(rid, self.info.get("eos_token_id")))
        except Exception as e:  # noqa: BLE001
            self._finish_with_error(rid, f"request {rid!r}: could not be re-queued after a worker restart: {e}")

    def _drop_replayed(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        with self._cv:
            return self._live.drop_replayed(outputs, self.engine.abort)

    def _fail_all(self, message: str) -> None:
        with self._cv:
            self._fatal = f"engine replica {self.replica} failed: {message}"
            for rid in self._live.clear():
                self._outbox.append(error_output(rid, self._fatal))
            self._inbox.clear()
            self._cv.notify_all()

    # ---- teardown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self.config.parallel.step_timeout_s + 5)
        self._release()

    def _release(self) -> None:
        if self.engine is not None:
            try:
                self.engine.shutdown()
            except Exception as e:  # noqa: BLE001 - workers may already be gone
                logger.debug("engine shutdown: %s", e)


def driver_actor_class():
    """EngineDriver as a threaded Ray actor: the step loop plus concurrent client calls."""
    import ray

    return ray.remote(num_cpus=0, max_concurrency=16)(EngineDriver)


def _worker_death(e: BaseException) -> bool:
    return isinstance(e, WorkerFailure)
