"""The signals that end a job early, and how a run leaves on them with its training state saved.

* ``SIGTERM``: Slurm's preemption, ``scancel``, ``scontrol requeue``, a plain ``kill``.
* ``SIGUSR1`` / ``SIGUSR2``: the scheduler's warning before the time limit (submitit asks Slurm for ``SIGUSR2``
  ``signal_delay_s`` seconds before it; ``--signal=USR1@...`` is the other common choice).

While a training loop runs (:func:`training_loop`), the handler only records the signal: the loop saves its state at
the next step boundary (a consistent point: never half an optimizer step) and raises :class:`TrainingInterrupted`.
Outside a training loop there is nothing unsaved (feature-cache entries and results are written atomically), so the
handler raises it at once. ``train.py`` records the run as interrupted and then calls :func:`leave`, which leaves the
way the job's environment expects:

* in a submitit job, the signal submitit itself listens to (``SIGUSR2``) goes on to submitit's handler, which
  requeues the job (at most ``max_num_timeout`` times) and exits; any other signal exits without a result file, so
  a requeued job (preemption, ``scontrol requeue``) is still waited for by the launcher, and a cancelled one is seen
  as cancelled;
* anywhere else (a terminal, the in-process sweep launcher) the process exits with status 128 + the signal.

Launched again (by the scheduler's requeue or by hand, with the same command), the run finds its folder and resumes
from the checkpoint (:mod:`rewarduq_exp.core.training_checkpoint`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator

log = logging.getLogger("rewarduq_exp")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

_previous: dict[int, object] = {}
_requested: int | None = None
_loops = 0  # training loops running now (nested calls count once each)


class TrainingInterrupted(BaseException):
    """A signal ended the run early; its training state (if any was being trained) is saved. A BaseException, like
    KeyboardInterrupt: no ``except Exception`` on the way may take it for an ordinary failure."""

    def __init__(self, signum: int, where: str = ""):
        self.signum = signum
        self.where = where
        super().__init__(f"{signal.Signals(signum).name} {where}".strip())

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


def install() -> None:
    """Listen to the stop signals (main thread only; elsewhere signals cannot be caught and nothing changes)."""
    global _requested
    if threading.current_thread() is not threading.main_thread():
        return
    _requested = None
    for signum in STOP_SIGNALS:
        previous = signal.signal(signum, _handle)
        if previous is not _handle:
            _previous[signum] = previous


def uninstall() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, previous in list(_previous.items()):
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
    _previous.clear()


def _handle(signum, frame) -> None:
    global _requested
    first = _requested is None
    _requested = signum
    if _loops:
        if first:
            log.warning("received %s: saving the training state at the end of this step, then stopping",
                        signal.Signals(signum).name)
        return
    raise TrainingInterrupted(signum, "outside a training loop")


def stop_requested() -> int | None:
    """The signal received while a training loop ran, if any."""
    return _requested


@contextlib.contextmanager
def training_loop() -> Iterator[None]:
    """Mark a training loop as running: signals are deferred to its next step boundary."""
    global _loops
    _loops += 1
    try:
        yield
    finally:
        _loops -= 1


def in_submitit_job() -> bool:
    return bool(os.environ.get("SUBMITIT_EXECUTOR"))


def leave(interrupted: TrainingInterrupted) -> None:
    """Exit the way this job's environment expects, after the run recorded itself as interrupted (module
    docstring). Never returns."""
    signum = interrupted.signum
    previous = _previous.get(signum)
    uninstall()
    if in_submitit_job() and callable(previous) and getattr(previous, "__name__", "") == "checkpoint_and_try_requeue":
        previous(signum, None)   # submitit: requeue (or refuse past max_num_timeout, raising) and exit
    raise SystemExit(128 + signum)
