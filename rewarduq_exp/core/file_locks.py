"""File locks that say when they wait, and for whom.

``FileLock`` waits silently: an ``evaluate.py`` whose run folder's metrics lock, or a feature-cache entry, is held by
another process (another evaluation, 27 sweep jobs computing the same features) looked hung. :func:`held` takes the
lock; when it is not free within ``NOTE_AFTER_S`` seconds (3; ``REWARDUQ_LOCK_NOTE_S`` sets another) it logs ONE
line, naming the lock file and its holder, and goes on waiting.

The holder: while a process holds a lock taken here, it keeps a small record beside it, ``<lock file>.holder`` (JSON:
pid, host, the process's start time, since when; written atomically after the lock is taken, deleted before it is
released), which a waiter on another node of a shared filesystem can read too. On this host the kernel's own table
(``/proc/locks``) names the process that holds the ``flock``, whatever took it; a record whose process is gone (killed
while holding, the kernel released the lock) is not believed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from rewarduq_exp.core.atomic_write import write_atomic

log = logging.getLogger("rewarduq_exp")

NOTE_AFTER_S = 3.0
HOLDER_SUFFIX = ".holder"
_MAX_RECORD_BYTES = 4096


@contextlib.contextmanager
def held(path: str | os.PathLike, what: str, note_after_s: float | None = None,
         lock: FileLock | None = None) -> Iterator[None]:
    """Hold the file lock ``path`` (``lock``: a ``FileLock`` of it made by the caller) while the block runs;
    ``what`` says what it guards, for the waiting line."""
    path = Path(path)
    lock = FileLock(str(path)) if lock is None else lock
    note_after = _note_after() if note_after_s is None else note_after_s
    try:
        lock.acquire(timeout=note_after)
    except Timeout:
        log.warning("waiting for %s: the lock %s is held by %s; waiting until it is released", what, path,
                    holder(path))
        lock.acquire()
    record = path.with_name(path.name + HOLDER_SUFFIX)
    try:
        with contextlib.suppress(OSError):
            write_atomic(record, json.dumps(_this_process()))
        yield
    finally:
        try:
            with contextlib.suppress(OSError):
                record.unlink()
        finally:
            lock.release()


def _note_after() -> float:
    try:
        value = float(os.environ.get("REWARDUQ_LOCK_NOTE_S", NOTE_AFTER_S))
    except ValueError:
        return NOTE_AFTER_S
    return value if 0 <= value < float("inf") else NOTE_AFTER_S


def _this_process() -> dict:
    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    started = _started(os.getpid())
    if started is not None:
        record["pid_started"] = started
    return record


def _started(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # noqa: BLE001 (no such process, no permission, no psutil: unknown)
        return None


def _command(pid: int) -> str:
    try:
        import psutil

        words = psutil.Process(pid).cmdline()
    except Exception:  # noqa: BLE001
        return ""
    text = " ".join(" ".join(Path(words[0]).name if i == 0 else w for i, w in enumerate(words)).split())
    return text if len(text) <= 120 else text[:117] + "..."


def _read_record(path: Path) -> dict:
    """The holder record beside ``path`` ({} when there is none or it is not one); never follows a link."""
    record = path.with_name(path.name + HOLDER_SUFFIX)
    try:
        fd = os.open(record, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        try:
            data = os.read(fd, _MAX_RECORD_BYTES + 1)
        finally:
            os.close(fd)
        value = json.loads(data) if len(data) <= _MAX_RECORD_BYTES else None
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) and isinstance(value.get("pid"), int) else {}


def local_holders(path: str | os.PathLike) -> list[int]:
    """The pids that hold a ``flock`` (or POSIX lock) on ``path`` according to this host's ``/proc/locks`` (Linux;
    [] elsewhere, or when none does). Waiters (``->`` lines) are not holders."""
    try:
        st = os.stat(path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    wanted = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    pids = []
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] == "->":
            continue
        try:
            major, minor, inode = parts[5].split(":")
            if (int(major, 16), int(minor, 16), int(inode)) == wanted:
                pids.append(int(parts[4]))
        except ValueError:
            continue
    return [p for p in dict.fromkeys(pids) if p > 0]


def holder(path: str | os.PathLike) -> str:
    """Who holds the lock ``path``, for a message: ``pid 123 on host node7 (python evaluate.py run=...), since ...``,
    or what can be said of it."""
    path = Path(path)
    here = socket.gethostname()
    record = _read_record(path)
    local = local_holders(path)
    since = f", since {record['since']}" if record.get("since") else ""
    if local:
        pid = local[0]
        command = _command(pid)
        mine = record.get("pid") == pid and record.get("host") == here
        return f"pid {pid} on this host ({here})" + (f": {command}" if command else "") + (since if mine else "")
    if record and record.get("host") != here:
        return f"pid {record['pid']} on host {record.get('host')}{since} (its record {path.name}{HOLDER_SUFFIX})"
    started, recorded = (_started(record["pid"]), record.get("pid_started")) if record else (None, None)
    if started is not None and (not isinstance(recorded, (int, float)) or abs(started - recorded) < 1.0):
        command = _command(record["pid"])
        return f"pid {record['pid']} on this host ({here})" + (f": {command}" if command else "") + since
    return "another process (not on this host, or not visible from here)"
