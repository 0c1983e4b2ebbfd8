"""The shm transport's channels without Ray: the shared-memory ring's acknowledgements (a slow reader is
never overwritten, a dead reader is named within the timeout, a closed ring releases its waiters, a
message larger than a slot arrives whole in other processes) and the ZMQ channel between two processes
on 127.0.0.1 (a SchedulerOutput round trip, a reader that stops reading, the close message)."""

import multiprocessing as mp
import os
import pickle
import time

import pytest
import zmq

from actors.transport.channels import ChannelSpec, ZmqReceiver, ZmqSender, bind, open_receiver, open_sender
from actors.transport.shm_ring import RingClosed, RingTimeout, ShmRing
from kvcore.messages import CachedRequestData, NewRequestData, SchedulerOutput
from kvcore.request import SamplingParams

pytestmark = pytest.mark.timeout(60)
CTX = mp.get_context("fork")  # quick; the children touch only the channels


def message(i: int, size: int) -> bytes:
    return bytes([i % 256]) * size


def test_a_slow_reader_is_never_overwritten():
    ring = ShmRing.create(n_readers=2, n_slots=2, slot_bytes=64)
    fast, slow = ShmRing.attach(ring.handle), ShmRing.attach(ring.handle)
    try:
        ring.write(message(1, 40), 1.0)
        ring.write(message(2, 40), 1.0)
        assert fast.read(0, 1.0) == message(1, 40) and fast.read(0, 1.0) == message(2, 40)
        # Both slots still hold what reader 1 has not acknowledged: the third message must wait.
        with pytest.raises(RingTimeout) as e:
            ring.write(message(3, 40), 0.2)
        assert e.value.readers == [1] and "did not acknowledge" in str(e.value)
        assert slow.read(1, 1.0) == message(1, 40) and slow.read(1, 1.0) == message(2, 40)
        # A ring that timed out mid-write refuses further writes rather than publish half a message.
        with pytest.raises(RingClosed, match="unusable after an earlier timeout"):
            ring.write(message(4, 8), 1.0)
    finally:
        fast.close(), slow.close(), ring.close()


def test_messages_larger_than_a_slot_arrive_whole_while_readers_keep_up():
    ring = ShmRing.create(n_readers=1, n_slots=3, slot_bytes=128)
    reader = ShmRing.attach(ring.handle)
    try:
        sizes = [0, 1, 111, 112, 113, 1000]
        for i, n in enumerate(sizes):
            if n > 3 * 112:  # more chunks than slots: the reader must run beside the writer
                proc = CTX.Process(target=_read_and_check, args=(ring.handle, 0, [message(i, n)]))
                reader.close()
                proc.start()
                ring.write(message(i, n), 20.0)
                proc.join(30)
                assert proc.exitcode == 0
                reader = None
                break
            ring.write(message(i, n), 1.0)
            assert reader.read(0, 1.0) == message(i, n)
    finally:
        if reader is not None:
            reader.close()
        ring.close()


def test_try_read_returns_a_multi_chunk_message_whole_or_nothing():
    ring = ShmRing.create(n_readers=1, n_slots=4, slot_bytes=64)
    try:
        assert ring.try_read(0, 1.0) is None
        ring.write(message(5, 140), 1.0)  # three chunks of at most 48 bytes
        ring.write(message(6, 20), 1.0)
        assert ring.try_read(0, 1.0) == message(5, 140) and ring.try_read(0, 1.0) == message(6, 20)
        assert ring.try_read(0, 1.0) is None
    finally:
        ring.close()


def _read_and_check(handle, index, expected):
    ring = ShmRing.attach(handle)
    # A reader that attaches later starts from its acknowledgement counter, wherever that stands.
    for want in expected:
        if ring.read(index, 10.0) != want:
            os._exit(3)
    ring.close()


def _read_one_then_die(handle, index):
    ring = ShmRing.attach(handle)
    ring.read(index, 10.0)
    os._exit(1)


