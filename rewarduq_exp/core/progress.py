"""Progress of long loops: a tqdm bar when progress bars are on, a log line every few minutes when they are off.

Batch jobs run with ``progress=false`` (their output goes to a log file, where a bar is noise), and used to log
nothing between data preparation and the end: an ENS-LoRA run on a busy machine was silent for more than 15 minutes.
With bars off, :func:`progress` logs ``<desc>: 40/96 steps (42%), loss 0.5312, elapsed 6m02s, ETA 8m27s`` at most
every :data:`LOG_EVERY_SECONDS` (and once at the end of a loop that took longer than that), so a Slurm log shows where
a job is and when it will be done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator

from tqdm.auto import tqdm

log = logging.getLogger("rewarduq_exp")

# Seconds between two progress lines of one loop when bars are off; the runner sets it from progress_log_minutes.
LOG_EVERY_SECONDS = 180.0


def set_interval(seconds: float) -> None:
    global LOG_EVERY_SECONDS
    LOG_EVERY_SECONDS = float(seconds)


def duration(seconds: float) -> str:
    """A short duration: 45s, 6m02s, 2h05m."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressClock:
    """Logs ``done/total`` with elapsed time and ETA at most every :data:`LOG_EVERY_SECONDS` seconds.

    ``initial``: units already done before this clock started (a resumed run), left out of the rate.
    """

    def __init__(self, desc: str, total: int | None, unit: str = "it", initial: int = 0):
        self.desc, self.total, self.unit, self.initial = desc, total, unit, initial
        self.start = self.last = time.monotonic()
        self.values: dict[str, object] = {}
        self.lines = 0

    def update(self, done: int, **values) -> None:
        self.values.update(values)
        now = time.monotonic()
        finished = self.total is not None and done >= self.total
        if now - self.last < LOG_EVERY_SECONDS and not (finished and now - self.start >= LOG_EVERY_SECONDS):
            return
        self.last = now
        self.lines += 1
        elapsed = now - self.start
        where = f"{done}/{self.total} {self.unit}" if self.total else f"{done} {self.unit}"
        if self.total:
            where += f" ({100 * done / self.total:.0f}%)"
        shown = "".join(f", {k} {v:.4g}" if isinstance(v, float) else f", {k} {v}" for k, v in self.values.items())
        eta = ""
        if self.total and done > self.initial and not finished:
            eta = f", ETA {duration(elapsed / (done - self.initial) * (self.total - done))}"
        log.info("%s: %s%s, elapsed %s%s", self.desc, where, shown, duration(elapsed), eta)


class LoggedProgress:
    """An iterable that ticks a :class:`ProgressClock` after each item; ``set_postfix`` adds values to its lines
    (the part of tqdm's interface the loops use)."""

    def __init__(self, iterable: Iterable, desc: str, total: int | None, unit: str, initial: int):
        self.iterable = iterable
        if total is None and hasattr(iterable, "__len__"):
            total = initial + len(iterable)
        self.clock = ProgressClock(desc, total, unit, initial)

    def __iter__(self) -> Iterator:
        done = self.clock.initial
        for item in self.iterable:
            yield item
            done += 1
            self.clock.update(done)

    def set_postfix(self, **values) -> None:
        self.clock.values.update(values)


class _Silent:
    def __init__(self, iterable: Iterable):
        self.iterable = iterable

    def __iter__(self) -> Iterator:
        return iter(self.iterable)

    def set_postfix(self, **values) -> None:
        pass


def progress(iterable: Iterable, *, desc: str, show: bool, total: int | None = None, unit: str = "it",
             initial: int = 0, quiet: bool = False):
    """``iterable`` with a progress bar (``show``) or with a log line every few minutes (bars off); ``quiet``: neither
    (the other processes of a distributed run, whose rank 0 reports)."""
    if quiet:
        return _Silent(iterable)
    if show:
        return tqdm(iterable, desc=desc, total=total, unit=unit, initial=initial, leave=False)
    return LoggedProgress(iterable, desc, total, unit, initial)
