"""The paper's sweeps on a real Slurm cluster (marked slurm: ``make test-slurm``; the local single-node cluster of
scripts/local_slurm.sh when no other answers), and training that survives the scheduler.

* a grid is one job array, throttled by ``array_parallelism``, and gives the local launcher's numbers;
* a failing point fails the multirun (exit 1) naming the run and its logs; the relaunch submits that point only;
* ``scancel`` of a running task and a killed launcher leave nothing that looks complete, and the relaunch finishes;
* one run on 2 tasks of one job (gloo) gives what one process gives; 8 tasks started at once, 8 consistent folders;
* a run longer than its time limit is requeued and finishes (bounded by ``max_num_timeout``), and a run requeued
  with ``scontrol requeue`` midway ends with the metrics of a run that never stopped.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import ROOT
from entry_points import run_entry_point
from slurm_cluster import slurm, slurm_cluster_fixture, wait_for  # noqa: F401
from test_cli import run

from rewarduq_exp.runs.run_identity import config_hash
from rewarduq_exp.runs.run_records import find_runs

pytestmark = pytest.mark.slurm

TINY = ["model=tiny-qwen3", "device=cpu", "progress=false", "dataset.n_train=64", "dataset.n_eval=32",
        "dataset.n_ood=32", "metric.diagrams=false"]
SLURM = ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1",
         "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=10"]
# Training long enough to be stopped in the middle (ENS-MLP on cached features: ~10 ms a step on 2 cores).
LONG = ["method=ens_mlp", "method.num_heads=3", "dataset.n_train=1000", "dataset.n_eval=64", "dataset.n_ood=64",
        "method.batch_size=16"]


def numbers(folder: Path) -> dict:
    """A run's metrics.json without wall-clock figures."""
    metrics = json.loads((folder / "metrics.json").read_text())
    return {name: {k: v for k, v in block.items() if "second" not in k} for name, block in metrics.items()}


def assert_time_covers_every_attempt(folder: Path) -> None:
    """A run that was stopped and resumed reports the time of all its attempts: status.json's seconds (and the list of
    attempts), method.json's training time."""
    status = json.loads((folder / "status.json").read_text())
    attempts = status["attempts"]
    assert len(attempts) >= 2 and attempts[-1]["state"] == "completed", attempts
    assert {a["state"] for a in attempts[:-1]} <= {"interrupted", "lost"}, attempts
    assert status["seconds"] == round(sum(a["seconds"] for a in attempts), 2) > attempts[-1]["seconds"], status
    fit = json.loads((folder / "model" / "method.json").read_text())["fit_summary"]
    assert 0 < fit["seconds_training_earlier_attempts"] < fit["seconds_training"], fit


def sweep_folders(cwd: Path) -> dict[str, Path]:
    return {p.parent.name: p.parent for p in cwd.glob("outputs/multirun/*/*/status.json")}


def task_ids(name: str) -> list[tuple[str, str]]:
    """(array task id, state) of the jobs called ``name``, one per array task."""
    out = slurm("squeue", "--noheader", "-r", f"--name={name}", "--format=%i|%T", check=False).stdout
    return [tuple(line.split("|")) for line in out.split()]


class QueueWatcher(threading.Thread):
    """Polls squeue for the jobs called ``name`` while a sweep runs: the most tasks seen running at once, and every
    array task id seen."""

    def __init__(self, name: str):
        super().__init__(daemon=True)
        self.name, self.most_running, self.tasks, self.done = name, 0, set(), threading.Event()

    def run(self):
        while not self.done.is_set():
            tasks = task_ids(self.name)
            self.tasks |= {task for task, _ in tasks}
            self.most_running = max(self.most_running, sum(state == "RUNNING" for _, state in tasks))
            time.sleep(0.3)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.join(timeout=5)


def launch(cwd: Path, cache: Path, *args: str, check: bool = False):
    cwd.mkdir(parents=True, exist_ok=True)
    return run("train.py", list(args), cwd, cache, flags=["-m"], check=check)


