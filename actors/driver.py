"""The driver actor of one engine replica: EngineCore (scheduler + KV-cache manager) over a RayExecutor.

It is a threaded Ray actor. `start()` starts the TP workers in the placement group the client reserved
for it (the client owns and removes it, so a driver killed from outside leaks nothing); then a
background thread runs the step loop, while client calls (add_requests, abort, get_outputs, stats)
run on other actor threads. Client calls never wait for a step: new requests and aborts go through an
inbox that the loop drains before each step, and outputs wait in an outbox until the client polls.

Errors: a bad request finishes alone with an error output. A worker failure rebuilds the TP group and
re-queues every in-flight request while `parallel.max_worker_restarts` allows; past it, every live
request gets an error output, `get_outputs` reports the failure, and new requests are refused.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from actors.engine_config import EngineConfig
from actors.poison import PoisonHunt, PoisonIsolation, StepError
from kvcore.messages import EngineCoreOutput
from kvcore.request import (Request, RequestValidationError, SamplingParams, check_request_id,
                             check_token_ids, validate)

logger = logging.getLogger(__name__)


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


@dataclass
class _Live:
    """The driver's record of an unfinished request: enough to re-queue it on a new TP group."""

    spec: RequestSpec
    arrival: float
    output_token_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    # After a restart a sampled request runs again from its prompt (its generator restarts with it);
    # the first `replay` tokens it regenerates were already published and are dropped.
    replay: int = 0


