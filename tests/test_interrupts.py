"""Ctrl-C (SIGINT) and SIGTERM of the entry points: ONE line on stderr (``interrupted (SIGINT): <what was kept>``),
exit status 128 + the signal, no traceback.

* ``train.py``: the run is ``interrupted`` in status.json with its training state saved at the next step boundary;
  the same command resumes it and ends with the metrics of a run that was never stopped.
* ``evaluate.py``: nothing of the evaluation is kept (the run folder is exactly as before, no staging folder left);
  a staging folder left by an evaluate.py that died (``kill -9``) is removed by the next evaluation, a live one's is
  not; a metrics lock held by another process is waited for out loud (one log line naming the lock and its holder).
* ``downstream.py``: one line naming the task folder that lacks its results.
* The signal logic itself (rewarduq_exp/core/job_signals.py): a second Ctrl-C stops a training loop at once, a
  repeated SIGTERM does not, a checkpoint being written is never cut in half, and a Ctrl-C while leaving exits now.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import child_processes
import entry_points
import psutil
import pytest
import torch
from conftest import ROOT
from entry_points import run_entry_point
from filelock import FileLock
from safetensors import safe_open

from rewarduq_exp.core import job_signals
from rewarduq_exp.core.training_checkpoint import TrainingCheckpoints

# 195 optimizer steps of a few ms each, on features cached by the first run (300 texts: few backbone passes).
ARGS = ["progress=false", "method=ens_mlp", "method.num_heads=3", "dataset.n_train=200", "dataset.n_eval=50",
        "dataset.n_ood=50", "method.num_epochs=15", "method.batch_size=16", "metric.diagrams=false"]
EVAL_ARGS = ["device=cpu", "progress=false", "dataset=synthetic_eval", "metric.diagrams=false"]


def numbers(metrics: dict) -> dict:
    """metrics.json without wall-clock figures."""
    return {name: {k: v for k, v in block.items() if "second" not in k} for name, block in metrics.items()}


def snapshot(folder: Path) -> dict:
    """Every entry below ``folder``: a file by its bytes and mtime (the lock file, which filelock leaves, aside)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.name == ".metrics.json.lock":
            continue
        out[key] = ("folder",) if path.is_dir() else (path.read_bytes(), path.stat().st_mtime_ns)
    return out


def wait_for(condition, timeout=120.0, what="it"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shared_cache) -> Path:
    """A run of ARGS that nobody stopped: the metrics the resumed run must end with, and the run evaluated below."""
    cwd = tmp_path_factory.mktemp("reference")
    proc = run_entry_point(ROOT / "train.py", [*ARGS, f"paths.cache_dir={shared_cache}",
                                               f"paths.output_root={cwd / 'out'}"], cwd)
    assert proc.returncode == 0, proc.stderr
    (folder,) = (cwd / "out" / "runs").iterdir()
    return folder