def test_a_grid_is_one_throttled_job_array_with_the_local_launchers_numbers(slurm_cluster, tmp_path, shared_cache):
    grid = ["method=ens_mlp", "method.num_heads=2,3", "method.reg_lambda=0.0,0.1", *TINY]
    launch(tmp_path / "local", shared_cache, *grid, check=True)
    name = f"grid-{os.getpid()}"
    with QueueWatcher(name) as queue:
        proc = launch(tmp_path / "slurm", shared_cache, *grid, *SLURM, f"hydra.launcher.name={name}",
                      "hydra.launcher.array_parallelism=1")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "sweep: 4 jobs: 4 completed" in log, log[-3000:]
    # One array of 4 tasks; never more than one running although the node has CPUs for more.
    assert len({task.split("_")[0] for task in queue.tasks}) == 1 and len(queue.tasks) >= 2, queue.tasks
    assert queue.most_running == 1, queue.most_running
    local, cluster = sweep_folders(tmp_path / "local"), sweep_folders(tmp_path / "slurm")
    assert sorted(local) == sorted(cluster) and len(local) == 4
    for key in local:
        assert numbers(cluster[key]) == numbers(local[key]), key
        assert json.loads((cluster[key] / "status.json").read_text())["slurm_job"].split("_")[1].isdigit()


def test_a_failing_point_fails_the_sweep_with_its_log_and_the_relaunch_submits_it_alone(slurm_cluster, tmp_path,
                                                                                       shared_cache):
    # max_length=5 leaves no pair after the length filter: only the run finds that, in its job, once the tokenizer
    # has counted (a value the method's settings refuse, num_heads=1 or reg_lambda=-1, is refused before anything is
    # submitted: the command line checks its bound, the planner of a Slurm sweep builds the checked settings)
    grid = ["method=ens_mlp", "max_length=2048,5", *TINY, *SLURM]
    proc = launch(tmp_path, shared_cache, *grid)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "sweep: 2 jobs: 1 completed, 0 skipped" in log and "1 failed" in log, log[-3000:]
    failed = next(line for line in log.splitlines() if line.strip().startswith("failed:"))
    assert "max_length=5" in failed and "empty after the length filter" in failed
    logs = [line.split("log:", 1)[1].strip() for line in log.splitlines() if line.strip().startswith("log:")]
    assert any(p.endswith("train.log") for p in logs) and any(".submitit" in p and "_log.err" in p for p in logs)
    assert all(Path(p).is_file() for p in logs), logs
    tasks = sorted(tmp_path.glob("outputs/multirun/*/.submitit/*/*_log.out"))   # one per job (array task)
    assert len(tasks) == 2

    again = launch(tmp_path, shared_cache, *grid)
    log = again.stdout + again.stderr
    assert again.returncode == 1 and "sweep: 2 jobs: 0 completed, 1 skipped" in log, log[-3000:]
    new = sorted(set(tmp_path.glob("outputs/multirun/*/.submitit/*/*_log.out")) - set(tasks))
    assert len(new) == 1, new   # one job: the failed point


