"""Child processes of the tests: forked from a fork server that never touches CUDA, never from the test process.

A child forked from a process that has initialised CUDA cannot use CUDA ("Cannot re-initialize CUDA in forked
subprocess", "CUDA error: initialization error"), and on a GPU machine a child forked after a backward pass cannot run
autograd ("Unable to handle autograd's threading in combination with fork-based multiprocessing"). On a GPU node the
tests run commands in-process with ``device=auto``, which picks CUDA, so the test process may have done both by the
time a test starts a child: the test process itself is never forked (``tests/conftest.py`` fails a test that forks
it).

Every child comes instead from multiprocessing's fork server (:data:`CONTEXT`): a fresh interpreter, started (fork +
exec, which carries no CUDA state) by :func:`start_server` when the test session starts, that imports the heavy
modules once (``tests/forkserver_preload.py``) and then only forks. So a child costs milliseconds, not the 4-5 s of
imports of a fresh interpreter on 2 cores, and starts with no CUDA state and no autograd threads.

A forkserver child inherits the server's state, not the test's: multiprocessing passes it the test process's
``sys.path`` and working directory, and :func:`process` / :func:`start_ranks` pass the environment as it is when the
child starts (tests set variables with ``monkeypatch``). The target and its arguments are pickled: the target must be
a module-level function.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
import traceback

CONTEXT = multiprocessing.get_context("forkserver")

# The forks of this (the test) process, one stack each: recorded by the at-fork hook that tests/conftest.py installs.
FORKS: list[str] = []
_GUARDED_PID: int | None = None

USE_INSTEAD = ("use tests/child_processes.py (process(), start_ranks(), or entry_points.run_ranks / "
               "run_concurrently): their children are forked from a fork server that never touches CUDA")


def start_server() -> None:
    """Start the fork server now, with the test process's environment as it is at session start (the preloaded
    modules read some variables once, at import, as they did in this process). Returns at once: the server imports
    its modules in the background, and the first child waits for it."""
    CONTEXT.set_forkserver_preload(["forkserver_preload"])
    # The server finds tests/forkserver_preload.py (and what it imports) on this process's sys.path, which Python
    # 3.11's fork server does not apply to itself (its children do get it).
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*sys.path, *([saved] if saved else [])])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def install_fork_guard() -> None:
    """Record every fork of this process (``os.fork``, a multiprocessing "fork" context, ``multiprocessing.Manager``,
    DataLoader workers, ...) in :data:`FORKS`. ``subprocess`` does not count: it forks and execs in C without running
    Python's at-fork hooks (unless given a ``preexec_fn``), and the new program starts with no CUDA state."""
    global _GUARDED_PID
    if _GUARDED_PID is not None:
        return
    _GUARDED_PID = os.getpid()

    def record() -> None:
        if os.getpid() == _GUARDED_PID:  # a fork of a child of this process is that child's business
            FORKS.append("".join(traceback.format_stack(limit=9)[:-1]))

    os.register_at_fork(before=record)


def _check_no_cuda_state() -> None:
    import torch

    if torch.cuda._is_in_bad_fork():
        raise RuntimeError("this child was forked from a process that had initialised CUDA: something imported by "
                           "tests/forkserver_preload.py initialises CUDA (e.g. torch.cuda.is_available() at import)")


def _call(env: dict, target, args: tuple):
    os.environ.clear()
    os.environ.update(env)
    _check_no_cuda_state()
    return target(*args)


def process(target, args: tuple = (), env: dict | None = None):
    """A (not yet started) process that runs ``target(*args)`` with this process's environment (or ``env``)."""
    return CONTEXT.Process(target=_call, args=(dict(os.environ) if env is None else env, target, args))


def queue():
    """A queue that the children of :func:`process` can put their results in."""
    return CONTEXT.Queue()


def _ranked(i: int, env: dict, target, *args) -> None:
    _call(env, target, (i, *args))


def start_ranks(target, args: tuple = (), nprocs: int = 2) -> None:
    """``torch.multiprocessing.start_processes(target, args, nprocs)`` with forkserver children: ``target(i, *args)``
    in ``nprocs`` processes, waiting for all; a child's exception is raised here."""
    import torch.multiprocessing as mp

    mp.start_processes(_ranked, args=(dict(os.environ), target, *args), nprocs=nprocs, join=True,
                       start_method="forkserver")
