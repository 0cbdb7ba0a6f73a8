"""Run ``train.py`` / ``evaluate.py`` as a user does, cheaply.

A command is run through ``runpy`` inside the test process: the same ``__main__`` code of the script, with its own
``sys.argv``, working directory, exit status, stdout and stderr. What a fresh interpreter would redo (importing torch,
transformers, Hydra: 4-5 s of every command on a 2-core CPU) is done once per test process, which is most of the test
suite's time otherwise.

A fresh process is used where the test needs one: environment variables that differ from this process's and that
libraries read once, at import (everything but ``READ_AT_RUN_TIME``), or ``fresh_process=True``.

:func:`run_ranks` runs one command as the N processes of a torch.distributed run, as ``torchrun --nproc_per_node N``
does (one process per rank, the ranks told by ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``), and
:func:`run_concurrently` runs several commands at the same moment; their processes are forked from the tests' fork
server (``tests/child_processes.py``), which has imported everything once and never touched CUDA, never from this
process (which may have: in-process commands run with ``device=auto``).
"""

from __future__ import annotations

import io
import logging
import os
import runpy
import subprocess
import sys
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import child_processes

# Read when a command runs, not when a library is imported: set for the command's duration in this process.
# REWARDUQ_DATASETS_DIR: the config's ${oc.env:...}; WANDB_*: wandb.init reads its settings from the environment.
# PATH: looked up when a program (sbatch) is started.
READ_AT_RUN_TIME = {"REWARDUQ_DATASETS_DIR", "WANDB_MODE", "WANDB_SILENT", "PATH"}


def _needs_fresh_process(args, env: dict | None) -> bool:
    changed = any(os.environ.get(k) != v for k, v in (env or {}).items() if k not in READ_AT_RUN_TIME)
    return changed


def run_entry_point(script: Path, args: list, cwd: Path, env: dict | None = None, timeout: int = 600,
                    fresh_process: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(script), *map(str, args)]
    if fresh_process or _needs_fresh_process(args, env):
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
    return _run_in_process(cmd, cwd, env or {})


def train_small_run(cwd: Path, cache, name: str = "ens_mlp") -> Path:
    """A small finished run (the default method, 200 training pairs, no figures) in ``cwd/outputs/runs/<name>``:
    what ``<run>`` stands for in a test of a command that reads one."""
    root = Path(__file__).resolve().parents[1]
    folder = Path(cwd) / "outputs" / "runs" / name
    proc = run_entry_point(root / "train.py", ["progress=false", "dataset.n_train=200", "dataset.n_eval=60",
                                               "dataset.n_ood=60", "metric.diagrams=false",
                                               f"paths.cache_dir={cache}", f"hydra.run.dir={folder}"], Path(cwd))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


def run_ranks(script: Path, args: list, cwd: Path, nprocs: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node <nprocs> <script> <args>`` with the ranks in forkserver children: their
    stdout and stderr concatenated in rank order and the first non-zero exit status."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, str(script), *map(str, args)]
    ranks = _in_children([cmd] * nprocs, cwd, timeout, lambda r: {"RANK": r, "LOCAL_RANK": r, "WORLD_SIZE": nprocs,
                                                              "LOCAL_WORLD_SIZE": nprocs, "MASTER_ADDR": "127.0.0.1",
                                                              "MASTER_PORT": port})
    code = next((p.returncode for p in ranks if p.returncode), 0)
    return subprocess.CompletedProcess(cmd, code, "".join(p.stdout for p in ranks), "".join(p.stderr for p in ranks))


def run_concurrently(script: Path, arg_lists: list[list], cwd: Path, timeout: int = 300) -> list:
    """Start ``python <script> <args>`` once per entry of ``arg_lists``, all at the same moment (forkserver children,
    so they start within milliseconds of each other and do not import everything again); their CompletedProcess
    results in the order given."""
    return _in_children([[sys.executable, str(script), *map(str, args)] for args in arg_lists], cwd, timeout,
                   lambda i: {})


def _in_children(cmds: list, cwd: Path, timeout: int, env_of) -> list:
    """Each command run in-process in its own forkserver child, with this process's environment plus
    ``env_of(i)`` (the i-th child's extra variables); the results in order."""
    results = child_processes.queue()
    procs = [child_processes.process(_child_main, (cmd, cwd, i, {k: str(v) for k, v in env_of(i).items()}, results))
             for i, cmd in enumerate(cmds)]
    for proc in procs:
        proc.start()
    try:
        done = dict(results.get(timeout=timeout) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [done[i] for i in range(len(cmds))]


def _child_main(cmd, cwd, index: int, env: dict, results) -> None:
    try:
        proc = _run_in_process(cmd, cwd, env)
    except BaseException as error:  # the parent waits for one result per child
        proc = subprocess.CompletedProcess(cmd, 1, "", repr(error))
    results.put((index, proc))


def _run_in_process(cmd: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    from hydra.core.global_hydra import GlobalHydra

    from rewarduq_exp.runs import sweep_outcome

    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_cwd, saved_env, saved_path = sys.argv, os.getcwd(), dict(os.environ), list(sys.path)
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    code = 0
    try:
        os.chdir(cwd)
        os.environ.update(env)
        sys.argv = cmd[1:]
        sys.path.insert(0, str(Path(cmd[1]).resolve().parent))  # as python does for a script
        sweep_outcome.clear()
        with redirect_stdout(out), redirect_stderr(err):
            try:
                runpy.run_path(cmd[1], run_name="__main__")
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            except BaseException:  # an uncaught exception ends an interpreter with status 1 and a traceback
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        GlobalHydra.instance().clear()
        for handler in root.handlers[:]:  # Hydra configured logging for the command's streams and train.log
            if handler not in saved_handlers:
                root.removeHandler(handler)
                handler.close()
        root.setLevel(saved_level)
    return subprocess.CompletedProcess(cmd, code, out.getvalue(), err.getvalue())