def copy_of(folder: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(folder, run_dir)
    return run_dir


# ----------------------------------------------------------------------------------------------------------- train.py
@pytest.mark.e2e
def test_ctrl_c_saves_the_training_state_and_the_same_command_resumes_to_the_same_metrics(reference, shared_cache,
                                                                                          tmp_path):
    command = [sys.executable, str(ROOT / "train.py"), *ARGS, f"paths.cache_dir={shared_cache}",
               f"paths.output_root={tmp_path / 'out'}", "checkpoint.every_steps=1"]
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        # its own process group, signalled as a whole: what a terminal does on Ctrl-C to its foreground job
        child = subprocess.Popen(command, cwd=tmp_path, stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        wait_for(lambda: list((tmp_path / "out" / "runs").glob("*/checkpoint/*.safetensors")), what="training")
        os.killpg(child.pid, signal.SIGINT)
        child.wait(timeout=120)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    lines = err.read_text().splitlines()
    assert child.returncode == 130, (lines, out.read_text()[-2000:])
    (line,) = lines
    saved = re.fullmatch(r"interrupted \(SIGINT\): training state saved at step (\d+) of 195 of ens_mlp training; "
                         r"run the same command again to resume", line)
    assert saved, line
    step = int(saved.group(1))
    (folder,) = (tmp_path / "out" / "runs").iterdir()
    status = json.loads((folder / "status.json").read_text())
    assert status["state"] == "interrupted" and "interrupted by SIGINT at step" in status["error"], status
    (checkpoint,) = (folder / "checkpoint").glob("*.safetensors")
    with safe_open(str(checkpoint), framework="pt") as fh:
        assert json.loads(fh.metadata()["state"])["step"] == step

    again = run_entry_point(ROOT / "train.py", command[2:], tmp_path)   # the very same command
    assert again.returncode == 0, again.stderr
    assert [p.name for p in (tmp_path / "out" / "runs").iterdir()] == [folder.name]
    assert f"ens_mlp training: resumed at step {step} of 195" in (folder / "train.log").read_text()
    status = json.loads((folder / "status.json").read_text())
    assert [a["state"] for a in status["attempts"]] == ["interrupted", "completed"]
    assert not (folder / "checkpoint").exists()
    # exactly the numbers of the run that was never stopped (resumption is exact: tolerance 0)
    assert (numbers(json.loads((folder / "metrics.json").read_text()))
            == numbers(json.loads((reference / "metrics.json").read_text())))


# -------------------------------------------------------------------------------------------------------- evaluate.py
def start_in_child(script: str, args: list, cwd: Path, env: dict | None = None):
    """``python <script> <args>`` in a fork-server child (tests/child_processes.py: no 5 s of imports), its output
    captured, ``env`` added to its environment; returns (process, queue of its CompletedProcess)."""
    results = child_processes.queue()
    cmd = [sys.executable, str(ROOT / script), *map(str, args)]
    proc = child_processes.process(entry_points._child_main, (cmd, cwd, 0, env or {}, results))
    proc.start()
    return proc, results


def finished(proc, results) -> subprocess.CompletedProcess:
    try:
        _, done = results.get(timeout=120)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    return done


@pytest.mark.e2e
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_evaluate_scores_keeps_nothing(signum, reference, shared_cache, tmp_path):
    run_dir = copy_of(reference, tmp_path)
    lock = FileLock(str(run_dir / ".metrics.json.lock"))
    before = snapshot(run_dir)
    # More pairs than the run scored (their features are computed now), and the metrics lock held meanwhile: the
    # evaluation cannot finish before the signal, whenever it comes.
    with lock:
        proc, results = start_in_child("evaluate.py", [f"run={run_dir}", *EVAL_ARGS, "dataset.n_eval=300",
                                                       f"paths.cache_dir={shared_cache}"], tmp_path)
        wait_for(lambda: list(run_dir.glob(".evaluate-*")), what="the evaluation to stage its results")
        os.kill(proc.pid, signum)
        done = finished(proc, results)
    assert done.returncode == 128 + signum, done.stderr
    assert done.stderr.splitlines() == [f"interrupted ({signal.Signals(signum).name}): nothing of this evaluation "
                                        f"was kept: {run_dir} is as it was"]
    assert not list(run_dir.glob(".evaluate-*"))
    assert snapshot(run_dir) == before   # metrics.json, predictions, figures: untouched


@pytest.mark.e2e
def test_evaluate_waits_out_loud_for_a_held_lock_and_removes_only_the_staging_of_dead_evaluations(
        reference, shared_cache, tmp_path):
    run_dir = copy_of(reference, tmp_path)
    dead = subprocess.Popen(["true"])   # a process of this host that has ended
    dead.wait()
    me = psutil.Process(os.getpid())
    staged = {"dead": {"host": socket.gethostname(), "pid": dead.pid, "pid_started": time.time() - 5},
              "live": {"host": socket.gethostname(), "pid": me.pid, "pid_started": me.create_time()},
              "recycled": {"host": socket.gethostname(), "pid": me.pid, "pid_started": me.create_time() - 3600},
              "elsewhere": {"host": "another-node", "pid": dead.pid, "pid_started": time.time() - 5},
              "no-owner": None}
    for name, owner in staged.items():
        (run_dir / f".evaluate-{name}" / "predictions").mkdir(parents=True)
        if owner is not None:
            (run_dir / f".evaluate-{name}" / "owner.json").write_text(json.dumps(owner))

    lock_path = run_dir / ".metrics.json.lock"
    with FileLock(str(lock_path)):
        proc, results = start_in_child("evaluate.py", [f"run={run_dir}", *EVAL_ARGS, f"paths.cache_dir={shared_cache}"],
                                       tmp_path, env={"REWARDUQ_LOCK_NOTE_S": "0.2"})
        # scored and staged: from here it waits for the lock this process holds
        wait_for(lambda: list(run_dir.glob(".evaluate-*/predictions/*.parquet")), what="the staged predictions")
        time.sleep(2)
        assert proc.is_alive()
    done = finished(proc, results)   # the lock is released: it goes on and finishes
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if "waiting for" in x]   # one line, then it waits
    assert f"waiting for the metrics of {run_dir}: the lock {lock_path} is held by pid {os.getpid()} on this host" \
           in line, line
    assert "synthetic_eval" in json.loads((run_dir / "metrics.json").read_text())
    left = sorted(p.name for p in run_dir.glob(".evaluate-*"))
    # removed: the dead owner's and the one whose pid now belongs to a process started at another time
    assert left == [".evaluate-elsewhere", ".evaluate-live", ".evaluate-no-owner"], left
    assert f"removing {run_dir / '.evaluate-dead'}: left by evaluate.py (pid {dead.pid} on this host), which " \
           "is gone" in done.stdout


# ------------------------------------------------------------------------------------------------------ downstream.py
@pytest.mark.e2e
def test_ctrl_c_of_downstream_is_one_line(reference, shared_cache, tmp_path):
    task_dir = tmp_path / "ds"
    proc, results = start_in_child("downstream.py", ["task=best_of_n", f"run={reference}", "progress=false",
                                                     "task.prompts=8", "task.n_max=64", f"hydra.run.dir={task_dir}",
                                                     f"paths.cache_dir={shared_cache}"], tmp_path)
    wait_for(lambda: (task_dir / ".hydra" / "config.yaml").exists(), what="the task to start")
    time.sleep(0.5)   # into the task (loading the run, scoring 1024 candidates: seconds)
    os.kill(proc.pid, signal.SIGINT)
    done = finished(proc, results)
    assert done.returncode == 130, done.stderr
    assert done.stderr.splitlines() == [f"interrupted (SIGINT): the best_of_n task stopped before it finished; "
                                        f"{task_dir} lacks its results"]
    assert not (task_dir / "summary.csv").exists()


# ------------------------------------------------------------------------------------------ the signal logic itself
@pytest.fixture
def listening():
    job_signals.install()
    yield
    job_signals.uninstall()


def test_a_second_ctrl_c_stops_a_training_loop_at_once_a_repeated_sigterm_does_not(listening):
    with job_signals.training_loop(saving=True):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)   # Slurm may send it twice: still waiting for the step boundary
        assert job_signals.stop_requested() == signal.SIGTERM
    job_signals.install()
    with job_signals.training_loop(saving=True), pytest.raises(job_signals.TrainingInterrupted) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert job_signals.stop_requested() == signal.SIGINT   # the first: at the step boundary
        os.kill(os.getpid(), signal.SIGINT)                    # the second: now
    assert stop.value.forced
    job_signals.install()
    with pytest.raises(job_signals.TrainingInterrupted):       # outside a training loop: at once
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_checkpoint_being_written_is_never_cut_in_half(listening, tmp_path, monkeypatch):
    """Ctrl-C twice, the second while the state of the first is written: the file is written whole, then the
    process leaves (at the end of the write, or at the loop's step boundary right after)."""
    import safetensors.torch

    checkpoints = TrainingCheckpoints(tmp_path, "hash")
    phase = checkpoints.phase("loop")
    real = safetensors.torch.save_file

    def interrupted_save(tensors, path, metadata=None):
        os.kill(os.getpid(), signal.SIGINT)   # arrives in the middle of the write
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted_save)
    with job_signals.training_loop(saving=True):
        os.kill(os.getpid(), signal.SIGINT)       # the first Ctrl-C: save at the step boundary
        phase.save({"w": torch.ones(3)}, {"step": 5, "total": 9})   # not cut short
    assert phase.load(9).step == 5 and checkpoints.last_saved == "step 5 of 9 of loop"
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]
    # Outside a loop, a signal during the write acts right after it.
    job_signals.install()
    with pytest.raises(job_signals.TrainingInterrupted):
        phase.save({"w": torch.zeros(3)}, {"step": 9, "total": 9, "done": True})
    assert phase.load(9).done