def test_a_dead_reader_is_named_within_the_timeout():
    ring = ShmRing.create(n_readers=2, n_slots=2, slot_bytes=64)
    alive = ShmRing.attach(ring.handle)
    proc = CTX.Process(target=_read_one_then_die, args=(ring.handle, 1))
    proc.start()
    try:
        for i in range(4):  # the fourth needs the dead reader's acknowledgement of the second
            if i == 3:
                proc.join(30)
                assert proc.exitcode == 1
                with pytest.raises(RingTimeout) as e:
                    ring.write(message(i, 10), 0.5)
                assert e.value.readers == [1]
            else:
                ring.write(message(i, 10), 10.0)
                assert alive.read(0, 1.0) == message(i, 10)
    finally:
        alive.close(), ring.close()


def test_closing_the_ring_releases_a_waiting_reader():
    ring = ShmRing.create(n_readers=1, n_slots=2, slot_bytes=64)
    reader = ShmRing.attach(ring.handle)
    try:
        with pytest.raises(RingTimeout, match="no message"):
            reader.read(0, 0.1)
        assert reader.read(0, None, should_stop=lambda: True) is None
        ring.close()
        with pytest.raises(RingClosed):
            reader.read(0, 5.0)
    finally:
        reader.close()


def _write_later(handle, delays):
    ring = ShmRing.attach(handle)  # the writer's end here: any process may write, one at a time
    for i, delay in enumerate(delays):
        time.sleep(delay)
        ring.write(message(i, 10), 10.0)
    ring.close()
    os._exit(0)


@pytest.mark.parametrize("spin_s", [0.0, 0.05, 30.0])
def test_a_reader_gets_messages_whether_they_come_while_it_spins_or_after(spin_s):
    ring = ShmRing.create(n_readers=1, n_slots=2, slot_bytes=64)
    try:
        # While spinning (yielding) the reader still honours its timeout and should_stop.
        with pytest.raises(RingTimeout, match="no message"):
            ring.read(0, 0.1, spin_s=spin_s)
        assert ring.read(0, None, should_stop=lambda: True, spin_s=spin_s) is None
        proc = CTX.Process(target=_write_later, args=(ring.handle, [0.001, 0.2, 0.0]))
        proc.start()
        for i in range(3):  # 0.001 s: within a long spin; 0.2 s: after a short one, through the doorbell
            assert ring.read(0, 10.0, spin_s=spin_s) == message(i, 10)
        proc.join(10)
        assert proc.exitcode == 0
    finally:
        ring.close()


def scheduler_output(step_id: int) -> SchedulerOutput:
    new = NewRequestData("r0", list(range(300)), SamplingParams(max_tokens=4), ([1, 2, 3],), 0)
    cached = CachedRequestData()
    cached.add("r1", ([9],), 17)
    return SchedulerOutput([new], cached, {"r0": 300, "r1": 1}, 301, {"gone"}, set(), step_id)


def _zmq_echo(steps_addr, replies_addr, n):
    steps = open_receiver(ChannelSpec(zmq_addr=steps_addr))
    replies = open_sender(ChannelSpec(zmq_addr=replies_addr))
    for _ in range(n):
        so = pickle.loads(steps.recv(10.0))
        replies.send(pickle.dumps((True, so.step_id)), 10.0)
    try:
        steps.recv(10.0)
    except RingClosed:
        replies.send(b"closed", 10.0)
    replies.close(), steps.close()
    zmq.Context.instance().term()  # waits for the queued messages: a fork child leaves with os._exit


def test_zmq_channel_between_two_processes_on_loopback():
    push, push_addr = bind(zmq.PUSH, "127.0.0.1")
    pull, pull_addr = bind(zmq.PULL, "127.0.0.1")
    sender, replies = ZmqSender(push), ZmqReceiver(pull)
    proc = CTX.Process(target=_zmq_echo, args=(push_addr, pull_addr, 3))
    proc.start()
    try:
        for step in range(3):
            sender.send(pickle.dumps(scheduler_output(step), protocol=5), 10.0)
            assert pickle.loads(replies.recv(20.0)) == (True, step)
        sender.close()  # the close message: the echo process sees RingClosed
        assert replies.recv(20.0) == b"closed"
        proc.join(20)
        assert proc.exitcode == 0
    finally:
        replies.close()
        if proc.is_alive():
            proc.kill()


