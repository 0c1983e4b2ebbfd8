"""Runs the workers without Ray: TP=1 in this process, TP>1 in spawned processes that talk over pipes.

The multi-process form is what tests tensor parallelism on one machine (gloo on CPU, or NCCL on local
GPUs). A worker's exception comes back to the caller with its rank and traceback; the executor then
stops every worker, since the others may be stuck in a collective waiting for the failed one.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from actors.config.engine import EngineConfig
from actors.errors import WorkerFailure
from actors.executor.base import Executor
from actors.worker.actor import Worker
from kvcore.messages import ModelRunnerOutput, SchedulerOutput

_SHUTDOWN = "__shutdown__"


class _Submitted:
    """A step sent to the worker processes whose answers are still in their pipes."""


def _worker_main(
    config: EngineConfig,
    rank: int,
    world_size: int,
    conn: Connection,
    num_threads: int,
    worker_cls: type[Any] = Worker,
) -> None:
    """Child process loop: call the requested Worker method, send back ("ok", result) or ("err", tb)."""
    import torch

    torch.set_num_threads(num_threads)
    device_index = rank if config.parallel.resolved_device() == "cuda" else None
    worker = worker_cls(config, rank, world_size, None, device_index=device_index)
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:
            break
        if method == _SHUTDOWN:
            worker.shutdown()
            conn.send(("ok", None))
            break
        try:
            result = getattr(worker, method)(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001 - everything goes back to the caller
            conn.send(("err", traceback.format_exc()))
    conn.close()


class LocalExecutor(Executor):
    def __init__(self, config: EngineConfig, poll_interval_s: float = 0.5, worker_cls: type[Any] = Worker) -> None:
        """`worker_cls`: the Worker contract's class (tests and benchmarks pass the no-op worker)."""
        self.config = config
        self.worker_cls = worker_cls
        self.world_size = config.parallel.ranks_per_engine  # pipeline stages x tensor-parallel ranks
        self._poll = poll_interval_s
        self._worker: Any = None
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._closed = False
        if self.world_size == 1:
            self._worker = worker_cls(config, 0, 1, None, device_index=None)
        else:
            self._spawn()
        try:
            self.collective_rpc("init_device", self._init_method())
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        threads = max(1, (os.cpu_count() or 1) // self.world_size)
        for rank in range(self.world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                name=f"kvray-worker-{rank}",
                daemon=True,
                args=(self.config, rank, self.world_size, child, threads, self.worker_cls),
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def _init_method(self) -> str | None:
        """The groups' address: rank 0's rendezvous store, on a port it bound at once (open_rendezvous)."""
        if self._worker is not None:
            return None
        self._conns[0].send(("open_rendezvous", (), {}))
        port = self._gather("open_rendezvous", ranks=[0])[0]
        return f"tcp://127.0.0.1:{port}"

    @property
    def worker(self) -> Any:
        """The in-process worker at TP=1 (tests look inside it); None when the ranks are processes."""
        return self._worker

    @property
    def processes(self) -> tuple[mp.process.BaseProcess, ...]:
        """The ranks' processes at TP>1 (empty at TP=1, and after shutdown)."""
        return tuple(self._procs)

    # ---- calls ------------------------------------------------------------------------------
    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        if self._closed:
            raise RuntimeError("LocalExecutor is shut down")
        if self._worker is not None:
            try:
                return [getattr(self._worker, method)(*args, **kwargs)]
            except Exception as e:
                raise WorkerFailure(0, f"raised in {method}: {e!r}") from e
        for conn in self._conns:
            conn.send((method, args, kwargs))
        return self._gather(method)

    def _gather(self, method: str, ranks: list[int] | None = None) -> list[Any]:
        """Every rank's answer to `method` in rank order (only `ranks`' when given: None for the rest)."""
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size) if ranks is None else ranks)
        # A live rank that never answers (a hung collective) must not block the caller forever; the
        # bound is generous because set-up calls (load_model) may legitimately take minutes.
        timeout_s = max(600.0, self.config.parallel.step_timeout_s)
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                ranks = sorted(pending)
                self._fail(
                    ranks[0] if len(ranks) == 1 else None,
                    f"rank(s) {ranks} did not answer {method} within {timeout_s:g}s",
                )
            # One wait on every pending pipe (woken by whichever answers first; no spinning), then a
            # liveness look at the silent ones.
            ready = set(mp_connection.wait([self._conns[r] for r in pending], timeout=self._poll))
            for rank in sorted(pending):
                conn, proc = self._conns[rank], self._procs[rank]
                if conn not in ready:
                    if not proc.is_alive():
                        self._fail(rank, f"died (exit code {proc.exitcode}) during {method}")
                    continue
                try:
                    status, payload = conn.recv()
                except EOFError:
                    self._fail(rank, f"closed its pipe during {method}")
                if status == "err":
                    self._fail(rank, f"raised in {method}:\n{payload}")
                results[rank] = payload
                pending.discard(rank)
        return results

    def _fail(self, rank: int | None, reason: str) -> None:
        # Other ranks may wait forever in a collective for the failed one: stop them all.
        self.shutdown(graceful=False)
        raise WorkerFailure(rank, reason)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        out: ModelRunnerOutput | None = self.collective_rpc("execute_model", scheduler_output)[self.answer_rank]
        return out

    def submit_step(self, scheduler_output: SchedulerOutput) -> Any:
        if self._worker is not None:
            return self.execute_model(scheduler_output)
        if self._closed:
            raise RuntimeError("LocalExecutor is shut down")
        for conn in self._conns:  # pipes keep order: each rank runs the submitted steps one after another
            conn.send(("execute_model", (scheduler_output,), {}))
        return _Submitted()

    def collect_step(self, handle: Any) -> ModelRunnerOutput | None:
        if not isinstance(handle, _Submitted):
            out: ModelRunnerOutput | None = handle
            return out
        answer: ModelRunnerOutput | None = self._gather("execute_model")[self.answer_rank]
        return answer

    # ---- teardown ---------------------------------------------------------------------------
    def shutdown(self, graceful: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if graceful and proc.is_alive():
                try:
                    conn.send((_SHUTDOWN, (), {}))
                    if conn.poll(10):
                        conn.recv()
                except (OSError, EOFError):
                    pass
            conn.close()
        for proc in self._procs:
            proc.join(timeout=10 if graceful else 1)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs, self._conns = [], []

    def __enter__(self) -> "LocalExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown(graceful=False)
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
