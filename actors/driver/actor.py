"""The driver actor of one engine replica: EngineCore (scheduler + KV-cache manager) over a RayExecutor.

It is a threaded Ray actor. `start()` starts the TP workers in the placement group the client reserved
for it (the client owns and removes it, so a driver killed from outside leaks nothing); then a
background thread runs the step loop, while client calls (add_requests, abort, get_outputs, stats)
run on other actor threads. Client calls never wait for a step: new requests and aborts go through an
inbox that the loop drains before each step, and outputs wait in an outbox until the client polls.

The driver itself is inbox -> step -> outbox, composed of the objects it holds: the Mailbox (the inbox,
the outbox and the books on live requests, actors/driver/mailbox.py), the Recovery from a failed step
(actors/driver/recovery.py), which the PoisonIsolation (actors/driver/poison.py) serves when a step
raised with every worker alive. What it offers beside the step path (killing a worker for the stress
run, profiles, the block pool's books) is actors/driver/debug.py; the types the client sends and
receives are actors/messages.py.

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
from actors.driver import debug
from actors.driver.live_requests import make_request
from actors.driver.mailbox import Mailbox
from actors.driver.poison import EngineSteps, PoisonIsolation
from actors.driver.recovery import EngineHooks, Recovery
from actors.errors import WorkerFailure
from actors.gc_heap import freeze_startup_heap
from actors.messages import DEFAULT_CLIENT, DOWN, MAX_CLIENT_ID_LEN, REBUILDING, PollResult, RequestSpec
from actors.verbose_logging import show_kvray_info_logs
from kvcore.kv_cache.block_pool import BlockPool
from kvcore.messages import EngineCoreOutput
from kvcore.request import (
    RequestValidationError,
    SamplingParams,
    check_request_id,
    check_token_ids,
    check_vocab_fields,
    validate,
)

if TYPE_CHECKING:
    from actors.driver.engine_core import EngineCore
    from actors.driver.metrics import EngineMetrics

logger = logging.getLogger(__name__)


class EngineDriver:
    def __init__(
        self, config: EngineConfig, placement_group: Any, replica: int = 0, worker_cls: str = DEFAULT_WORKER_CLS
    ) -> None:
        show_kvray_info_logs()  # kvray -v: the engine's INFO lines reach the console
        if os.environ.get("KVRAY_VERBOSE") != "1":
            # Tearing down a compiled graph whose worker died (kvray stress kills them on purpose) logs
            # "Error cancelling worker task" with two tracebacks; the failure is reported once, below.
            logging.getLogger("ray.dag.compiled_dag_node").setLevel(logging.CRITICAL)
        self.config = config
        self.replica = replica
        self.worker_cls = worker_cls
        self.pg = placement_group
        self.engine: EngineCore | None = None
        self.info: dict[str, Any] = {}
        # Held by the step loop while it touches the engine; a client call that walks the engine's
        # internals (kv_pool_accounting) takes it too. Order: _engine_lock before the mailbox's, never after.
        self._engine_lock = threading.Lock()
        self._mailbox = Mailbox()
        self._poison = PoisonIsolation(replica, self._mailbox, self._requeue)
        self._recovery = Recovery(
            config,
            replica,
            placement_group,
            self._mailbox,
            self._poison,
            EngineHooks(
                engine=self._running_engine,
                shut_down=self._shut_down_engine,
                build=self._build_engine,
                requeue=self._requeue,
                record_restart=self._record_restart,
            ),
        )
        self._thread: threading.Thread | None = None
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
            engine = EngineCore(self.config, executor)
        except BaseException:
            executor.shutdown()
            raise
        self.engine = engine
        # A new engine's first events reset the routers' picture of this replica (a rebuild starts empty).
        self._pool(engine).enable_cache_events()
        hf = executor.probe.hf_config
        eos = hf.get("eos_token_id")
        self.info = {
            "replica": self.replica,
            "node_ip": executor.probe.node_ip,
            "model_dir": executor.probe.model_dir,
            "vocab_size": hf.get("vocab_size"),
            "eos_token_id": eos[0] if isinstance(eos, list) and eos else eos,
            "num_blocks": engine.kv_cache_config.num_blocks,
            "max_model_len": engine.max_model_len,
            "transport": self.config.ray.transport,
        }

    # ---- client calls -----------------------------------------------------------------------
    def add_requests(self, specs: list[RequestSpec]) -> list[str | None]:
        """Queue requests; a refused one gets its message here (and no output), the rest go on.

        No error output is streamed for a refusal: its id may be a duplicate of a live request, whose
        own stream must not appear to end.
        """
        return self._mailbox.submit(specs, self._check)

    def _check(self, spec: RequestSpec) -> str | None:
        """Everything a request carries is checked again here: a client's objects are not trusted."""
        rid = spec.request_id
        fatal, unavailable = self._mailbox.fatal, self._mailbox.unavailable
        if fatal is not None:
            return f"engine replica {self.replica} {DOWN}: {fatal}"
        if unavailable is not None:
            return f"engine replica {self.replica} {REBUILDING}: {unavailable}"
        err = check_request_id(rid)
        if err is not None:
            return err
        if not isinstance(spec.client_id, str) or len(spec.client_id) > MAX_CLIENT_ID_LEN:
            return f"request {rid!r}: client_id must be a string of at most {MAX_CLIENT_ID_LEN} characters"
        if rid in self._mailbox:
            return f"request {rid!r}: request_id is already in use by an unfinished request"
        if not isinstance(spec.sampling_params, SamplingParams):
            return f"request {rid!r}: sampling_params must be a SamplingParams"
        try:
            validate(spec.sampling_params)
        except RequestValidationError as e:
            return f"request {rid!r}: {e}"
        vocab = self.info.get("vocab_size")
        # A stop id past the vocabulary would index past the logits where min_tokens bans it (a worker error).
        err = check_token_ids("prompt_token_ids", spec.prompt_token_ids, vocab) or check_token_ids(
            "stop_token_ids", list(spec.sampling_params.stop_token_ids), vocab
        )
        if err is None and spec.output_token_ids:
            err = check_token_ids("output_token_ids", spec.output_token_ids, vocab)
        if err is None:
            err = check_vocab_fields(spec.sampling_params, vocab)
        return None if err is None else f"request {rid!r}: {err}"

    def abort(self, request_ids: Iterable[str]) -> None:
        self._mailbox.abort(request_ids)

    def get_outputs(self, timeout_s: float = 1.0, client_id: str = DEFAULT_CLIENT) -> PollResult:
        """This client's outputs since its last call; waits up to timeout_s for the first one."""
        return self._mailbox.poll(timeout_s, client_id)

    def release_client(self, client_id: str) -> None:
        """A client went away for good (an ingress replica stopped): its unfinished requests are aborted
        and its outbox goes, so that nothing piles up for a reader that will never come."""
        self._mailbox.abort(self._mailbox.forget_client(client_id))

    def hand_back(self, why: str) -> None:
        """Give every live request back to its client (which moves it to another replica, token-exact) and
        refuse new ones: the replica is being removed and its running streams ran past their drain bound."""
        self._mailbox.hand_back(why)

    def num_undelivered(self) -> int:
        """Outputs and notices that still wait for their clients' polls (a replica being removed waits
        for none before it goes)."""
        return self._mailbox.num_undelivered

    def stats(self) -> dict[str, Any]:
        base = dict(self.engine.stats()) if self.engine is not None else {}
        base.update(
            replica=self.replica,
            worker_restarts=self._recovery.restarts,
            fatal=self._mailbox.fatal,
            peak_kv_cache_usage=self._mailbox.peak_kv_usage,
            num_output_tokens=self._mailbox.num_output_tokens,
            num_live_requests=len(self._mailbox),
            num_replayed=self._mailbox.num_replayed,
            num_clients=len(self._mailbox.clients),
        )
        return base

    # ---- beside the step path (actors/driver/debug.py) --------------------------------------
    def kill_worker(self, rank: int) -> None:
        """Kill one TP worker actor, as a crashed process would (`kvray stress` does, to test recovery)."""
        debug.kill_worker(self._started_engine(), rank)

    def worker_call(self, rank: int, method: str, *args: Any) -> Any:
        """Call one worker's method (benchmarks read its step timings; tests reach its fault seams)."""
        return debug.worker_call(self._started_engine(), rank, method, *args)

    def start_profile(self, trace_dir: str, num_steps: int = 5, skip_steps: int = 0) -> None:
        """Every worker traces its next `num_steps` steps after `skip_steps` (see Worker.start_profile)."""
        debug.start_profile(self._started_engine(), trace_dir, num_steps, skip_steps)

    def stop_profile(self) -> list[str]:
        """End the workers' traces; the files written (on each worker's node)."""
        return debug.stop_profile(self._started_engine())

    def kv_pool_accounting(self) -> dict[str, Any]:
        """The block pool's books (see debug.pool_books); a busy loop is "not idle yet", not an error."""
        if not self._engine_lock.acquire(timeout=5.0):
            return {"replica": self.replica, "idle": False, "busy": True}
        try:
            return debug.pool_books(self.engine, self.replica, no_live_request=len(self._mailbox) == 0)
        finally:
            self._engine_lock.release()

    # ---- the step loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            work = self._mailbox.next_work(lambda: self._started_engine().has_unfinished())
            if work is None:
                return
            new, aborts = work
            with self._engine_lock:
                try:
                    engine = self._started_engine()
                    self._admit(engine, new, aborts)
                    t0 = time.monotonic()
                    outputs = engine.step()
                    self._publish(engine, outputs, time.monotonic() - t0)
                except Exception as e:  # a worker failure or an engine bug: never silent
                    # A dead worker (kvray stress kills them on purpose) is reported in one line; any
                    # other failure, or KVRAY_VERBOSE=1 (kvray -v), keeps its traceback.
                    logger.error(
                        "engine replica %d: step failed: %s",
                        self.replica,
                        e,
                        exc_info=not isinstance(e, WorkerFailure) or os.environ.get("KVRAY_VERBOSE") == "1",
                    )
                    if not self._recovery.recover(e):
                        return

    def _admit(self, engine: EngineCore, new: list[RequestSpec], aborts: list[str]) -> None:
        for spec in new:
            try:
                engine.add_request(make_request(spec, [], self.info.get("eos_token_id")))
            except Exception as e:  # noqa: BLE001 - one bad request fails alone
                self._mailbox.finish_with_error(spec.request_id, f"request {spec.request_id!r} rejected: {e}")
        aborts = self._poison.abort_held(aborts)
        if aborts:
            engine.abort(aborts)

    def _publish(self, engine: EngineCore, outputs: list[EngineCoreOutput], step_time: float) -> None:
        outputs = self._mailbox.drop_replayed(outputs, engine.abort)
        self._poison.progress(outputs)
        stats = engine.stats()
        pool = self._pool(engine)
        new_tokens = self._mailbox.publish(
            outputs, float(stats.get("kv_cache_usage", 0.0)), pool.take_cache_events(), pool.cached_event_keys
        )
        assert self._metrics is not None  # start() sets it before the loop runs
        self._metrics.record_step(stats, step_time, new_tokens)
        if not engine.has_unfinished():
            self._metrics.flush()  # idle from now on: export the last window at once

    # ---- what the recovery and the poison isolation ask of the driver ------------------------
    def _started_engine(self) -> EngineCore:
        assert self.engine is not None, "start() builds the engine before the loop runs"
        return self.engine

    @staticmethod
    def _pool(engine: EngineCore) -> BlockPool:
        return engine.kv_cache_manager.block_pool

    def _running_engine(self) -> EngineSteps:
        return self._started_engine()

    def _shut_down_engine(self) -> None:
        self._started_engine().shutdown()

    def _requeue(self, rid: str) -> None:
        self._mailbox.requeue(rid, self._started_engine().add_request, self.info.get("eos_token_id"))

    def _record_restart(self) -> None:
        assert self._metrics is not None  # restarts happen on the loop that start() began
        self._metrics.record_restart()

    # ---- teardown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._mailbox.stop()
        if self._thread is not None:
            self._thread.join(timeout=self.config.parallel.step_timeout_s + 5)
        self._release()

    def _release(self) -> None:
        if self.engine is not None:
            try:
                self.engine.shutdown()
            except Exception as e:  # noqa: BLE001 - workers may already be gone
                logger.debug("engine shutdown: %s", e)


def driver_actor_class() -> Any:
    """EngineDriver as a threaded Ray actor: the step loop plus concurrent client calls."""
    import ray

    # Ray's overloads of remote() type the task options only; max_concurrency is an actor option.
    return ray.remote(num_cpus=0, max_concurrency=16)(EngineDriver)  # type: ignore[call-overload]