def test_zmq_sender_times_out_on_a_reader_that_stops_reading():
    push, addr = bind(zmq.PUSH, "127.0.0.1")
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 1)
    pull.setsockopt(zmq.RCVBUF, 4096)
    pull.connect(addr)  # connected, never reads
    sender = ZmqSender(push)
    try:
        assert pull.poll(0) == 0
        with pytest.raises(RingTimeout, match="did not take a message"):
            for _ in range(10_000):  # HWM and socket buffers fill within a few hundred
                sender.send(message(1, 64 * 1024), 0.2)
    finally:
        pull.close(linger=0), push.close(linger=0)


def _bell_pending(ring: ShmRing, reader: int) -> bool:
    import select

    return bool(select.select([ring.doorbell_fd(reader)], [], [], 0)[0])


def test_the_writer_rings_only_readers_that_announced_they_block():
    ring = ShmRing.create(n_readers=2, n_slots=4, slot_bytes=64)
    readers = [ShmRing.attach(ring.handle), ShmRing.attach(ring.handle)]
    try:
        ring.write(message(1, 10), 1.0)  # both awake (spinning or busy): no system call, no bell
        assert not _bell_pending(readers[0], 0) and not _bell_pending(readers[1], 1)
        assert readers[0].read(0, 1.0) == message(1, 10) and readers[1].read(1, 1.0) == message(1, 10)
        readers[1].begin_block(1)  # reader 1 is about to block: from now on it is rung
        ring.write(message(2, 10), 1.0)
        assert not _bell_pending(readers[0], 0) and _bell_pending(readers[1], 1)
        readers[1].end_block(1)
        assert readers[1].read(1, 1.0) == message(2, 10) and readers[0].read(0, 1.0) == message(2, 10)
        readers[1].begin_block(1)  # the flag set after the write: the look that follows finds it
        assert not _bell_pending(readers[1], 1)  # begin_block emptied the doorbell
        readers[1].end_block(1)
        ring.write(message(3, 10), 1.0)
        readers[1].begin_block(1)
        assert readers[1].try_read(1, 1.0) == message(3, 10)
        readers[1].end_block(1)
        ring.close()  # closing rings every reader, asleep or not: a blocked one must see the flag
        assert _bell_pending(readers[0], 0)
    finally:
        for r in readers:
            r.close()
        ring.close()


def _write_with_jitter(handle, delays_us):
    ring = ShmRing.attach(handle)
    for i, delay in enumerate(delays_us):
        end = time.perf_counter() + delay * 1e-6
        while time.perf_counter() < end:  # busy: sleeps this short would all be the timer's slack
            pass
        ring.write(message(i, 10), 10.0)
    ring.close()
    os._exit(0)


def test_a_reader_going_to_sleep_never_misses_a_message(monkeypatch):
    """Messages land while the reader spins, while it sets its flag, and once it blocks. A blocked
    reader wakes on its own only every BELL_POLL_S; made longer than the read's timeout here, a bell
    the writer skipped wrongly would end the read with RingTimeout instead of the message."""
    import random

    import actors.transport.shm_ring as shm_ring

    monkeypatch.setattr(shm_ring, "BELL_POLL_S", 3600.0)
    rng = random.Random(0)
    delays = [rng.choice([0, 5, 20, 40, 80, 300, 2000]) for _ in range(1500)]
    ring = ShmRing.create(n_readers=1, n_slots=2, slot_bytes=64)
    proc = CTX.Process(target=_write_with_jitter, args=(ring.handle, delays))
    proc.start()
    try:
        for i in range(len(delays)):
            assert ring.read(0, 10.0, spin_s=20e-6) == message(i, 10)
        proc.join(10)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        ring.close()
