"""One-way byte channels for the shm transport: a shared-memory ring on one node, ZMQ across nodes.

Both ends have one contract, so the transport and the worker loop never ask which one they hold:
  Sender.send(data, timeout_s)            raises RingTimeout when the reader does not take it in time
  Receiver.recv(timeout_s, should_stop)   the next message; None once should_stop() is true
  Receiver.try_recv(timeout_s)            the next message if one has begun to arrive, else None at once
Both raise RingClosed once the other side closed the channel. A ChannelSpec is what crosses to a
worker (plain data); `open_sender`/`open_receiver` turn it into an end there.

ZMQ: the driver binds (its node's IP is known), workers connect. PUSH/PULL with a bounded send queue:
TCP and ZMQ own their copies, so nothing is overwritten; a reader that stops reading fills the queue
and the send times out. An empty frame is the close message.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import zmq

from actors.transport.shm_ring import READ_SPIN_S, RingClosed, RingHandle, RingTimeout, ShmRing

POLL_MS = 100  # a blocked ZMQ receiver checks should_stop this often
SEND_HWM = 64


class Sender(Protocol):
    def send(self, data: bytes, timeout_s: float) -> None: ...
    def close(self) -> None: ...


class Receiver(Protocol):
    def recv(self, timeout_s: float | None = None, should_stop: Callable[[], bool] | None = None) -> bytes | None: ...
    def try_recv(self, timeout_s: float) -> bytes | None: ...
    def pollable(self) -> Any: ...  # what zmq.Poller waits on: a file descriptor or a ZMQ socket
    # Around a blocking wait on pollable(): begin_block, then try_recv once more, then the wait, then
    # end_block. A ring's writer rings a doorbell only while its reader is in between.
    def begin_block(self) -> None: ...
    def end_block(self) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class ChannelSpec:
    """A ring (handle + this reader's index) or a ZMQ address the driver bound; a receiver made from it
    spins (yielding) spin_s looking for a message before it blocks."""

    ring: RingHandle | None = None
    reader: int = 0
    zmq_addr: str | None = None
    spin_s: float = READ_SPIN_S


# ---- shared memory ------------------------------------------------------------------------------
class RingSender:
    def __init__(self, ring: ShmRing) -> None:
        self.ring = ring

    def send(self, data: bytes, timeout_s: float) -> None:
        self.ring.write(data, timeout_s)

    def close(self) -> None:
        self.ring.close()


class RingReceiver:
    def __init__(self, ring: ShmRing, reader: int, spin_s: float = READ_SPIN_S) -> None:
        self.ring = ring
        self.reader = reader
        self.spin_s = spin_s

    def recv(self, timeout_s: float | None = None, should_stop: Callable[[], bool] | None = None) -> bytes | None:
        return self.ring.read(self.reader, timeout_s, should_stop, self.spin_s)

    def try_recv(self, timeout_s: float) -> bytes | None:
        return self.ring.try_read(self.reader, timeout_s)

    def pollable(self) -> Any:
        return self.ring.doorbell_fd(self.reader)

    def begin_block(self) -> None:
        self.ring.begin_block(self.reader)

    def end_block(self) -> None:
        self.ring.end_block(self.reader)

    def close(self) -> None:
        self.ring.close()


# ---- ZMQ ----------------------------------------------------------------------------------------
def _socket(kind: int) -> zmq.Socket:
    sock: zmq.Socket = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def bind(kind: int, ip: str) -> tuple[zmq.Socket, str]:
    """A socket of `kind` bound to a free port on `ip`, and its address."""
    sock = _socket(kind)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    port = sock.bind_to_random_port(f"tcp://{ip}")
    return sock, f"tcp://{ip}:{port}"


def connect(kind: int, addr: str) -> zmq.Socket:
    sock = _socket(kind)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.connect(addr)
    return sock


class ZmqSender:
    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self._timeout_ms = -2

    def send(self, data: bytes, timeout_s: float) -> None:
        ms = max(1, int(timeout_s * 1000))
        if ms != self._timeout_ms:
            self.sock.setsockopt(zmq.SNDTIMEO, ms)
            self._timeout_ms = ms
        try:
            self.sock.send(data, 0, copy=len(data) < 65536)
        except zmq.Again:
            raise RingTimeout(
                f"the reader at {self.sock.last_endpoint!r} did not take a message in {timeout_s:g}s", [0]
            ) from None

    def close(self) -> None:
        try:
            self.sock.send(b"", zmq.NOBLOCK)  # the close message
        except zmq.ZMQError:
            pass
        self.sock.close(linger=2000)  # returns at once; ZMQ has this long to deliver the close message


class ZmqReceiver:
    def __init__(self, sock: zmq.Socket, spin_s: float = READ_SPIN_S) -> None:
        self.sock = sock
        self.spin_s = spin_s

    def recv(self, timeout_s: float | None = None, should_stop: Callable[[], bool] | None = None) -> bytes | None:
        start = time.monotonic()
        deadline = None if timeout_s is None else start + timeout_s
        while True:
            msg = self._take(zmq.NOBLOCK)
            if msg is not None:
                return msg
            if should_stop is not None and should_stop():
                return None
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise RingTimeout(f"no message from {self.sock.last_endpoint!r} in {timeout_s:g}s")
            if now < start + self.spin_s:
                os.sched_yield()
                continue
            # Block on the socket, waking to check should_stop and the deadline.
            left_ms = POLL_MS if deadline is None else max(1, min(POLL_MS, int((deadline - now) * 1000)))
            self.sock.poll(left_ms)

    def try_recv(self, timeout_s: float) -> bytes | None:
        return self._take(zmq.NOBLOCK)

    def pollable(self) -> Any:
        return self.sock

    def begin_block(self) -> None:
        pass  # the socket's readiness is its queue

    def end_block(self) -> None:
        pass

    def _take(self, flags: int) -> bytes | None:
        try:
            msg = self.sock.recv(flags, copy=True)
        except zmq.Again:
            return None
        if not msg:
            raise RingClosed(f"the sender at {self.sock.last_endpoint!r} closed the channel")
        return msg

    def close(self) -> None:
        self.sock.close()


# ---- a worker's ends ----------------------------------------------------------------------------
def open_receiver(spec: ChannelSpec) -> Receiver:
    if spec.ring is not None:
        return RingReceiver(ShmRing.attach(spec.ring), spec.reader, spec.spin_s)
    assert spec.zmq_addr is not None
    return ZmqReceiver(connect(zmq.PULL, spec.zmq_addr), spec.spin_s)


def open_sender(spec: ChannelSpec) -> Sender:
    """A worker's reply end: it writes a ring the driver created (reader 0 is the driver), or pushes to
    the driver's bound PULL socket."""
    if spec.ring is not None:
        return RingSender(ShmRing.attach(spec.ring))
    assert spec.zmq_addr is not None
    return ZmqSender(connect(zmq.PUSH, spec.zmq_addr))
