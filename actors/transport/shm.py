"""`ray.transport: shm`: each step's SchedulerOutput goes out once, one way, without Ray in the hot path.

- Ranks on the driver's node read one shared-memory ring (actors/transport/shm_ring.py), every reader
  acknowledging each chunk before its slot is reused; ranks on other nodes get the same bytes over ZMQ.
- Every rank answers on a channel of its own (a one-reader ring on this node, ZMQ from other nodes):
  the answering rank (rank 0; with pipeline stages the last stage's first TP rank) with its
  ModelRunnerOutput, the others with None or their step's error.
- Ray places the workers, starts and kills them; the transport only attaches to them
  (`start_shm_loop`, actors/transport/shm_reader.py) once they are up.

Failures, as on the other transports: an answer that does not come within step_timeout_s, a reader that
does not acknowledge in time (stalled) and a rank whose process died all raise WorkerFailure naming the
rank (diagnosed with Ray pings, which the actor's free main thread answers); while a step waits, a
liveness check runs every LIVENESS_S so a death is reported in about that long, not at the timeout. A
rank whose step raised gives StepError once every rank has answered (WorkerFailure if a collective failed:
actors.transport.broadcast.step_failure). After a failure the transport stays
broken, as the others do. Steps and answers travel in actors/transport/codec.py's wire form (marshal).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Sequence

import ray
import zmq
from ray.exceptions import RayActorError

from actors.errors import WorkerFailure
from actors.transport.broadcast import Transport, diagnose, first_line, step_failure
from actors.transport.channels import (
    ChannelSpec,
    Receiver,
    RingReceiver,
    RingSender,
    Sender,
    ZmqReceiver,
    ZmqSender,
    bind,
)
from actors.transport.codec import decode_answer, encode_step
from actors.transport.shm_reader import ShmLoopSpec
from actors.transport.shm_ring import RingClosed, RingTimeout, ShmRing
from kvcore.messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

LIVENESS_S = 0.5  # while a step waits longer than this, check the ranks are alive this often
SETUP_TIMEOUT_S = 60.0  # attaching the workers to their channels
BROADCAST_SLOTS, BROADCAST_SLOT_BYTES = 8, 1 << 18
REPLY_SLOTS, REPLY_SLOT_BYTES = 4, 1 << 16


# How long each party (the driver for answers, a rank for the next step) spins, yielding, before it blocks:
# long enough to cover the other side's turn (a rank's step; the driver's update + schedule between steps),
# since a wake-up from a blocking wait costs tens of microseconds each way (a sleeping core, the scheduler).
# With fewer cores than twice the parties the spinners would take CPU from the parties doing the work.
SPIN_S = 1e-3
SHORT_SPIN_S = 20e-6


def default_spin_s(n_workers: int) -> float:
    return SPIN_S if len(os.sched_getaffinity(0)) >= 2 * (n_workers + 1) else SHORT_SPIN_S


class ShmTransport(Transport):
    name = "shm"

    def __init__(
        self,
        workers: Sequence[Any],
        step_timeout_s: float,
        force_zmq: bool = False,
        spin_s: float | None = None,
        answer_rank: int = 0,
        max_in_flight: int = 1,
    ) -> None:
        super().__init__(workers, step_timeout_s, answer_rank)
        # Steps submitted and not yet collected: each needs a broadcast slot until every rank read it, and
        # a rank may answer all of them before the driver reads the first answer.
        self._broadcast_slots = max(BROADCAST_SLOTS, max_in_flight + 1)
        self._reply_slots = max(REPLY_SLOTS, max_in_flight + 1)
        self.spin_s = default_spin_s(len(workers)) if spin_s is None else spin_s
        self._ring: ShmRing | None = None
        self._senders: list[Sender] = []  # the broadcast: the ring (if any) + one per remote rank
        self._replies: list[Receiver | None] = [None] * len(self.workers)  # per rank
        self._owned_rings: list[ShmRing] = []
        try:
            self._attach(force_zmq)
        except BaseException:
            self.close()
            raise

    # ---- set-up -----------------------------------------------------------------------------
    def _attach(self, force_zmq: bool) -> None:
        here = ray.get_runtime_context().get_node_id()
        nodes = self._setup_call([w.node_id.remote() for w in self.workers], "node_id")
        local = [r for r, n in enumerate(nodes) if n == here and not force_zmq]
        ip = ray.util.get_node_ip_address()
        specs: dict[int, ShmLoopSpec] = {}
        if local:
            self._ring = ShmRing.create(len(local), self._broadcast_slots, BROADCAST_SLOT_BYTES)
            self._owned_rings.append(self._ring)
            self._senders.append(RingSender(self._ring))
        for rank in range(len(self.workers)):
            if rank in local:
                reply = ShmRing.create(1, self._reply_slots, REPLY_SLOT_BYTES)
                self._owned_rings.append(reply)
                self._replies[rank] = RingReceiver(reply, 0)
                assert self._ring is not None
                steps = ChannelSpec(ring=self._ring.handle, reader=local.index(rank), spin_s=self.spin_s)
                replies = ChannelSpec(ring=reply.handle)
            else:
                push, push_addr = bind(zmq.PUSH, ip)
                self._senders.append(ZmqSender(push))
                pull, pull_addr = bind(zmq.PULL, ip)
                self._replies[rank] = ZmqReceiver(pull)
                steps, replies = ChannelSpec(zmq_addr=push_addr, spin_s=self.spin_s), ChannelSpec(zmq_addr=pull_addr)
            specs[rank] = ShmLoopSpec(rank, steps, replies, self.step_timeout_s, answers=rank == self.answer_rank)
        self._setup_call([w.start_shm_loop.remote(specs[r]) for r, w in enumerate(self.workers)], "start_shm_loop")
        self._remote_ranks = [r for r in range(len(self.workers)) if r not in local]
        self._poller = zmq.Poller()
        for chan in self._replies:
            assert chan is not None
            self._poller.register(chan.pollable(), zmq.POLLIN)
        logger.info("shm transport: ranks %s through shared memory, %s through ZMQ", local, self._remote_ranks)

    def _setup_call(self, refs: list[Any], method: str) -> list[Any]:
        try:
            return ray.get(refs, timeout=SETUP_TIMEOUT_S)
        except (RayActorError, ray.exceptions.GetTimeoutError) as e:
            rank, why = diagnose(self.workers)
            raise WorkerFailure(rank, f"{why} (while attaching the shm transport: {method}: {first_line(e)})") from None

    # ---- the step ---------------------------------------------------------------------------
    def _submit(self, so: SchedulerOutput) -> Any:
        data = encode_step(so)
        deadline = time.monotonic() + self.step_timeout_s
        for sender in self._senders:
            try:
                sender.send(data, max(0.001, deadline - time.monotonic()))
            except RingTimeout as e:
                raise self._fail_unread(so.step_id, sender, e) from None
        return deadline

    def _fail_unread(self, step_id: int, sender: Sender, e: RingTimeout) -> WorkerFailure:
        if isinstance(sender, RingSender):
            local = [r for r in range(len(self.workers)) if r not in self._remote_ranks]
            slow = [local[i] for i in e.readers]
        else:
            slow = [self._remote_ranks[self._senders.index(sender) - (1 if self._ring else 0)]]
        rank, why = diagnose(self.workers)
        if rank is not None and "did not answer" not in why:
            return WorkerFailure(rank, f"{why} (while sending step {step_id})")
        return WorkerFailure(
            slow[0] if slow else rank,
            f"rank(s) {slow} did not read step {step_id} within parallel.step_timeout_s="
            f"{self.step_timeout_s:g}s (a stalled reader; {why})",
        )

    def _collect(self, so: SchedulerOutput, deadline: float) -> ModelRunnerOutput:
        answers: dict[int, tuple[bool, Any]] = {}
        next_check = time.monotonic() + LIVENESS_S
        pings: list[Any] | None = None
        spin_until = time.monotonic() + self.spin_s
        while len(answers) < len(self.workers):
            got = self._poll(answers, deadline, so.step_id)
            now = time.monotonic()
            if got:
                continue
            if now < spin_until:
                os.sched_yield()
                continue
            if now > deadline:
                raise self._fail_late(so.step_id, [r for r in range(len(self.workers)) if r not in answers])
            if now >= next_check:
                pings = self._check_alive(pings, answers, so.step_id)
                next_check = now + LIVENESS_S
            self._block(answers, deadline, min(deadline, next_check), so.step_id)
        errors = [(r, *payload) for r, (ok, payload) in sorted(answers.items()) if not ok]
        if errors:
            raise step_failure(errors)
        return answers[self.answer_rank][1]

    def _block(self, answers: dict[int, Any], deadline: float, until: float, step_id: int) -> None:
        """Sleep in the kernel until an answer channel may have something, or `until`."""
        # Every channel, the answered ones too (begin_block empties its doorbell): a bell left in one
        # would wake the poller at once, for ever.
        chans = [chan for chan in self._replies if chan is not None]
        for chan in chans:
            chan.begin_block()
        try:
            # Look once more: an answer written before its writer saw the flag rang no bell.
            if not self._poll(answers, deadline, step_id):
                self._poller.poll(max(1, int((until - time.monotonic()) * 1000)))
        finally:
            for chan in chans:
                chan.end_block()

    def _fail_late(self, step_id: int, pending: list[int]) -> WorkerFailure:
        rank, why = diagnose(self.workers)
        if rank is not None and "did not answer" not in why:
            return WorkerFailure(rank, f"{why} (while running step {step_id})")
        return WorkerFailure(
            pending[0],
            f"step {step_id} did not finish within parallel.step_timeout_s="
            f"{self.step_timeout_s:g}s: no answer from rank(s) {pending} ({why})",
        )

    def _poll(self, answers: dict[int, tuple[bool, Any]], deadline: float, step_id: int) -> bool:
        got = False
        for rank, chan in enumerate(self._replies):
            if rank in answers or chan is None:
                continue
            try:
                data = chan.try_recv(max(0.001, deadline - time.monotonic()))
            except (RingClosed, RingTimeout) as e:
                raise WorkerFailure(rank, f"its answer channel broke during step {step_id} ({e})") from None
            if data is not None:
                answers[rank] = decode_answer(data)
                got = True
        return got

    def _check_alive(self, pings: list[Any] | None, answers: dict[int, Any], step_id: int) -> list[Any]:
        """Look at the pings sent at the last check (a dead actor's fails at once); send new ones."""
        if pings is not None:
            ready, _ = ray.wait(pings, num_returns=len(pings), timeout=0)
            for ref in ready:
                rank = pings.index(ref)
                try:
                    ray.get(ref)
                except RayActorError as e:
                    raise WorkerFailure(
                        rank, f"its actor died ({first_line(e)}) (while running step {step_id})"
                    ) from None
        return [w.ping.remote() for w in self.workers]

    # ---- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        if self.failure is None:
            # Tell the loops to end (they hold no state worth keeping) before the rings go away.
            refs = [w.stop_shm_loop.remote() for w in self.workers]
            for sender in self._senders:
                _quietly(sender.close)
            ray.wait(refs, num_returns=len(refs), timeout=5)
        else:
            for sender in self._senders:
                _quietly(sender.close)
        for chan in self._replies:
            if chan is not None:
                _quietly(chan.close)
        for ring in self._owned_rings:
            _quietly(ring.close)
        self._senders, self._replies, self._owned_rings = [], [], []


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - teardown goes on past a channel that is already gone
        logger.debug("shm transport close: %s", e)
