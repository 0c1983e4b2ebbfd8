"""Rings whose owner is gone: found by a lock the owner holds for its lifetime, and removed.

A ring's owner (a driver, for the step broadcast) unlinks its segment and doorbells at close. One killed
from outside (ray.kill, an OOM kill, a crash) never closes: its segment and FIFOs stay in /dev/shm, and
a test suite or a long-lived node that kills drivers gathers them (262 entries on this project's 2-core
machine after a day of test runs; the segments' pages that were written stay allocated in tmpfs). The
owner holds an exclusive flock on its segment's file; the kernel drops it when the process dies, in any
PID namespace, so "the lock can be taken" means "the owner is gone" without trusting a PID. New rings
sweep once per process (ShmRing.create). Entries younger than GRACE_S are left alone: an owner takes its
lock a moment after it creates the segment.
"""

from __future__ import annotations

import fcntl
import os
import re
import time

SHM_DIR = "/dev/shm"
PREFIX = "kvray_"
GRACE_S = 30.0
_ENTRY = re.compile(r"^(kvray_\d+_[0-9a-f]{12})(_bell\d+)?$")
swept = False  # set once this process has swept (a test sets it to sweep nothing)


def hold_owner_lock(name: str, directory: str = SHM_DIR) -> int | None:
    """Take the owner's lock on a ring segment; the returned fd must stay open for the ring's life
    (None where the segment is not a file here: the lock is then not available, nothing is swept)."""
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _owner_gone(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # its owner holds the lock: alive
    finally:
        os.close(fd)
    return True


def sweep(directory: str = SHM_DIR, now: float | None = None) -> int:
    """Remove every ring segment whose owner's lock is free, with its doorbells, and doorbells whose
    segment is gone; returns how many entries were removed."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    now = time.time() if now is None else now
    rings: dict[str, list[str]] = {}
    for entry in names:
        m = _ENTRY.match(entry)
        if m:
            rings.setdefault(m.group(1), []).append(entry)
    removed = 0
    for ring, entries in rings.items():
        segment = os.path.join(directory, ring)
        try:
            if now - min(os.lstat(os.path.join(directory, e)).st_mtime for e in entries) < GRACE_S:
                continue
        except OSError:
            continue
        if ring in entries and not _owner_gone(segment):
            continue
        for entry in entries:
            try:
                os.unlink(os.path.join(directory, entry))
                removed += 1
            except OSError:
                pass
    return removed


def sweep_once() -> int:
    """The sweep, the first time this process creates a ring."""
    global swept
    if swept:
        return 0
    swept = True
    return sweep()