def test_scancel_of_a_task_and_a_killed_launcher_leave_nothing_complete_and_the_relaunch_finishes(
        slurm_cluster, tmp_path, shared_cache):
    name = f"cancel-{os.getpid()}"
    grid = [*LONG, "method.num_epochs=30", "method.reg_lambda=0.0,0.1", *TINY[:3], "metric.diagrams=false",
            "checkpoint.every_steps=20", *SLURM, f"hydra.launcher.name={name}"]
    args = [sys.executable, str(ROOT / "train.py"), "-m", f"paths.output_root={tmp_path / 'outputs'}",
            f"paths.cache_dir={shared_cache}", *grid]
    launcher = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        checkpoint = wait_for(lambda: sorted(tmp_path.glob("outputs/multirun/*/*/checkpoint/*.safetensors")),
                              timeout=240, interval=0.2, what="a training checkpoint")[0]
        victim = checkpoint.parents[1]
        job = json.loads((victim / "status.json").read_text())["slurm_job"]
        slurm("scancel", job)
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
        wait_for(lambda: not task_ids(name), timeout=300, what="the other task to end")
    finally:
        launcher.kill()
        subprocess.run(["scancel", f"--name={name}"], check=False)
    records = {r.path.name: r for r in find_runs([tmp_path / "outputs" / "multirun"])}
    assert records[victim.name].state == "interrupted", records[victim.name]
    assert json.loads((victim / "status.json").read_text())["state"] == "interrupted"
    assert not (victim / "metrics.json").exists()
    selected = run_entry_point(ROOT / "scripts" / "select_runs.py", [str(tmp_path / "outputs" / "multirun"),
                                                                     "--dataset", "synthetic_eval", "--out",
                                                                     str(tmp_path / "sel")], tmp_path)
    assert "1 interrupted" in selected.stdout, selected.stdout

    again = launch(tmp_path, shared_cache, *grid)
    log = again.stdout + again.stderr
    assert again.returncode == 0 and "sweep: 2 jobs:" in log and "0 failed" in log, log[-3000:]
    assert "resumed at step" in (victim / "train.log").read_text()
    assert all(r.state == "completed" for r in find_runs([tmp_path / "outputs" / "multirun"]))


def test_one_run_on_two_tasks_of_a_job_gives_what_one_process_gives(slurm_cluster, tmp_path, shared_cache):
    point = ["method=ens_lora", "method.num_members=2", "method.lora_rank=4", "method.batch_size=8", "seed=0", *TINY]
    launch(tmp_path / "one", shared_cache, *point, check=True)
    proc = launch(tmp_path / "two", shared_cache, *point, *SLURM, "hydra.launcher.tasks_per_node=2")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (one,), (two,) = sweep_folders(tmp_path / "one").values(), sweep_folders(tmp_path / "two").values()
    assert json.loads((two / "status.json").read_text())["world_size"] == 2
    a, b = numbers(one), numbers(two)
    for dataset in a:
        for key, value in a[dataset].items():
            # Labels such as the recalibration's probability map must match exactly; numbers to float tolerance.
            expected = value if isinstance(value, str) else pytest.approx(value, rel=1e-4, abs=1e-5)
            assert b[dataset][key] == expected, (dataset, key)


def test_eight_tasks_started_together_write_eight_consistent_folders(slurm_cluster, tmp_path, shared_cache):
    if slurm_cluster.cpus < 8 and "OverSubscribe=YES" not in slurm("scontrol", "show", "partition").stdout:
        pytest.skip("needs 8 CPUs or a partition that lets jobs share CPUs (scripts/local_slurm.sh sets one up)")
    name = f"eight-{os.getpid()}"
    grid = ["method=ens_mlp", "method.num_heads=2,3,4,5", "method.reg_lambda=0.0,0.1", *TINY, *SLURM,
            f"hydra.launcher.name={name}", "hydra.launcher.array_parallelism=8",
            "+hydra.launcher.additional_parameters.oversubscribe=true"]
    with QueueWatcher(name) as queue:
        proc = launch(tmp_path, shared_cache, *grid)
    assert proc.returncode == 0 and "sweep: 8 jobs: 8 completed" in proc.stdout + proc.stderr
    assert queue.most_running == 8, queue.most_running
    folders = sweep_folders(tmp_path)
    assert len(folders) == 8
    from omegaconf import OmegaConf

    for folder in folders.values():
        status = json.loads((folder / "status.json").read_text())
        cfg = OmegaConf.load(folder / ".hydra" / "config.yaml")
        assert status["state"] == "completed" and status["config_hash"] == config_hash(cfg), folder
        assert folder.name.endswith(status["config_hash"][:10])
        method = json.loads((folder / "model" / "method.json").read_text())
        assert method["hyperparameters"]["num_heads"] == cfg.method.num_heads
        assert (folder / "metrics.json").is_file() and (folder / "train.log").read_text().count("run folder") == 0


