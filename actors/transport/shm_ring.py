"""A one-writer, N-reader ring buffer in shared memory, where every reader acknowledges what it read.

Layout of the segment (int64 words first, then the slots):
  word 0              closed flag (set by the owner at close: every waiter leaves with RingClosed)
  word 1              write_seq: chunks published so far
  words 2 .. 2+N-1    read_seq[r]: chunks reader r has copied out (its acknowledgement)
  words 2+N .. 2+2N-1 asleep[r]: reader r is about to block, or blocked, on its doorbell
  slots               n_slots x slot_bytes; a slot holds [nbytes int64][last int64][payload]

Chunk s lives in slot s % n_slots. The writer publishes chunk s only when every reader has acknowledged
chunk s - n_slots (s - min(read_seq) < n_slots), so a slot is never reused while any reader may still
be reading it (nano-vllm's shm RPC has no such acknowledgement: nano-vllm#246). A reader acknowledges
a chunk only after copying it out. A message larger than a slot goes out as consecutive chunks; the
reader joins them. Unlike vLLM's MessageQueue (per-slot written/read flags, overflow to ZMQ), the state
is one counter per party: each word has a single writer, so no atomics are needed beyond aligned 8-byte
stores, and a fence (a lock round trip, as vLLM does) orders payload and counter.

A reader that does not acknowledge within the writer's timeout (dead or stalled) is named in
RingTimeout: the caller decides who is at fault. A waiting reader spins spin_s (yielding: the core and
the GIL are offered to others), then blocks on its doorbell, a FIFO beside the segment that the writer
rings (one byte): the kernel wakes it at once, where sleeping in a loop costs milliseconds on a loaded
machine; but a wake-up still costs tens of microseconds, so where cores allow the transport spins long
enough to cover the other side's turn (actors/transport/shm.py). The writer rings only the readers whose
asleep flag is set: a spinning reader sees the counter without a system call. The handshake is Dekker's:
the reader sets its flag, fences, then looks at write_seq once more before it blocks; the writer stores
write_seq, fences, then reads the flags. With both fences one of the two sees the other's store, so a
reader never blocks on a chunk whose bell was skipped. (A lock round trip is a full barrier on x86; where
it orders less, a missed bell costs at most BELL_POLL_S, the blocked reader's own look-again interval.)
The writer, waiting for acknowledgements (the ring full: rare), polls.
"""

from __future__ import annotations

import os
import select
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Callable
from unittest.mock import patch

from actors.transport import shm_sweep

_HEAD = struct.Struct("qq")  # a slot's nbytes, last
_FENCE = threading.Lock()
SPIN_S = 0.002  # the writer spins (yielding) this long waiting for acknowledgements, then sleeps
SLEEP_S = 50e-6  # at this interval
IDLE_SLEEP_S = 1e-3  # after IDLE_AFTER_S of nothing
IDLE_AFTER_S = 1.0
READ_SPIN_S = 20e-6  # by default a reader spins (yielding) this long before it blocks on its doorbell
BELL_POLL_S = 0.1  # a blocked reader wakes this often to check should_stop and its deadline


def fence() -> None:
    """A full memory barrier: a lock acquire/release is an atomic read-modify-write."""
    _FENCE.acquire()
    _FENCE.release()


class RingClosed(RuntimeError):
    """The ring's owner closed it while this party waited."""


class RingTimeout(TimeoutError):
    """A wait ran past its timeout. For the writer, `readers` are those that had not acknowledged."""

    def __init__(self, message: str, readers: list[int] | None = None) -> None:
        super().__init__(message)
        self.readers = readers or []


@dataclass(frozen=True)
class RingHandle:
    """What a process needs to attach to a ring (sent to the workers)."""

    name: str
    n_readers: int
    n_slots: int
    slot_bytes: int

    def doorbell(self, reader: int) -> str:
        return f"/dev/shm/{self.name}_bell{reader}"

    @property
    def size(self) -> int:
        return 8 * (2 + 2 * self.n_readers) + self.n_slots * self.slot_bytes


