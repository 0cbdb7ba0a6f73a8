"""The signals that end a job early, and how a process leaves on them: one line, its state saved, nothing half-done.

* ``SIGINT``: Ctrl-C in a terminal (sent to the whole foreground process group).
* ``SIGTERM``: Slurm's preemption, ``scancel``, ``scontrol requeue``, a plain ``kill``.
* ``SIGUSR1`` / ``SIGUSR2``: the scheduler's warning before the time limit (submitit asks Slurm for ``SIGUSR2``
  ``signal_delay_s`` seconds before it; ``--signal=USR1@...`` is the other common choice).

What a signal does depends on where the process is:

* inside a training loop (:func:`training_loop`), the handler only records it: the loop saves its state at the next
  step boundary (a consistent point: never half an optimizer step) and raises :class:`TrainingInterrupted`;
* inside a :func:`deferred` block (the atomic write of a training checkpoint, ``evaluate.py`` swapping its results
  into the run folder, recording ``status.json``), it waits for the end of the block, so what the block writes is
  never cut in half;
* anywhere else there is nothing unsaved (feature-cache entries and results are written atomically, evaluations are
  staged), so the handler raises :class:`TrainingInterrupted` at once, and the ``finally`` blocks on the way out
  clean up (a staging folder, a lock).

A second Ctrl-C (``SIGINT``) while a training loop runs on to its step boundary stops it at once, without saving that
step (the last saved state is kept); a second ``SIGINT`` while the process is already on its way out (cleaning up,
recording the interruption) exits at once, after the atomic write in progress, if any. Every other repeated signal is
ignored: Slurm may send ``SIGTERM`` twice (to the step and to the batch script), and neither must cost the save.

The entry points (``train.py``, ``evaluate.py``, ``downstream.py``) run under :func:`entry_point`, which listens to
these signals from the start and turns an interruption anywhere into ONE line on stderr, ``interrupted (SIGINT):
<what was kept>``, and exit status 128 + the signal (130 for Ctrl-C, 143 for ``SIGTERM``). ``train.py`` first records
the run as interrupted and then calls :func:`leave`, which leaves the way the job's environment expects:

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
import sys
import threading
from collections.abc import Callable, Iterator

log = logging.getLogger("rewarduq_exp")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

# What the process is doing about a stop signal.
IDLE = "idle"          # none received
PENDING = "pending"    # received inside a training loop: stopping at its next step boundary
LEAVING = "leaving"    # TrainingInterrupted raised: on the way out

_previous: dict[int, object] = {}
_requested: int | None = None
_state = IDLE
_loops = 0      # training loops running now (nested calls count once each)
_deferring = 0  # deferred blocks running now
_deferred: list[int] = []   # signals received inside them, acted on at the end of the outermost one


class TrainingInterrupted(BaseException):
    """A signal ended the process early; its training state (if any was being trained) is saved. A BaseException,
    like KeyboardInterrupt: no ``except Exception`` on the way may take it for an ordinary failure.

    ``message`` is what the one line on stderr says was kept (set by whoever knows: the training run, the
    evaluation); ``forced``: a second Ctrl-C stopped a training loop before its step boundary, without saving."""

    def __init__(self, signum: int, where: str = "", message: str | None = None, forced: bool = False):
        self.signum = signum
        self.where = where
        self.message = message
        self.forced = forced
        super().__init__(f"{signal.Signals(signum).name} {where}".strip())

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


_original: dict[int, object] = {}   # the handlers :func:`guard_startup` replaced


def guard_startup() -> None:
    """Called first by an entry-point script, before its imports: until :func:`entry_point` listens, ``SIGINT`` or
    ``SIGTERM`` exits with one line (nothing has been written yet) instead of a traceback out of an import."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous = signal.signal(signum, _starting)
        if previous not in (_starting, _handle):
            _original[signum] = previous


def _starting(signum, frame) -> None:
    _write_stderr(f"interrupted ({signal.Signals(signum).name}): stopped while starting; nothing was written\n")
    raise SystemExit(128 + signum)


def install() -> bool:
    """Listen to the stop signals, with no signal received yet (main thread only; elsewhere signals cannot be caught
    and nothing changes). Returns whether this call installed the handlers (False: they were installed already, e.g.
    by :func:`entry_point`); only then should the caller :func:`uninstall` them."""
    global _requested, _state
    if threading.current_thread() is not threading.main_thread():
        return False
    _requested, _state = None, IDLE
    _deferred.clear()
    fresh = False
    for signum in STOP_SIGNALS:
        previous = signal.signal(signum, _handle)
        if previous is _starting:
            previous = _original.pop(signum, signal.SIG_DFL)
        if previous is not _handle:
            _previous[signum] = previous
            fresh = True
    return fresh


def uninstall() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, previous in list(_previous.items()):
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
    _previous.clear()


