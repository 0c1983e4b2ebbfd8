"""The output file of `kvray run`: checked and locked before any engine starts, repaired at its tail,
read back for resume, and appended one whole JSON line at a time.

- It must be a regular file (a device such as /dev/full, or a pipe, cannot be resumed from) and must
  not be one of the inputs (or a file that a directory or glob input would read next time).
- An exclusive flock is held for the whole run: a second `kvray run` on the same file refuses to start.
- A half-written last line (a run killed mid-write) is cut off; only the file's tail is read for that.
- Resume: the keys (kvray `id`, OpenAI `custom_id`) of *successful* records are done; lines whose
  records are errors run again, and their earlier error records stay (the file is only ever appended
  to: the last record of an id is the one that counts).
- A failed write (a full disk) truncates the partial line away and stops the job with a JobError:
  every record already written is whole, and a rerun resumes.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import json
import os
import stat
import time
from typing import Any

from cluster.job.input import JobError, Shard
from cluster.job.keys import KeySet
from cluster.job.openai_batch import is_success, record_key

_TAIL_CHUNK = 1 << 16


def default_output_path() -> str:
    return f"kvray-{time.strftime('%Y%m%d-%H%M%S')}.out.jsonl"


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a pipe"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def check_not_an_input(path: str, spec: str | None, shards: list[Shard]) -> None:
    """--output must never be read as input: not an input file, not inside a directory input, not
    matched by a glob input, not the file stdin is redirected from."""
    out = os.path.realpath(path)
    for s in shards:
        if s.is_stdin:
            same = os.path.exists(path) and _same(os.stat(path), os.fstat(0))
        else:
            same = os.path.realpath(s.path) == out
        if same:
            raise JobError(
                f"--output {path!r}: is also the input ({s.path!r}); the job would read its own "
                f"records back. Write to another file"
            )
    if spec and os.path.isdir(spec) and out.startswith(os.path.realpath(spec) + os.sep) and out.endswith(".jsonl"):
        raise JobError(
            f"--output {path!r}: lies inside the --input directory {spec!r}, so a rerun would read "
            f"it as an input shard. Write outside it"
        )
    if (
        spec
        and not os.path.isdir(spec)
        and any(ch in spec for ch in "*?[")
        and fnmatch.fnmatch(out, os.path.realpath(spec))
    ):
        raise JobError(
            f"--output {path!r}: matches the --input pattern {spec!r}, so a rerun would read it as "
            f"an input shard. Write elsewhere"
        )


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino) and stat.S_ISREG(a.st_mode)


class OutputFile:
    """An open, locked, tail-repaired output file; `done` holds the keys already answered."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = self._open(path)
        try:
            self._lock()
            self.size = self._cut_partial_line()
            self.done, self.earlier_errors = load_done(path)
        except BaseException:
            os.close(self.fd)
            raise
        self.written = 0

    def _open(self, path: str) -> int:
        if os.path.exists(path):
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                raise JobError(
                    f"--output {path!r}: {_kind(st.st_mode)}, not a regular file; kvray appends to and "
                    f"resumes from a regular file"
                )
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise JobError(f"--output {path!r}: cannot be written ({_why_unwritable(path, e)})") from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise JobError(f"--output {path!r}: {_kind(mode)}, not a regular file")
        return fd

    def _lock(self) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise JobError(
                    f"--output {self.path!r}: another kvray run is writing it (the file is locked); "
                    f"wait for it to finish, or write to another file"
                ) from None
            raise JobError(f"--output {self.path!r}: cannot be locked ({e.strerror or e})") from None

    def _cut_partial_line(self) -> int:
        """Truncate after the last newline, reading backwards from the end in small chunks."""
        end = os.lseek(self.fd, 0, os.SEEK_END)
        pos = end
        while pos > 0:
            start = max(0, pos - _TAIL_CHUNK)
            chunk = os.pread(self.fd, pos - start, start)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        else:
            keep = 0
        if keep != end:
            os.ftruncate(self.fd, keep)
        return keep

    def encode(self, rec: dict[str, Any]) -> bytes:
        """One whole JSON line; raises (a lone surrogate, say) before anything is written."""
        return (json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8")

    def write(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                n = os.pwrite(self.fd, view, self.size + (len(data) - len(view)))
                view = view[n:]
        except OSError as e:
            try:
                os.ftruncate(self.fd, self.size)  # no half line left behind
            except OSError:
                pass
            raise JobError(
                f"--output {self.path!r}: write failed ({e.strerror or e}) after {self.written} record(s) "
                f"this run; every record written is whole: free space and rerun to resume"
            ) from None
        self.size += len(data)
        self.written += 1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock
            self.fd = -1


def load_done(path: str | None) -> tuple[KeySet, int]:
    """(keys of successful records, number of error records) in an existing output file, streamed."""
    done, errors = KeySet(), 0
    if not path or not os.path.isfile(path):
        return done, errors
    with open(path, "rb") as f:
        for raw in f:
            try:
                rec = json.loads(raw)
            except (ValueError, RecursionError):  # not JSON (or too deeply nested): a foreign line
                continue
            if not isinstance(rec, dict):
                continue
            key = record_key(rec)
            if key is not None and is_success(rec):
                done.add(key)
            else:
                errors += 1
    return done, errors


def _why_unwritable(path: str, e: OSError) -> str:
    # makedirs on a path through a regular file says only "File exists": name the file instead.
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        return f"{parent!r} is a file, not a directory"
    return e.strerror or str(e)


STDOUT_NAMES = ("-", "/dev/stdout")


def is_stdout(path: str) -> bool:
    """`--output -`, /dev/stdout, or a path that is the very file stdout is redirected to (`--output
    out.jsonl > out.jsonl`): the records go to stdout and nothing else does, or the summary, written
    through another file offset, would overwrite them."""
    if path in STDOUT_NAMES:
        return True
    try:
        a, b = os.stat(path), os.fstat(1)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class StdoutOutput:
    """The records on stdout, one whole JSON line at a time (the progress bar, logs and summary go to
    stderr). Nothing to resume from and nothing to lock. A reader that goes away (`| head`) raises
    BrokenPipeError from `write`, which ends the run quietly (cluster/cli.py)."""

    path = "<stdout>"

    def __init__(self) -> None:
        self.done = KeySet()
        self.earlier_errors = 0
        self.written = 0

    def encode(self, rec: dict[str, Any]) -> bytes:
        return (json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8")

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(1, view) :]
        self.written += 1

    def close(self) -> None:
        pass
