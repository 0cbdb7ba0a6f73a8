"""A run's attempts: every process that worked on one run in its folder (the first launch, each requeue after a
time limit or a preemption, a relaunch by hand that resumed from the training checkpoint).

``status.json`` keeps ``attempts`` (``started_at``, ``ended_at``, ``seconds``, ``state`` of each, oldest first) and
``seconds``, their sum: what the run cost, not only its last piece. An attempt that ended with a word of its own
(completed, interrupted, failed) recorded itself; one killed without one (``kill -9``, a lost node: its status still
says ``running``) is counted from its start to its last heartbeat, as ``lost``.

A new attempt carries the earlier ones over only when it continues the same run: the same config hash, the run not
completed, and not ``force=true`` (which starts the run over). (``seconds_total``, which ``train.py`` adds, stays the
last attempt's time from validation to the end: the work itself, without claiming the folder.)
"""

from __future__ import annotations

import math

from rewarduq_exp.runs.run_identity import COMPLETED
from rewarduq_exp.runs.run_owner import RUNNING, stamp_seconds

LOST = "lost"


def earlier_attempts(status: dict, chash: str | None, force: bool) -> list[dict]:
    """The attempts of the run that ``status`` (the folder's ``status.json`` before this process claimed it)
    describes, when this process continues it; else ``[]``."""
    if force or chash is None or status.get("config_hash") != chash or status.get("state") in (None, COMPLETED):
        return []
    if isinstance(status.get("attempts"), list):
        attempts = recorded(status)
    else:   # a status.json written before attempts were recorded: its seconds were its last attempt's
        attempts = [] if status.get("state") == RUNNING else [_clean({
            "started_at": status.get("started_at"), "seconds": status.get("seconds"), "state": status.get("state"),
            "ended_at": status.get("finished_at") or status.get("interrupted_at")})]
    if status.get("state") == RUNNING:   # its process is gone (the folder would not be free otherwise)
        start, beat = stamp_seconds(status.get("started_at")), stamp_seconds(status.get("heartbeat_at"))
        seconds = beat - start if start is not None and beat is not None else 0.0
        attempts.append(_clean({"started_at": status.get("started_at"), "ended_at": status.get("heartbeat_at"),
                                "seconds": seconds, "state": LOST}))
    return attempts


def recorded(status: dict) -> list[dict]:
    """The attempts ``status`` lists (checked, see :func:`_clean`)."""
    entries = status.get("attempts")
    return [_clean(a) for a in entries if isinstance(a, dict)] if isinstance(entries, list) else []


def attempt(started_at: str, ended_at: str, seconds: float, state: str) -> dict:
    return {"started_at": started_at, "ended_at": ended_at, "seconds": round(seconds, 2), "state": state}


def total_seconds(attempts: list[dict]) -> float:
    return round(sum(a["seconds"] for a in attempts), 2)


def _clean(entry: dict) -> dict:
    """One attempt with the four fields and a finite, non-negative ``seconds`` (a damaged entry counts 0 s rather
    than failing the run that continues it)."""
    seconds = entry.get("seconds")
    ok = isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds)
    return attempt(str(entry.get("started_at")), str(entry.get("ended_at")), max(0.0, float(seconds)) if ok else 0.0,
                   str(entry.get("state")))