def _handle(signum, frame) -> None:
    if _deferring:
        _deferred.append(signum)   # the block finishes first (:func:`deferred`)
        return
    _act(signum)


def _act(signum: int, message: str | None = None, after_block: bool = False) -> None:
    """What a stop signal does now (the module docstring); ``after_block``: it was received inside a
    :func:`deferred` block that has just ended."""
    global _requested, _state
    name = signal.Signals(signum).name
    if _state == IDLE:
        _requested = signum
        if _loops:
            _state = PENDING
            log.warning("received %s: saving the training state at the end of this step, then stopping%s", name,
                        " (Ctrl-C again: stop at once, without saving this step)" if signum == signal.SIGINT else "")
            return
        _state = LEAVING
        raise TrainingInterrupted(signum, "outside a training loop", message)
    if signum != signal.SIGINT:
        return   # already stopping; a repeated SIGTERM (Slurm sends two) must not cost the save
    if _state == PENDING:
        if after_block:
            return   # Ctrl-C again while the loop saved: it stops at its step boundary, now or after one more step
        _state = LEAVING
        raise TrainingInterrupted(signum, "in the middle of a training step (Ctrl-C twice)", forced=True)
    # Ctrl-C again while on the way out: leave now. Every result is written atomically (a deferred write in progress
    # has just finished), so this leaves at most a staging folder or a 'running' status of a dead process, which
    # later runs recognise as such.
    _write_stderr(f"interrupted ({name}): stopped at once (Ctrl-C twice)\n")
    os._exit(128 + signum)


def stop_requested() -> int | None:
    """The signal received while a training loop ran, if any."""
    return _requested


@contextlib.contextmanager
def training_loop(saving: bool | None = None) -> Iterator[None]:
    """Mark a training loop as running: signals are deferred to its next step boundary, where it saves its state.
    Only where a stop can be saved (``saving``; by default: a run's training checkpoints are active, i.e. under
    ``train.py``): elsewhere (the Python API, ``downstream.py`` retraining a method) a loop never stops at a step
    boundary, so a signal acts at once."""
    global _loops
    if saving is None:
        from rewarduq_exp.core.training_checkpoint import active  # (it imports this module)

        saving = active() is not None
    if not saving:
        yield
        return
    _loops += 1
    try:
        yield
    finally:
        _loops -= 1


@contextlib.contextmanager
def deferred(message: str | None = None) -> Iterator[None]:
    """A block that a signal must not cut in half (an atomic write, a set of renames): a signal received inside it
    acts at its end. Outside a training loop that is a :class:`TrainingInterrupted` (with ``message``: what the block
    did, for the one line); inside one, the stop at the loop's next step boundary."""
    global _deferring
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
    if not _deferring and _deferred:
        signums = list(_deferred)
        _deferred.clear()
        for signum in signums:
            _act(signum, message, after_block=True)


def in_submitit_job() -> bool:
    return bool(os.environ.get("SUBMITIT_EXECUTOR"))


def one_line(interrupted: TrainingInterrupted, default: str) -> str:
    return " ".join(f"interrupted ({interrupted.signal_name}): {interrupted.message or default}".split())


def _write_stderr(text: str) -> None:
    """Straight to file descriptor 2: safe inside a signal handler (no buffer lock) and before ``os._exit``."""
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass


def leave(interrupted: TrainingInterrupted, default_message: str = "stopped") -> None:
    """Say in one line on stderr what was kept, and exit the way this job's environment expects (module docstring).
    Never returns."""
    global _state
    _state = LEAVING
    signum = interrupted.signum
    try:
        print(one_line(interrupted, default_message), file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    previous = _previous.get(signum)
    if in_submitit_job() and callable(previous) and getattr(previous, "__name__", "") == "checkpoint_and_try_requeue":
        uninstall()
        previous(signum, None)   # submitit: requeue (or refuse past max_num_timeout, raising) and exit
    raise SystemExit(128 + signum)


def entry_point(main: Callable[[], object], default_message: str | Callable[[], str] = "stopped") -> object:
    """Run an entry point's ``main()`` with the stop signals handled from the start (module docstring): an
    interruption that ``main`` did not turn into an exit itself (a signal while Hydra composes the config, while
    ``evaluate.py`` scores) is one line on stderr, ``interrupted (<SIGNAL>): <its message or default_message>``, and
    exit status 128 + the signal. A KeyboardInterrupt (a library that put Python's own SIGINT handler back) is taken
    as Ctrl-C."""
    owned = install()
    try:
        return main()
    except TrainingInterrupted as err:
        leave(err, default_message() if callable(default_message) else default_message)
    except KeyboardInterrupt:
        leave(TrainingInterrupted(signal.SIGINT, "KeyboardInterrupt"),
              default_message() if callable(default_message) else default_message)
    finally:
        if owned:
            uninstall()
