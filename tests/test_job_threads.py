"""The threads a run computes with inside a Slurm job (rewarduq_exp.core.job_threads): the job's CPUs, shared by the
processes of one task, unless the user chose; nothing changes outside Slurm."""

import os

import child_processes
import pytest

from rewarduq_exp.core import job_threads
from rewarduq_exp.core.job_threads import choose

JOB = {"SLURM_JOB_ID": "7"}


@pytest.mark.parametrize("environ, affinity, threads, reason", [
    ({}, 8, None, "not a Slurm job"),
    ({**JOB, "SLURM_CPUS_PER_TASK": "1", "SLURM_CPUS_ON_NODE": "2"}, 2, 1, "SLURM_CPUS_PER_TASK=1"),
    ({**JOB, "SLURM_CPUS_PER_TASK": "4"}, 16, 4, "SLURM_CPUS_PER_TASK=4"),
    # a job of 2 tasks (tasks_per_node=2): every task, so every rank, has its own cpus_per_task
    ({**JOB, "SLURM_CPUS_PER_TASK": "4", "SLURM_NTASKS_PER_NODE": "2", "LOCAL_WORLD_SIZE": "2"}, 16, 4,
     "SLURM_CPUS_PER_TASK=4"),
    # torchrun with 4 processes inside a one-task job: they share the task's 8 CPUs
    ({**JOB, "SLURM_CPUS_PER_TASK": "8", "LOCAL_WORLD_SIZE": "4"}, 8, 2, "/ 4 processes of this task"),
    ({**JOB, "SLURM_CPUS_ON_NODE": "6"}, 64, 6, "6 CPUs of the job on this node"),
    ({**JOB, "SLURM_JOB_CPUS_PER_NODE": "6(x2)", "SLURM_TASKS_PER_NODE": "3(x2)", "LOCAL_WORLD_SIZE": "3"}, 64, 2,
     "/ 3 processes"),
    ({**JOB}, 3, 3, "3 CPUs in the affinity mask"),
    ({**JOB, "SLURM_CPUS_PER_TASK": "8"}, 2, 2, "capped at the 2 CPUs of the affinity mask"),
    ({**JOB, "SLURM_CPUS_PER_TASK": "1", "LOCAL_WORLD_SIZE": "4"}, 4, 1, "SLURM_CPUS_PER_TASK=1"),   # never 0
    ({**JOB, "SLURM_CPUS_PER_TASK": "1", "OMP_NUM_THREADS": "3"}, 4, None, "set by the user: OMP_NUM_THREADS=3"),
    ({**JOB, "SLURM_CPUS_PER_TASK": "1", "MKL_NUM_THREADS": "2"}, 4, None, "MKL_NUM_THREADS=2"),
    ({**JOB, "SLURM_CPUS_PER_TASK": "garbage", "SLURM_CPUS_ON_NODE": "2"}, 4, 2, "2 CPUs of the job on this node"),
], ids=["no-slurm", "cpus_per_task=1", "cpus_per_task=4", "two-tasks", "torchrun-in-a-task", "cpus-on-node",
        "cpus-per-node-3-ranks", "affinity", "capped", "at-least-one", "user-omp", "user-mkl", "bad-count"])
def test_the_thread_count_and_its_reason(environ, affinity, threads, reason):
    choice = choose(environ, affinity)
    assert choice.threads == threads, choice
    assert reason in choice.reason, choice


def _apply_and_report(results) -> None:
    import torch
    from threadpoolctl import threadpool_info

    info = job_threads.apply()
    again = job_threads.apply()   # a second run in this process: the variables it exported are not the user's
    results.put({**info, "torch": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
                 "pools": sorted({p["num_threads"] for p in threadpool_info()}), "again": again})


def test_a_slurm_job_with_one_cpu_computes_on_one_thread(monkeypatch):
    """Applied in a child process (the test process's own threads stay as they are)."""
    for key in job_threads.USER_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    results = child_processes.queue()
    child = child_processes.process(_apply_and_report, (results,),
                                    env={**os.environ, **JOB, "SLURM_CPUS_PER_TASK": "1"})
    child.start()
    got = results.get(timeout=60)
    child.join(timeout=60)
    assert got["threads"] == got["torch"] == 1 and got["threads_reason"] == "SLURM_CPUS_PER_TASK=1", got
    assert got["pools"] == [1], got          # numpy's OpenBLAS and torch's OpenMP too
    assert got["omp"] == "1"                 # for the processes the run starts
    assert got["again"] == {"threads": 1, "threads_reason": "SLURM_CPUS_PER_TASK=1"}
