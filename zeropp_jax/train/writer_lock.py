"""One writing job per checkpoint directory.

A job that saves into a directory becomes its writer: its saving process (process 0 of a
multi-process job, the only one that changes the directory's structure) holds an exclusive
``flock`` on ``directory/.writer`` from its first save until it exits, and writes who it is
into that file. Another process that tries to save there (an operator who started the job
twice) finds the lock taken and is refused, naming the holder, before it writes anything,
so neither job's retention ever deletes what the other reported saved.

The lock belongs to the process, not to a save: the kernel releases it when the process
exits, however it exits (killed too), so a crashed job never blocks the next one, and no
lock file is ever "stale" (the file stays; only the lock on it counts). Saves of one
process (several threads, several states) share it. A child forked by the writer (data
loader workers) does not hold it: its copy of the descriptor is closed at fork, which
leaves the parent's lock in place. On a shared filesystem the lock needs a filesystem
whose ``flock`` is seen by every host (NFSv4, Lustre mounted with ``-o flock``, GPFS).
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import os
import pathlib
import socket
import sys
import threading
import time

WRITER_FILE = ".writer"

# (device, inode) of a directory -> this process's descriptor holding its lock. By inode,
# not by path: two spellings of one directory (a symlink, a relative path) are one lock,
# which this process must not contend with itself for.
_HELD: dict[tuple[int, int], int] = {}
_GUARD = threading.Lock()


def _process_start() -> float:
    """When this process started (Linux: from /proc; elsewhere: when this module was
    imported)."""
    try:
        ticks = int(pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in
                    pathlib.Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


_STARTED = _process_start()


@dataclasses.dataclass(frozen=True)
class Holder:
    """The process that holds a directory: its id and host, when it started and took the
    directory, and its command line."""

    pid: int | None
    host: str | None
    started: float | None
    since: float | None
    command: str | None

    def describe(self) -> str:
        """``process 123 on host-a (started ..., writing here since ...: python train.py)``."""
        if self.pid is None:
            return "another process (it has not written its name into the lock file yet)"

        def when(t: float | None) -> str:
            if t is None:
                return "?"
            return datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")

        cmd = f": {self.command}" if self.command else ""
        return (f"process {self.pid} on host {self.host} (started {when(self.started)}, "
                f"writing here since {when(self.since)}{cmd})")


def _me() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": _STARTED,
            "since": time.time(), "command": " ".join(sys.argv)[:300]}


def _read_holder(fd: int) -> Holder:
    """Who holds the lock on ``fd``'s file, from what it wrote there. The holder writes it
    right after taking the lock: an empty or partial file is read again, for up to 2 s (a
    loaded machine may pause the holder between the two)."""
    for _ in range(200):
        try:
            got = json.loads(os.pread(fd, 1 << 16, 0).decode())
            return Holder(*(got.get(k) for k in ("pid", "host", "started", "since",
                                                 "command")))
        except (OSError, ValueError, UnicodeDecodeError):
            time.sleep(0.01)
    return Holder(None, None, None, None, None)


def _same_file(fd: int, path: pathlib.Path) -> bool:
    """True if ``fd`` is still the file at ``path`` (not one that was deleted or replaced,
    as when the directory was removed and made again)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def claim(directory: pathlib.Path) -> Holder | None:
    """Makes this process ``directory``'s writer (it must exist). Returns None once this
    process holds it (at once if it did already), or the ``Holder`` of another live process
    that holds it. Never waits for the other process."""
    path = directory / WRITER_FILE
    st = os.stat(directory)
    key = (st.st_dev, st.st_ino)
    with _GUARD:
        fd = _HELD.get(key)
        if fd is not None:
            if _same_file(fd, path):
                return None
            os.close(fd)  # the directory was made anew: claim its new file
            del _HELD[key]
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            return holder
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_me()).encode(), 0)
        os.fsync(fd)
        _HELD[key] = fd
        return None


def release(directory: pathlib.Path) -> None:
    """Lets go of ``directory`` if this process holds it (another job may then save there
    while this process lives; exiting does the same)."""
    try:
        st = os.stat(directory)
    except OSError:
        return
    with _GUARD:
        fd = _HELD.pop((st.st_dev, st.st_ino), None)
        if fd is not None:
            os.close(fd)  # closing the last descriptor releases the flock


def _forget_in_child() -> None:
    """In a forked child: close the inherited descriptors (the parent keeps its locks; a
    flock is released only when every descriptor of it is closed, or unlocked)."""
    global _GUARD
    _GUARD = threading.Lock()  # a thread of the parent may have held it at the fork
    for fd in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)