class Waiter:
    """Spin, then sleep: low latency for a message that comes soon, little CPU for one that does not."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def pause(self) -> float:
        """Wait a little; -> seconds since the wait began."""
        waited = time.monotonic() - self.start
        if waited < SPIN_S:
            os.sched_yield()
        else:
            time.sleep(SLEEP_S if waited < IDLE_AFTER_S else IDLE_SLEEP_S)
        return waited


class ShmRing:
    def __init__(self, handle: RingHandle, shm: shared_memory.SharedMemory, owner: bool) -> None:
        if handle.slot_bytes <= _HEAD.size or handle.n_slots < 1 or handle.n_readers < 1:
            raise ValueError(f"ShmRing: {handle} needs n_readers >= 1, n_slots >= 1, slot_bytes > {_HEAD.size}")
        self.handle = handle
        self._shm = shm
        self._buf: memoryview = shm.buf  # type: ignore[assignment]  # None only after close
        self._owner = owner
        self._closed = False
        n = handle.n_readers
        self._words = self._buf[: 8 * (2 + 2 * n)].cast("q")
        self._asleep_at = 2 + n  # the word index of asleep[0]
        self._asleep = self._buf[8 * (2 + n) : 8 * (2 + 2 * n)]  # the flags as bytes: one compare for all
        self._nobody_asleep = bytes(8 * n)
        self._slots_at = 8 * (2 + 2 * n)
        self._acked = 0  # a lower bound of min(read_seq): acknowledgements only grow
        self._payload = handle.slot_bytes - _HEAD.size
        self._broken: str | None = None
        self._bells_out: list[int] | None = None  # the writer's ends, opened on first write
        self._bells_in: dict[int, int] = {}  # a reader's end of its own doorbell
        self._owner_lock: int | None = None  # held while the owner lives (actors/transport/shm_sweep.py)

    @classmethod
    def create(cls, n_readers: int, n_slots: int = 8, slot_bytes: int = 1 << 18) -> ShmRing:
        shm_sweep.sweep_once()  # what owners killed from outside left behind
        handle = RingHandle(f"kvray_{os.getpid()}_{os.urandom(6).hex()}", n_readers, n_slots, slot_bytes)
        shm = shared_memory.SharedMemory(name=handle.name, create=True, size=handle.size)
        for r in range(n_readers):
            os.mkfifo(handle.doorbell(r), 0o600)
        ring = cls(handle, shm, owner=True)
        ring._owner_lock = shm_sweep.hold_owner_lock(handle.name)
        return ring

    @classmethod
    def attach(cls, handle: RingHandle) -> ShmRing:
        # Python < 3.13 registers an attached segment with the resource tracker, which would unlink it
        # when this process exits (and a child shares its parent's tracker); the creator owns its lifetime.
        with patch("multiprocessing.resource_tracker.register", lambda *args, **kwargs: None):
            shm = shared_memory.SharedMemory(name=handle.name)
        return cls(handle, shm, owner=False)

    # ---- state ------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._words[0] != 0

    def _check_open(self) -> None:
        if self._words[0] != 0:
            raise RingClosed(f"ring {self.handle.name} was closed")

    def lagging_readers(self) -> list[int]:
        """Readers that have not acknowledged every chunk written so far."""
        w = self._words[1]
        return [r for r in range(self.handle.n_readers) if self._words[2 + r] < w]

    # ---- writer -----------------------------------------------------------------------------
    def write(self, data: bytes | memoryview, timeout_s: float) -> None:
        """Publish one message; waits (at most timeout_s in all) for slots every reader has released.

        After a RingTimeout part of a message may be out: the ring refuses later writes."""
        if self._broken is not None:
            raise RingClosed(f"ring {self.handle.name} is unusable after an earlier timeout: {self._broken}")
        deadline = time.monotonic() + timeout_s
        if len(data) <= self._payload:  # one chunk: the common case, without the slicing below
            self._put(data, True, deadline)
            return
        view = memoryview(data).cast("B")
        n, off = len(view), 0
        while True:
            part = min(self._payload, n - off)
            self._put(view[off : off + part], off + part == n, deadline)
            off += part
            if off == n:
                return

    def _put(self, chunk: bytes | memoryview, last: bool, deadline: float) -> None:
        words, n_slots = self._words, self.handle.n_slots
        seq = words[1]
        if seq - self._acked >= n_slots:  # the bound says full: look at the acknowledgements themselves
            self._wait_for_slot(seq, deadline)
        at = self._slots_at + (seq % n_slots) * self.handle.slot_bytes
        buf = self._buf
        _HEAD.pack_into(buf, at, len(chunk), int(last))
        buf[at + _HEAD.size : at + _HEAD.size + len(chunk)] = chunk
        fence()  # the payload is visible before the counter that publishes it
        words[1] = seq + 1
        fence()  # the counter is visible before the asleep flags are read (the handshake's writer half)
        self._ring_bells(sleepers_only=True)

    def _wait_for_slot(self, seq: int, deadline: float) -> None:
        words, n_slots = self._words, self.handle.n_slots
        read = range(2, 2 + self.handle.n_readers)
        waiter: Waiter | None = None
        while True:
            self._acked = min(words[i] for i in read)
            if seq - self._acked < n_slots:
                return
            self._check_open()
            waiter = waiter or Waiter()
            waiter.pause()
            if time.monotonic() > deadline:
                slow = [i - 2 for i in read if seq - words[i] >= n_slots]
                self._broken = (
                    f"reader(s) {slow} did not acknowledge chunk {seq - n_slots} of ring {self.handle.name} in time"
                )
                raise RingTimeout(self._broken, slow)

    def _ring_bells(self, sleepers_only: bool = False) -> None:
        if sleepers_only and bytes(self._asleep) == self._nobody_asleep:
            return  # every reader is awake (spinning or busy): each looks at write_seq before it blocks
        words, first = self._words, self._asleep_at
        for r in range(self.handle.n_readers):
            if sleepers_only and not words[first + r]:
                continue  # awake (spinning or busy): it looks at write_seq before it blocks
            try:
                os.write(self._bell_out(r), b"\0")
            except BlockingIOError:
                pass  # the pipe is full of rings the reader has not drained: it will wake anyway

    def _bell_out(self, reader: int) -> int:
        if self._bells_out is None:
            # O_RDWR: opening a FIFO so never blocks, whether or not its reader has it open yet.
            try:
                self._bells_out = [
                    os.open(self.handle.doorbell(r), os.O_RDWR | os.O_NONBLOCK) for r in range(self.handle.n_readers)
                ]
            except FileNotFoundError:
                raise RingClosed(f"ring {self.handle.name} was removed by its owner") from None
        return self._bells_out[reader]

    # ---- readers ----------------------------------------------------------------------------
    def read(
        self,
        reader: int,
        timeout_s: float | None = None,
        should_stop: Callable[[], bool] | None = None,
        spin_s: float = READ_SPIN_S,
    ) -> bytes | None:
        """The next message for `reader`, acknowledged; None if should_stop() turned true first.

        Raises RingTimeout after timeout_s (None: wait for ever) and RingClosed once the owner closed.
        It spins (yielding the CPU) spin_s before it blocks on its doorbell."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        parts: list[bytes] = []
        while True:
            if not self._wait_chunk(reader, deadline, should_stop, spin_s):
                return None
            chunk, last = self._take(reader)
            if last:
                return b"".join((*parts, chunk)) if parts else chunk
            parts.append(chunk)

    def try_read(self, reader: int, timeout_s: float) -> bytes | None:
        """The next message if its first chunk is there now (else None at once); the rest of a multi-chunk
        message is waited for, at most timeout_s."""
        if self._words[1] <= self._words[2 + reader]:
            self._check_open()
            return None
        chunk, last = self._take(reader)
        if last:
            return chunk
        rest = self.read(reader, timeout_s)
        assert rest is not None  # no should_stop: read returns a message or raises
        return chunk + rest

    def doorbell_fd(self, reader: int) -> int:
        """The reader's end of its doorbell: readable once a chunk may have come. Before blocking on it,
        begin_block (then look once more); after, end_block."""
        fd = self._bells_in.get(reader)
        if fd is None:
            fd = self._bells_in[reader] = os.open(self.handle.doorbell(reader), os.O_RDWR | os.O_NONBLOCK)
        return fd

    def begin_block(self, reader: int) -> None:
        """Announce that `reader` is about to block on its doorbell, and empty it: from here the writer
        rings for every chunk. The caller looks at the ring once more before blocking (the handshake's
        reader half: a chunk published before the flag was seen is found by that look)."""
        self._words[self._asleep_at + reader] = 1
        fence()  # the flag is visible before the look at write_seq that follows
        self.drain_doorbell(reader)

    def end_block(self, reader: int) -> None:
        """`reader` is awake again: the writer may skip its doorbell (a stale flag only costs a bell)."""
        self._words[self._asleep_at + reader] = 0

    def drain_doorbell(self, reader: int) -> None:
        try:
            while os.read(self.doorbell_fd(reader), 4096):
                pass
        except BlockingIOError:
            pass

    def _wait_chunk(
        self, reader: int, deadline: float | None, should_stop: Callable[[], bool] | None, spin_s: float
    ) -> bool:
        words, mine = self._words, 2 + reader
        if words[1] > words[mine]:
            return True
        spin_until = time.monotonic() + spin_s
        blocking = False
        try:
            while words[1] <= words[mine]:
                self._check_open()
                if should_stop is not None and should_stop():
                    return False
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    raise RingTimeout(f"reader {reader}: no message on ring {self.handle.name} in time")
                if now < spin_until:
                    os.sched_yield()  # releases the GIL too: the actor's other threads (pings) still run
                    continue
                if not blocking:
                    self.begin_block(reader)
                    blocking = True
                else:
                    self.drain_doorbell(reader)  # a bell that came while looking: the look below sees its chunk
                if words[1] > words[mine]:
                    break
                wait = BELL_POLL_S if deadline is None else max(0.0, min(BELL_POLL_S, deadline - now))
                select.select([self.doorbell_fd(reader)], [], [], wait)
        finally:
            if blocking:
                self.end_block(reader)
        return True

    def _take(self, reader: int) -> tuple[bytes, bool]:
        words, mine = self._words, 2 + reader
        seq = words[mine]
        fence()  # read the payload only after seeing the counter that published it
        at = self._slots_at + (seq % self.handle.n_slots) * self.handle.slot_bytes
        nbytes, last = _HEAD.unpack_from(self._buf, at)
        chunk = bytes(self._buf[at + _HEAD.size : at + _HEAD.size + nbytes])
        fence()  # the copy is complete before the acknowledgement frees the slot
        words[mine] = seq + 1
        return chunk, bool(last)

    # ---- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """The owner marks the ring closed (waiters leave) and unlinks it; a reader just detaches."""
        if self._closed:
            return
        self._closed = True
        if self._owner:
            self._words[0] = 1
            try:
                self._ring_bells()  # every reader, asleep or not: a blocked one wakes to see the closed flag
            except OSError:
                pass
        for fd in [*(self._bells_out or []), *self._bells_in.values()]:
            os.close(fd)
        self._bells_out, self._bells_in = [], {}
        self._words.release()
        self._asleep.release()
        self._shm.close()
        if self._owner:
            for path in [self.handle.doorbell(r) for r in range(self.handle.n_readers)]:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
            if self._owner_lock is not None:
                os.close(self._owner_lock)
                self._owner_lock = None
