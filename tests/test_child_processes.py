"""The tests' child processes (tests/child_processes.py): forked from a fork server that never touches CUDA, never from
the test process, and the guard (tests/conftest.py) that fails a test which forks the test process."""

import os
import subprocess
import sys

import child_processes
import torch


def _report(results, use_cuda: bool) -> None:
    state = {"variable": os.environ.get("REWARDUQ_CHILD_TEST"), "cwd": os.getcwd(), "pid": os.getpid(),
             "bad_fork": torch.cuda._is_in_bad_fork(), "cuda_initialized": torch.cuda.is_initialized()}
    if use_cuda:  # the child can use the GPU itself
        state["cuda_sum"] = float(torch.ones(4, device="cuda").sum())
    results.put(state)


def test_a_child_gets_the_test_process_environment_and_no_cuda_state(tmp_path, monkeypatch):
    use_cuda = torch.cuda.is_available()
    if use_cuda:  # what an in-process run with device=auto leaves in this process on a GPU node
        torch.ones(1, device="cuda")
    monkeypatch.setenv("REWARDUQ_CHILD_TEST", "set after the fork server started")
    monkeypatch.chdir(tmp_path)
    results = child_processes.queue()
    child = child_processes.process(_report, (results, use_cuda))
    child.start()
    state = results.get(timeout=120)
    child.join(timeout=30)
    assert child.exitcode == 0 and state["pid"] != os.getpid()
    assert state["variable"] == "set after the fork server started" and state["cwd"] == str(tmp_path)
    assert not state["bad_fork"] and not state["cuda_initialized"]
    if use_cuda:
        assert state["cuda_sum"] == 4.0


def test_a_fork_of_the_test_process_is_recorded_and_a_subprocess_is_not():
    start = len(child_processes.FORKS)
    subprocess.run([sys.executable, "-c", "pass"], check=True)  # fork + exec in C: a new program, no state copied
    assert len(child_processes.FORKS) == start
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert len(child_processes.FORKS) == start + 1
    assert "test_a_fork_of_the_test_process_is_recorded" in child_processes.FORKS[-1]  # the stack of the fork
    del child_processes.FORKS[start:]  # recorded as it should be; not this test's failure