class EngineDriver(PoisonIsolation):
    def __init__(self, config: EngineConfig, placement_group: Any, replica: int = 0,
                 worker_cls: str = "actors.worker.Worker") -> None:
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
        self._live: dict[str, _Live] = {}
        self._silenced: set[str] = set()  # aborted by the driver itself; their abort output is dropped
        self._num_replayed = 0  # sampled requests re-run from their prompt after a restart
        self._fatal: str | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._restarts = 0
        self._hunt = PoisonHunt()
        self._peak_kv_usage = 0.0
        self._num_output_tokens = 0
        self._metrics = None

    # ---- set-up -----------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Start the workers, build the engine, start the loop."""
        from actors.metrics import EngineMetrics

        try:
            self._build_engine()
        except BaseException:
            self._release()
            raise
        self._metrics = EngineMetrics(self.replica)
        self._thread = threading.Thread(target=self._loop, name=f"kvray-step-loop-{self.replica}", daemon=True)
        self._thread.start()
        return self.info

    def _build_engine(self) -> None:
        from actors.engine_core import EngineCore
        from actors.ray_executor import RayExecutor
        from actors.engine_config import validate_for_model

        executor = RayExecutor(self.config, self.pg, worker_cls=self.worker_cls)
        try:
            validate_for_model(self.config, executor.probe.hf_config)
            self.engine = EngineCore(self.config, executor)
        except BaseException:
            executor.shutdown()
            raise
        hf = executor.probe.hf_config
        eos = hf.get("eos_token_id")
        self.info = {"replica": self.replica, "node_ip": executor.probe.node_ip,
                     "model_dir": executor.probe.model_dir, "vocab_size": hf.get("vocab_size"),
                     "eos_token_id": eos[0] if isinstance(eos, list) and eos else eos,
                     "num_blocks": self.engine.kv_cache_config.num_blocks,
                     "max_model_len": self.engine.max_model_len,
                     "transport": self.config.ray.transport}

    def ready(self) -> bool:
        return self.engine is not None and self._fatal is None

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
                    self._live[spec.request_id] = _Live(spec, time.monotonic())
                    self._inbox.append(spec)
                errors.append(err)
            self._cv.notify_all()
        return errors

    def _check(self, spec: RequestSpec) -> str | None:
        """Everything a request carries is checked again here: a client's objects are not trusted."""
        rid = spec.request_id
        if self._fatal is not None:
            return f"engine replica {self.replica} is down: {self._fatal}"
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
            if not self._outbox and self._fatal is None:
                self._cv.wait(timeout_s)
            out, self._outbox = self._outbox, []
            timings = {o.request_id: self._timings.pop(o.request_id) for o in out
                       if o.finished and o.request_id in self._timings}
            return PollResult(out, timings, self._fatal)

    def stats(self) -> dict[str, Any]:
        with self._cv:
            base = dict(self.engine.stats()) if self.engine is not None else {}
            base.update(replica=self.replica, worker_restarts=self._restarts, fatal=self._fatal,
                        peak_kv_cache_usage=self._peak_kv_usage, num_output_tokens=self._num_output_tokens,
                        num_live_requests=len(self._live), num_replayed=self._num_replayed)
            return base

    def kill_worker(self, rank: int) -> None:
        """Fault injection for tests and the stress run: kill one TP worker actor."""
        import ray

        ray.kill(self.engine.executor.workers[rank], no_restart=True)

    def worker_call(self, rank: int, method: str, *args: Any) -> Any:
        """Call one worker's method (fault injection, introspection); not part of the step path."""
        import ray

        return ray.get(getattr(self.engine.executor.workers[rank], method).remote(*args))

    def start_profile(self, trace_dir: str, num_steps: int = 5, skip_steps: int = 0) -> None:
        """Every worker traces its next `num_steps` steps after `skip_steps` (see Worker.start_profile)."""
        self.engine.executor.collective_rpc("start_profile", trace_dir, num_steps, skip_steps)

    def stop_profile(self) -> list[str]:
        """End the workers' traces; the files written (on each worker's node)."""
        return [p for paths in self.engine.executor.collective_rpc("stop_profile") for p in paths]

    # ---- the step loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._inbox and not self._abort_inbox and \
                        not self.engine.has_unfinished():
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
                    logger.error("engine replica %d: step failed: %s", self.replica, e,
                                 exc_info=not _worker_death(e) or os.environ.get("KVRAY_VERBOSE") == "1")
                    if not self._recover(e):
                        return

    def _admit(self, new: list[RequestSpec], aborts: list[str]) -> None:
        for spec in new:
            try:
                self.engine.add_request(self._make_request(spec, []))
            except Exception as e:  # noqa: BLE001 - one bad request fails alone
                self._finish_with_error(spec.request_id, f"request {spec.request_id!r} rejected: {e}")
        aborts = self._abort_held(aborts)
        if aborts:
            self.engine.abort(aborts)

    def _make_request(self, spec: RequestSpec, done: list[int]) -> Request:
        # After a restart the tokens produced so far join the prompt, and only the rest is generated.
        sp = spec.sampling_params if not done else replace(
            spec.sampling_params, max_tokens=spec.sampling_params.max_tokens - len(done),
            min_tokens=max(0, spec.sampling_params.min_tokens - len(done)))
        return Request(spec.request_id, spec.prompt_token_ids + done, sp,
                       eos_token_id=self.info.get("eos_token_id"))

    def _publish(self, outputs: list[EngineCoreOutput], step_time: float) -> None:
        outputs = self._drop_replayed(outputs)
        self._hunt_progress(outputs)
        now = time.monotonic()
        stats = self.engine.stats()
        new_tokens = 0
        with self._cv:
            for o in outputs:
                live = self._live.get(o.request_id)
                new_tokens += len(o.new_token_ids)
                if live is not None:
                    if o.new_token_ids and live.first_token_at is None:
                        live.first_token_at = now
                    live.output_token_ids.extend(o.new_token_ids)
                    if o.finished:
                        self._retire(o.request_id, live, now)
                self._outbox.append(o)
            self._num_output_tokens += new_tokens
            self._peak_kv_usage = max(self._peak_kv_usage, float(stats.get("kv_cache_usage", 0.0)))
            if outputs:
                self._cv.notify_all()
        self._metrics.record_step(stats, step_time, new_tokens)
        if not self.engine.has_unfinished():
            self._metrics.flush()  # idle from now on: export the last window at once

    def _retire(self, rid: str, live: _Live, now: float) -> None:
        del self._live[rid]
        ttft = None if live.first_token_at is None else live.first_token_at - live.arrival
        self._timings[rid] = RequestTiming(ttft, now - live.arrival, len(live.spec.prompt_token_ids),
                                           len(live.output_token_ids))

    def _finish_with_error(self, rid: str, message: str) -> None:
        with self._cv:
            live = self._live.get(rid)
            if live is not None:
                self._retire(rid, live, time.monotonic())
            self._outbox.append(_error_output(rid, message))
            self._cv.notify_all()

    # ---- failure and recovery ---------------------------------------------------------------
    def _recover(self, error: Exception) -> bool:
        """A step raised with every worker alive: find the poison request (actors/poison.py). A worker
        died or hung: rebuild the TP group and re-queue in-flight requests, within the restart budget,
        which only worker deaths spend (also a death during a rebuild)."""
        from actors.transport import WorkerFailure

        if isinstance(error, StepError):
            try:
                self._isolate(error)
                return True
            except Exception as e:  # noqa: BLE001 - the reset failed: a worker is gone after all
                logger.warning("engine replica %d: resetting the workers failed: %s", self.replica, e)
                error = e
        budget = self.config.parallel.max_worker_restarts
        # Only a worker failure is cured by new workers; an engine bug (a broken invariant) is fatal.
        while self._restarts < budget and isinstance(error, WorkerFailure):
            self._restarts += 1
            logger.warning("engine replica %d: %s; rebuilding the TP group (restart %d of %d)",
                           self.replica, error, self._restarts, budget)
            try:
                self._rebuild()
                return True
            except Exception as e:  # noqa: BLE001 - a death during the rebuild spends the next restart
                error = e
        self._fail_all(f"{type(error).__name__}: {error}" if budget == 0 else
                       f"{type(error).__name__}: {error} (after {self._restarts} of "
                       f"parallel.max_worker_restarts={budget} restarts)")
        return False

    def _rebuild(self) -> None:
        try:
            self.engine.shutdown()
        except Exception as e:  # noqa: BLE001 - the old workers may be gone already
            logger.debug("engine shutdown: %s", e)
        self._build_engine()
        self._hunt = PoisonHunt()  # every live request is re-queued on the new group
        with self._cv:
            pending = {s.request_id for s in self._inbox}
            for rid, live in list(self._live.items()):
                if rid not in pending:
                    self._readd(rid, live)
        self._metrics.record_restart()

    # The PoisonIsolation hooks.
    def _live_ids(self) -> list[str]:
        return list(self._live)

    def _end_held(self, rid: str, output: EngineCoreOutput) -> None:
        with self._cv:
            live = self._live.get(rid)
            if live is not None:
                self._retire(rid, live, time.monotonic())
            self._outbox.append(output)
            self._cv.notify_all()

    def _readd(self, rid: str, live: _Live | None = None) -> None:
        # One request that cannot be re-queued fails alone; the rebuilt group serves the rest.
        live = self._live[rid] if live is None else live
        try:
            self.engine.add_request(self._requeue(live))
        except Exception as e:  # noqa: BLE001
            self._finish_with_error(rid, f"request {rid!r}: could not be re-queued after a worker restart: {e}")

    def _requeue(self, live: _Live) -> Request:
        """The request to run again on a new TP group, so that the client sees one unbroken stream.

        A greedy request goes on from its tokens so far (they join the prompt). A sampled one cannot:
        its generator is lost with the worker, and a fresh one seeded alike would draw the first tokens
        again. So it starts over from its prompt, and the tokens already published are regenerated,
        checked and dropped (`_drop_replayed`).
        """
        if live.spec.sampling_params.greedy:
            return self._make_request(live.spec, live.output_token_ids)
        live.replay = len(live.output_token_ids)
        self._num_replayed += 1 if live.replay else 0
        return self._make_request(live.spec, [])

    def _drop_replayed(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Strip the tokens of replaying requests that the client already has."""
        kept = []
        with self._cv:
            for o in outputs:
                if o.request_id in self._silenced:  # ended with an error already: drop its abort echo
                    if o.finished:
                        self._silenced.discard(o.request_id)
                    continue
                live = self._live.get(o.request_id)
                if live is None or live.replay == 0 or not o.new_token_ids:
                    kept.append(o)
                    continue
                start = len(live.output_token_ids) - live.replay
                n = min(live.replay, len(o.new_token_ids))
                if o.new_token_ids[:n] != live.output_token_ids[start:start + n]:
                    # Not the same stream (a numerical difference): tokens sent cannot be taken back.
                    if not o.finished:
                        self._silenced.add(o.request_id)
                        self.engine.abort([o.request_id])
                    kept.append(_error_output(o.request_id, (
                        f"request {o.request_id!r}: after a worker restart the replayed tokens differ from "
                        f"the ones already sent (at output position {start}); it cannot go on consistently")))
                    continue
                live.replay -= n
                rest = o.new_token_ids[n:]
                if rest or o.finished:
                    kept.append(replace(o, new_token_ids=rest))
        return kept

    def kv_pool_accounting(self) -> dict[str, Any]:
        """The block pool's books: free (uncached) + cached-free + held must equal the usable blocks.

        After a drain nothing may be held: `held` and `ref_count_total` are 0, and the manager's own
        consistency check (`invariant_error`) passes with no live request.
        """
        # The free queue must not change while it is walked; a busy loop is "not idle yet", not an error.
        if not self._engine_lock.acquire(timeout=5.0):
            return {"replica": self.replica, "idle": False, "busy": True}
        try:
            return self._pool_books()
        finally:
            self._engine_lock.release()

    def _pool_books(self) -> dict[str, Any]:
        with self._cv:
            if self.engine is None:
                return {"replica": self.replica, "error": "engine not started"}
            manager = self.engine.kv_cache_manager
            pool = manager.block_pool
            free = pool.free_block_queue.get_all_free_blocks()
            cached_free = sum(1 for b in free if b.block_hash is not None)
            held = [b for b in pool.blocks[1:] if b.ref_cnt > 0]
            idle = not self.engine.has_unfinished() and not self._live
            error = None
            if idle:
                try:
                    manager.check_invariants([])
                except AssertionError as e:
                    error = str(e)
            return {"replica": self.replica, "usable_blocks": pool.num_blocks - 1,
                    "free_uncached": len(free) - cached_free, "cached_free": cached_free,
                    "held": len(held), "ref_count_total": sum(b.ref_cnt for b in held),
                    "idle": idle, "invariant_error": error}

    def _fail_all(self, message: str) -> None:
        with self._cv:
            self._fatal = f"engine replica {self.replica} failed: {message}"
            for rid in list(self._live):
                self._outbox.append(_error_output(rid, self._fatal))
            self._live.clear()
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


def _error_output(rid: str, message: str) -> EngineCoreOutput:
    return EngineCoreOutput(rid, [], finished=True, finish_reason="error", error=message)


def driver_actor_class():
    """EngineDriver as a threaded Ray actor: the step loop plus concurrent client calls."""
    import ray

    return ray.remote(num_cpus=0, max_concurrency=16)(EngineDriver)


def _worker_death(e: BaseException) -> bool:
    from actors.transport import WorkerFailure

    return isinstance(e, WorkerFailure)