def test_scontrol_requeue_midway_ends_with_the_metrics_of_a_run_never_requeued(slurm_cluster, tmp_path,
                                                                                shared_cache):
    point = [*LONG, "method.num_epochs=20", *TINY[:3], "metric.diagrams=false", "checkpoint.every_steps=50"]
    launch(tmp_path / "plain", shared_cache, *point, check=True)
    done = {}

    def requeue_midway():
        try:
            checkpoint = wait_for(lambda: sorted(tmp_path.glob("requeued/outputs/multirun/*/*/checkpoint/*")),
                                  timeout=240, interval=0.2, what="a training checkpoint")[0]
            done["job"] = json.loads((checkpoint.parents[1] / "status.json").read_text())["slurm_job"]
            slurm("scontrol", "requeue", done["job"])
        except Exception as error:  # reported by the test below instead of as a thread warning
            done["error"] = repr(error)

    thread = threading.Thread(target=requeue_midway, daemon=True)
    thread.start()
    proc = launch(tmp_path / "requeued", shared_cache, *point, *SLURM)
    thread.join(timeout=5)
    assert "error" not in done, done["error"]
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (plain,), (requeued,) = sweep_folders(tmp_path / "plain").values(), sweep_folders(tmp_path / "requeued").values()
    log = (requeued / "train.log").read_text()
    assert "interrupted by SIGTERM" in log and "resumed at step" in log, log[-2000:]
    assert numbers(requeued) == numbers(plain)
    assert_time_covers_every_attempt(requeued)
    assert slurm("scontrol", "show", "job", done["job"].split("_")[0], check=False).returncode in (0, 1)


def test_a_run_longer_than_its_time_limit_is_requeued_and_finishes(slurm_cluster, tmp_path, shared_cache):
    """A 2-minute limit: submitit's SIGUSR2 arrives before the limit, the run saves its state and submitit requeues
    the job, which resumes; ``max_num_timeout`` bounds the requeues.

    slurmctld checks time limits every 30 s and sends the warning signal at the first check within
    ``signal_delay_s`` + 30 s of the limit, so a 1-minute limit with a 35 s delay can signal a job as it starts, before
    its training loop. With 2 minutes and 60 s the signal comes 30-60 s after the start, while the run trains.
    The three runs go at once (each a fresh process): the bounded one alone, the requeued one with room for as many
    requeues as a loaded machine needs, and the reference run without a limit."""
    point = [*LONG, "method.num_epochs=500", *TINY[:3], "metric.diagrams=false"]
    limited = [*SLURM[:-1], "hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=60"]
    runs = {"limited": [*limited, "hydra.launcher.max_num_timeout=10"],
            "bounded": [*limited, "hydra.launcher.max_num_timeout=0"], "plain": []}
    for name in runs:
        (tmp_path / name).mkdir()
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = [pool.submit(run, "train.py", [*point, *extra], tmp_path / name, shared_cache, check=False,
                               flags=["-m"], fresh_process=True) for name, extra in runs.items()]
        proc, stopped, plain_proc = (future.result() for future in futures)

    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    (folder,) = sweep_folders(tmp_path / "limited").values()
    train_log = (folder / "train.log").read_text()
    assert "interrupted by SIGUSR2" in train_log and "resumed at step" in train_log, train_log[-2000:]
    assert plain_proc.returncode == 0, (plain_proc.stdout + plain_proc.stderr)[-3000:]
    (plain,) = sweep_folders(tmp_path / "plain").values()
    assert numbers(folder) == numbers(plain)
    assert_time_covers_every_attempt(folder)

    # No requeue allowed: the run stops at the first signal and is reported as unfinished, with its state saved.
    log = stopped.stdout + stopped.stderr
    assert stopped.returncode == 1 and "1 failed" in log, log[-3000:]
    assert "interrupted by SIGUSR2" in log and "launch the same command again to resume" in log, log[-3000:]
