"""Which process owns a run folder, and whether it is still alive.

A running run records its owner in ``status.json`` (``host``, ``pid``, the process's start time, the Slurm job when
there is one) and refreshes ``heartbeat_at`` every ``heartbeat_every_s`` seconds from a background thread. A reader
(``select_runs.py``, the sweep summary, a relaunch) then tells a run that is still going from one whose process was
killed (``kill -9``, an out-of-memory kill, a lost node), which nothing could record:

* on the owner's host: the pid must exist and have started when the owner did (a recycled pid is not the owner);
* on any other host (a shared filesystem seen from another node): the heartbeat must be younger than
  ``STALE_BEATS`` intervals;
* a Slurm job that was requeued (preemption, time limit) keeps its job id: its new incarnation owns the folder;
* a sweep launcher marks the jobs it starts with its own launch id (``LAUNCH_ENV``, inherited by local and Slurm
  jobs): once it has seen them end, a folder of one of them that still says ``running`` is interrupted, whatever
  its heartbeat says (a Slurm job killed a minute ago on another node).

A ``running`` run whose owner is gone is ``interrupted``: selection lists it apart and a relaunch reruns it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime

RUNNING = "running"
INTERRUPTED = "interrupted"
# Seconds between heartbeats; REWARDUQ_HEARTBEAT_S changes it (tests use a short one). Cheap either way: one small
# status.json rename per beat.
DEFAULT_HEARTBEAT_S = 60.0
# A heartbeat older than this many intervals means the owner is gone (seen from another host). Generous, because a
# busy shared filesystem can delay a write by a minute or more.
STALE_BEATS = 5


LAUNCH_ENV = "REWARDUQ_LAUNCH_ID"


def heartbeat_interval() -> float:
    try:
        value = float(os.environ.get("REWARDUQ_HEARTBEAT_S", DEFAULT_HEARTBEAT_S))
    except ValueError:
        value = DEFAULT_HEARTBEAT_S
    return value if value > 0 else DEFAULT_HEARTBEAT_S


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def slurm_job() -> str | None:
    """This process's Slurm job (``<array job>_<task>`` for an array task), which a requeue keeps; None outside
    Slurm."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID") or None


def _process_start(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def this_owner() -> dict:
    """The fields that identify this process as a run folder's owner."""
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": _process_start(os.getpid())}
    job = slurm_job()
    if job:
        owner["slurm_job"] = job
    if os.environ.get(LAUNCH_ENV):
        owner["launch"] = os.environ[LAUNCH_ENV]
    return owner


def stamp_seconds(stamp) -> float | None:
    """A time stamp of :func:`now_iso` as seconds since the epoch; None when it is not one."""
    try:
        return datetime.strptime(str(stamp), "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except ValueError:
        return None


def _age_s(stamp) -> float | None:
    seconds = stamp_seconds(stamp)
    return None if seconds is None else time.time() - seconds


def owner_alive(status: dict) -> bool:
    """Whether the process that wrote a ``running`` status is still running it (see the module docstring)."""
    job = slurm_job()
    if job and status.get("slurm_job") == job:
        return False  # we are the same Slurm job, requeued: the earlier incarnation is gone
    if status.get("host") == socket.gethostname() and isinstance(status.get("pid"), int):
        pid = status["pid"]
        if pid == os.getpid():
            return False  # an earlier run of this very process, which has ended (runs in one process are sequential)
        started = _process_start(pid)
        if started is None:
            return False
        recorded = status.get("pid_started")
        return not isinstance(recorded, (int, float)) or abs(started - recorded) < 1.0
    beat = status.get("heartbeat_at") or status.get("started_at")
    age = _age_s(beat)
    every = status.get("heartbeat_every_s")
    every = float(every) if isinstance(every, (int, float)) and every > 0 else DEFAULT_HEARTBEAT_S
    return age is None or age < STALE_BEATS * every


def gone_on_this_host(owner: dict) -> bool:
    """Whether the process an owner record (:func:`this_owner`'s fields) names has provably ended: it ran on this host
    and no process with its pid exists now, or the one that does started at another time (a recycled pid). False
    whenever that cannot be proved: another host, a record without a pid, a process this user may not inspect, this
    very process."""
    import psutil

    pid = owner.get("pid")
    if owner.get("host") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if pid == os.getpid():
        return False
    try:
        started = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return True
    except (psutil.Error, OSError):
        return False
    recorded = owner.get("pid_started")
    return isinstance(recorded, (int, float)) and not isinstance(recorded, bool) and abs(started - recorded) >= 1.0


def effective_state(status: dict, ended_launch: str | None = None) -> str | None:
    """``status["state"]``, except that a ``running`` run whose owner is gone is ``interrupted``: its process is dead,
    or it was started by launch ``ended_launch``, whose jobs have all ended."""
    state = status.get("state")
    if state == RUNNING and ((ended_launch and status.get("launch") == ended_launch) or not owner_alive(status)):
        return INTERRUPTED
    return state


def describe_owner(status: dict) -> str:
    """``pid 123 on host node7, started 2026-..., heartbeat 12 s ago`` for messages."""
    parts = [f"pid {status.get('pid')} on host {status.get('host')}"]
    if status.get("started_at"):
        parts.append(f"started {status['started_at']}")
    age = _age_s(status.get("heartbeat_at"))
    if age is not None:
        parts.append(f"heartbeat {age:.0f} s ago")
    return ", ".join(parts)


class Heartbeat:
    """A daemon thread that calls ``beat()`` every ``every`` seconds until :meth:`stop`."""

    def __init__(self, beat: Callable[[], None], every: float):
        self._beat, self._every = beat, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="run-heartbeat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self._beat()
            except OSError:
                pass  # a full disk or a hiccup of the shared filesystem: the next beat tries again

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