def _leave_twice(stderr: str) -> None:
    os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT), 2)
    job_signals.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    except job_signals.TrainingInterrupted:
        os.kill(os.getpid(), signal.SIGINT)   # Ctrl-C while on the way out: exits at once
        os._exit(3)


def test_ctrl_c_while_leaving_exits_at_once(tmp_path):
    proc = child_processes.process(_leave_twice, (str(tmp_path / "stderr"),))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == 130
    assert (tmp_path / "stderr").read_text() == "interrupted (SIGINT): stopped at once (Ctrl-C twice)\n"


def test_the_waiting_line_names_the_holder_here_or_on_another_host(tmp_path):
    from rewarduq_exp.core import file_locks

    lock_path = tmp_path / "features.lock"
    with FileLock(str(lock_path)):   # held by this process: the kernel says so
        assert file_locks.holder(lock_path).startswith(f"pid {os.getpid()} on this host ({socket.gethostname()})")
    # Held by a process on another node of a shared filesystem: only its record beside the lock can say who.
    (tmp_path / "features.lock.holder").write_text(json.dumps({"pid": 4242, "host": "node7",
                                                                "since": "2026-01-01T10:00:00+0000"}))
    assert file_locks.holder(lock_path) == ("pid 4242 on host node7, since 2026-01-01T10:00:00+0000 (its record "
                                            "features.lock.holder)")
    # A record of this host whose process is gone is not believed.
    (tmp_path / "features.lock.holder").write_text(json.dumps({"pid": 4242, "host": socket.gethostname(),
                                                                "pid_started": 1.0}))
    assert file_locks.holder(lock_path) == "another process (not on this host, or not visible from here)"
    # Taken through held(), the record is there while the lock is held and gone after.
    with file_locks.held(lock_path, "the test"):
        assert json.loads((tmp_path / "features.lock.holder").read_text())["pid"] == os.getpid()
    assert not (tmp_path / "features.lock.holder").exists()
