"""Rings whose owner died without closing them are swept; live ones, and fresh ones, are not
(actors/transport/shm_sweep.py). The sweep logic runs on a private directory; the ring's own lock on /dev/shm."""

import fcntl
import os
import signal
import subprocess
import sys
import time

import pytest

from actors.transport import shm_sweep
from actors.transport.shm_ring import ShmRing


def later() -> float:
    """A sweep's clock at which every entry the test just made counts as old."""
    return time.time() + shm_sweep.GRACE_S + 60


def ring_files(directory, name, bells=2, segment=True):
    paths = [directory / f"{name}_bell{r}" for r in range(bells)]
    if segment:
        paths.append(directory / name)
    for p in paths:
        p.write_bytes(b"")
    return paths


def lock_in_child(path):
    """A process that holds the owner's lock on `path` until killed."""
    code = (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(path)!r}, os.O_RDONLY)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "print('locked', flush=True)\n"
        "time.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "locked"
    return child


def test_a_dead_owners_ring_goes_and_a_live_owners_stays(tmp_path):
    dead = ring_files(tmp_path, "kvray_111_aaaaaaaaaaaa")
    live = ring_files(tmp_path, "kvray_222_bbbbbbbbbbbb")
    owner = lock_in_child(live[-1])
    killed = lock_in_child(dead[-1])
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=30)
    try:
        assert shm_sweep.sweep(str(tmp_path), now=later()) == 3
        assert not any(p.exists() for p in dead)
        assert all(p.exists() for p in live)
    finally:
        owner.kill()
        owner.wait(timeout=30)
    # Its owner gone too, the second ring goes on the next sweep.
    assert shm_sweep.sweep(str(tmp_path), now=later()) == 3
    assert not any(p.exists() for p in live)


def test_orphan_doorbells_go_young_entries_and_other_files_stay(tmp_path):
    orphan = ring_files(tmp_path, "kvray_333_cccccccccccc", segment=False)
    young = ring_files(tmp_path, "kvray_444_dddddddddddd")
    other = [tmp_path / "kvray_not_a_ring", tmp_path / "psm_12345"]
    for p in other:
        p.write_bytes(b"")
    assert shm_sweep.sweep(str(tmp_path), now=time.time()) == 0  # all of it is younger than GRACE_S
    old = time.time() - shm_sweep.GRACE_S - 10
    for p in orphan:
        os.utime(p, (old, old))
    assert shm_sweep.sweep(str(tmp_path), now=time.time()) == 2
    assert not any(p.exists() for p in orphan)
    assert all(p.exists() for p in [*young, *other])


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory lives in /dev/shm here")
def test_a_ring_holds_its_owners_lock_until_it_closes(monkeypatch):
    monkeypatch.setattr(shm_sweep, "swept", True)  # this test sweeps nothing of the machine's
    ring = ShmRing.create(n_readers=1, n_slots=2, slot_bytes=4096)
    path = os.path.join(shm_sweep.SHM_DIR, ring.handle.name)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    ring.close()
    assert not os.path.exists(path) and not os.path.exists(ring.handle.doorbell(0))
