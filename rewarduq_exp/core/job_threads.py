"""How many threads a run computes with: inside a Slurm job, the CPUs the job gave this process.

torch sizes its intra-op pool, and OpenBLAS / MKL / OpenMP theirs, from the machine's cores, not from the job's
allocation: two jobs with ``cpus_per_task=1`` on a 2-core node ran 2 threads each and trained about 15x slower than
with one thread each (slurm/README.md, "Threads"). So a run in a Slurm job (``SLURM_JOB_ID`` set) takes, in this order:

* ``SLURM_CPUS_PER_TASK`` (``hydra.launcher.cpus_per_task``), shared by the processes of one task (torchrun inside a
  one-task job; a job of several tasks, ``tasks_per_node``, gives each task, and so each rank, its own CPUs);
* else the job's CPUs on this node (``SLURM_CPUS_ON_NODE``, ``SLURM_JOB_CPUS_PER_NODE``) shared by this node's
  processes of the run;
* else the CPUs in the process's affinity mask (``os.sched_getaffinity``), shared by the processes of its task;

never more than the affinity mask holds, never fewer than one. The user's own choice wins: with ``OMP_NUM_THREADS``,
``MKL_NUM_THREADS`` or ``OPENBLAS_NUM_THREADS`` in the environment (exported before the launch, or with
``'hydra.launcher.setup=["export OMP_NUM_THREADS=4"]'``) nothing is changed. Outside Slurm nothing is changed either
(the machine's cores are the run's). The count is logged with its reason and recorded in ``status.json``
(``threads``, ``threads_reason``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

USER_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
_SET_HERE: dict[str, str] = {}   # variables this process exported itself: not the user's choice on a later run


@dataclass(frozen=True)
class ThreadChoice:
    threads: int | None   # None: leave torch's and BLAS's defaults alone
    reason: str


def _count(value: str | None) -> int | None:
    """The first number of a Slurm count (``4``, ``4(x2)``, ``4,2``: this node's comes first for a one-node job);
    None when absent or not a positive number."""
    found = re.match(r"\s*(\d+)", value or "")
    return (int(found.group(1)) or None) if found else None


def choose(environ: Mapping[str, str], affinity: int) -> ThreadChoice:
    """The thread count for a process with environment ``environ`` and ``affinity`` CPUs in its mask (see the
    module docstring)."""
    users = [f"{k}={environ[k]}" for k in USER_VARIABLES if environ.get(k) and _SET_HERE.get(k) != environ[k]]
    if users:
        return ThreadChoice(None, f"set by the user: {', '.join(users)}")
    if not environ.get("SLURM_JOB_ID"):
        return ThreadChoice(None, "not a Slurm job: torch's default")
    # Processes of this run on this node, and Slurm tasks among them: torchrun/accelerate processes inside one task
    # share its CPUs, while each task of a multi-task job (LOCAL_WORLD_SIZE = its tasks on the node) has its own.
    local = max(1, _count(environ.get("LOCAL_WORLD_SIZE")) or 1)
    tasks = _count(environ.get("SLURM_NTASKS_PER_NODE")) or _count(environ.get("SLURM_TASKS_PER_NODE")) or 1
    per_task = max(1, local // tasks)
    share = f" / {per_task} processes of this task" if per_task > 1 else ""
    if cpus := _count(environ.get("SLURM_CPUS_PER_TASK")):
        threads, why = cpus // per_task, f"SLURM_CPUS_PER_TASK={cpus}{share}"
    elif cpus := _count(environ.get("SLURM_CPUS_ON_NODE")) or _count(environ.get("SLURM_JOB_CPUS_PER_NODE")):
        here = max(local, tasks)
        threads, why = cpus // here, f"{cpus} CPUs of the job on this node" + (f" / {here} processes" if here > 1
                                                                                 else "")
    else:
        threads, why = affinity // per_task, f"{affinity} CPUs in the affinity mask{share}"
    if threads > affinity:
        threads, why = affinity, f"{why}, capped at the {affinity} CPUs of the affinity mask"
    return ThreadChoice(max(1, threads), why)


def affinity_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def apply(environ: dict | None = None) -> dict:
    """Set torch's and BLAS's threads for this run (:func:`choose`) and return what ``status.json`` records and the
    run logs: ``{"threads": <torch's intra-op threads now>, "threads_reason": <why>}``."""
    import torch
    from threadpoolctl import threadpool_limits

    environ = os.environ if environ is None else environ
    choice = choose(environ, affinity_cpus())
    if choice.threads is not None:
        torch.set_num_threads(choice.threads)
        # numpy's OpenBLAS and torch's OpenMP were loaded with the imports (Hydra's plugins, the launcher's job), so
        # their environment variables would come too late for this process: threadpoolctl sets the loaded pools.
        threadpool_limits(limits=choice.threads)
        for key in USER_VARIABLES:   # for the processes this one starts (they read them when they load BLAS)
            if key not in environ:
                environ[key] = _SET_HERE[key] = str(choice.threads)
    return {"threads": torch.get_num_threads(), "threads_reason": choice.reason}
