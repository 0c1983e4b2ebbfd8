"""The worker's side of the shm transport: a thread that reads each step, runs it, and answers.

A worker class mixes in ShmLoopMixin. `start_shm_loop(spec)` (a plain actor call) attaches to the
driver's channels and starts the loop thread; the actor's own thread stays free, so `ping`, the set-up
calls and the fault-injection seams keep working as under the compiled graph (whose loop also runs
beside the actor's thread). The driver waits for every rank's answer before it sends anything else,
so a plain call never runs while a step does.

Every rank answers every step: the answering rank (rank 0, or the last pipeline stage's first TP rank)
with its ModelRunnerOutput, the others with None, and a rank
whose step raised with (the error's repr, whether it is a CollectiveError): (ok, payload) in
actors/transport/codec.py's wire form.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from actors.errors import CollectiveError
from actors.transport.channels import ChannelSpec, Receiver, Sender, open_receiver, open_sender
from actors.transport.codec import decode_step, encode_answer
from actors.transport.shm_ring import RingClosed, RingTimeout

logger = logging.getLogger(__name__)

MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class ShmLoopSpec:
    rank: int
    steps: ChannelSpec  # the driver's broadcast, for this rank
    replies: ChannelSpec  # this rank's answers, to the driver
    reply_timeout_s: float
    answers: bool | None = None  # whether its output goes back (None: rank 0's does)


class ShmWorkerLoop:
    def __init__(self, worker: Any, spec: ShmLoopSpec) -> None:
        self.worker = worker
        self.spec = spec
        self._stop = threading.Event()
        self._steps: Receiver = open_receiver(spec.steps)
        self._replies: Sender = open_sender(spec.replies)
        self._thread = threading.Thread(target=self._run, name=f"kvray-shm-rank{spec.rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                data = self._steps.recv(None, self._stop.is_set)
                if data is None:
                    return
                self._replies.send(encode_answer(*self._step(decode_step(data))), self.spec.reply_timeout_s)
        except RingClosed:
            pass  # the driver closed the transport
        except RingTimeout as e:  # the driver stopped reading: it has given up on this group
            logger.warning("rank %d: shm loop ends: %s", self.spec.rank, e)
        except Exception:  # the driver sees the silence as a failed step and asks why
            logger.exception("rank %d: shm loop failed", self.spec.rank)
        finally:
            self._close()

    def _step(self, so: Any) -> tuple[bool, Any]:
        try:
            out = self.worker.execute_model(so)
        except Exception as e:  # noqa: BLE001 - a step that raised is answered, as other transports do
            text = repr(e)
            text = text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."
            return False, (text, isinstance(e, CollectiveError))
        answers = self.spec.rank == 0 if self.spec.answers is None else self.spec.answers
        return True, out if answers else None

    def _close(self) -> None:
        for end in (self._steps, self._replies):
            try:
                end.close()
            except Exception as e:  # noqa: BLE001 - teardown of a channel the driver already removed
                logger.debug("shm loop close: %s", e)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)


class ShmLoopMixin:
    """What a worker class needs for `ray.transport: shm`."""

    _shm_loop: ShmWorkerLoop | None = None

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def start_shm_loop(self, spec: ShmLoopSpec) -> int:
        """Attach to the driver's channels and start answering steps; -> this process's pid."""
        self.stop_shm_loop()
        self._shm_loop = ShmWorkerLoop(self, spec)
        return os.getpid()

    def stop_shm_loop(self) -> None:
        if self._shm_loop is not None:
            self._shm_loop.stop()
            self._shm_loop = None
