"""hydra/launcher=slurm on a real Slurm cluster (the tests marked slurm: ``make test-slurm``, which starts the local
cluster of scripts/local_slurm.sh when no other answers), and what the launcher checks before it submits.

The cluster itself first: a throttled job array, requeue of a running job, a signal before the time limit, and job
accounting, which the launcher relies on as submitit does. Then the launcher: a sweep that runs on the cluster (with
accounting, and without it, where squeue stands in for sacct), and settings the cluster cannot satisfy, refused in one
line before anything is submitted. The tests without the slurm marker need no cluster and run in ``make test``.
"""

import json
import logging
import os
import stat
import threading
from pathlib import Path

import pytest
from slurm_cluster import sacct_states, sbatch, slurm, slurm_cluster_fixture, squeue_states, wait_for  # noqa: F401
from test_cli import run

from rewarduq_exp.core.errors import UserError

TINY = ["model=tiny-qwen3", "seed=0", "device=cpu", "progress=false", "dataset.n_train=64", "dataset.n_eval=32",
        "dataset.n_ood=32", "metric.diagrams=false"]
SLURM = ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1",
         "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=10"]


def fake_tools(folder: Path, **scripts: str) -> Path:
    """``folder`` (created) holding an executable shell script per keyword (its name: the tool's name)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in scripts.items():
        tool = folder / name
        tool.write_text("#!/bin/sh\n" + body)
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return folder


# -- the cluster ----------------------------------------------------------------------------------------------------

@pytest.mark.slurm
def test_array_runs_every_task_at_most_two_at_once(slurm_cluster, tmp_path):
    job = sbatch("--array=0-3%2", f"--output={tmp_path}/task_%a.out", "--wrap",
                 "echo task $SLURM_ARRAY_TASK_ID; sleep 4")
    most = 0

    def running_count_then_done():
        nonlocal most
        states = squeue_states(job)
        most = max(most, states.count("RUNNING"))
        return not any(s in ("PENDING", "RUNNING", "COMPLETING") for s in states)

    wait_for(running_count_then_done, timeout=120, interval=0.3, what=f"array job {job}")
    assert 1 <= most <= 2 and (most == 2 or slurm_cluster.cpus < 2), most
    for task in range(4):
        assert (tmp_path / f"task_{task}.out").read_text().strip() == f"task {task}"
    if slurm_cluster.accounting:
        states = wait_for(lambda: (s := sacct_states(job)) and all(v == "COMPLETED" for v in s.values()) and s,
                          timeout=30, what="sacct to record the array")
        assert sorted(states) == [f"{job}_{task}" for task in range(4)]


@pytest.mark.slurm
def test_requeue_runs_a_running_job_again(slurm_cluster, tmp_path):
    starts = tmp_path / "starts"
    job = sbatch("--requeue", f"--output={tmp_path}/out", "--wrap", f"echo start >> {starts}; sleep 300")
    try:
        wait_for(lambda: starts.exists() and squeue_states(job) == ["RUNNING"], timeout=60, what="the job to run")
        slurm("scontrol", "requeue", job)
        # a requeued job waits the cluster's cred_expire (10 s on the local cluster) before it starts again
        wait_for(lambda: len(starts.read_text().splitlines()) == 2, timeout=150, what="the requeued job to start")
    finally:
        slurm("scancel", job, check=False)
    assert starts.read_text() == "start\nstart\n"


@pytest.mark.slurm
def test_signal_arrives_before_the_time_limit(slurm_cluster, tmp_path):
    """What submitit's checkpointing relies on. The signal is due 10 s after the start (50 s before a 1 min limit);
    slurmctld looks at the jobs' time left about every 30 s, so it comes 10-40 s after the start, before the limit,
    which the test never waits for."""
    seen = tmp_path / "seen"
    script = tmp_path / "job.sh"
    # (the trap ends the sleep too: Slurm does not follow a process whose parent has exited)
    script.write_text(f"#!/bin/bash\ntrap 'echo USR2 > {seen}; kill $!; exit 0' USR2\nsleep 300 &\nwait\n")
    job = sbatch("--time=1", "--signal=B:USR2@50", f"--output={tmp_path}/out", str(script))
    try:
        wait_for(seen.exists, timeout=90, what="USR2 in the job")
    finally:
        slurm("scancel", job, check=False)
    assert seen.read_text() == "USR2\n"


@pytest.mark.slurm
def test_sacct_records_jobs(slurm_cluster, tmp_path):
    if not slurm_cluster.accounting:
        pytest.skip("this cluster keeps no job accounting (e.g. LOCAL_SLURM_ACCOUNTING=0)")
    job = sbatch(f"--output={tmp_path}/out", "--wrap", "true")
    wait_for(lambda: sacct_states(job).get(job) == "COMPLETED", timeout=60, what=f"sacct to say job {job} completed")


# -- the launcher: a sweep on the cluster ---------------------------------------------------------------------------

def sweep(tmp_path, cache, *args, env=None):
    return run("train.py", ["method=ens_mlp,bay_lin", *TINY, *SLURM, *args], tmp_path, cache, flags=["-m"],
               check=False, env=env)


def no_accounting(tmp_path) -> dict:
    """An environment whose sacct answers as on a cluster without slurmdbd (squeue, scancel are the real ones)."""
    fake = fake_tools(tmp_path / "no_accounting", sacct='echo "Slurm accounting storage is disabled" >&2\nexit 1\n')
    return {"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.slurm
@pytest.mark.parametrize("accounting", ["as set up", "off"])
def test_sweep_runs_on_the_cluster(slurm_cluster, tmp_path, shared_cache, accounting):
    # (the job inherits the tests' OMP_NUM_THREADS=1, a user's choice it would keep: unset, Slurm alone decides)
    proc = sweep(tmp_path, shared_cache, "hydra.launcher.setup=[unset OMP_NUM_THREADS MKL_NUM_THREADS]",
                 env=None if accounting == "as set up" else no_accounting(tmp_path))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "sweep: 2 jobs: 2 completed, 0 skipped" in log, log[-3000:]
    assert "Bypassing sacct error" not in log and "WARNING" not in log, log[-3000:]
    assert len(list(tmp_path.glob("outputs/multirun/*/.submitit/*_*/*_log.out"))) == 2  # two tasks of one array
    # cpus_per_task=1: torch computes on one thread in the job (its own count, read there), whatever the node has
    for folder in tmp_path.glob("outputs/multirun/*/*/status.json"):
        status = json.loads(folder.read_text())
        assert status["threads"] == 1 and status["threads_reason"] == "SLURM_CPUS_PER_TASK=1", status
        assert "threads: 1 (SLURM_CPUS_PER_TASK=1)" in (folder.parent / "train.log").read_text()
    if accounting == "off" or not slurm_cluster.accounting:
        assert log.count("keeps no job accounting") == 1  # said once, not at every poll


@pytest.mark.slurm
def test_sweep_ends_when_its_jobs_are_cancelled_without_accounting(slurm_cluster, tmp_path, shared_cache):
    """Without accounting, a job that ends without a result (here: cancelled) is seen through squeue; submitit alone
    would ask sacct for ever and wait for ever."""
    name = f"cancel-me-{os.getpid()}"

    def cancel_when_running():
        def running():
            out = slurm("squeue", "--noheader", "-r", f"--name={name}", "--format=%i|%T", check=False).stdout
            return [line.split("|")[0] for line in out.split() if line.endswith("|RUNNING")]

        jobs = wait_for(running, timeout=120, what="the sweep's jobs to run")
        slurm("scancel", f"--name={name}", check=False)
        return jobs

    canceller = threading.Thread(target=cancel_when_running, daemon=True)
    canceller.start()
    proc = sweep(tmp_path, shared_cache, f"hydra.launcher.name={name}", "hydra.launcher.setup=[sleep 300]",
                 env=no_accounting(tmp_path))
    canceller.join(timeout=5)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log[-3000:]
    assert "ended without a result" in log and "has not produced any output" in log, log[-3000:]
    assert "Bypassing sacct error" not in log


@pytest.mark.slurm
def test_watcher_without_accounting_follows_jobs_through_squeue(slurm_cluster, tmp_path, monkeypatch, caplog):
    from hydra_plugins.rewarduq_launchers.slurm_checks import ENDED_UNRECORDED, squeue_fallback_watcher_class

    monkeypatch.setenv("PATH", no_accounting(tmp_path)["PATH"])
    watcher = squeue_fallback_watcher_class()(delay_s=1)
    job = sbatch(f"--output={tmp_path}/out", "--wrap", "sleep 300")
    forgotten = str(int(job) + 50000)  # an id the cluster does not know: as a job purged from its memory
    try:
        with caplog.at_level(logging.INFO):
            assert watcher.get_state(job, mode="force") in ("PENDING", "RUNNING")
            assert not watcher.is_done(job, mode="force")
            assert watcher.get_state(forgotten, mode="force") == ENDED_UNRECORDED
            assert watcher.is_done(forgotten, mode="cache")
            slurm("scancel", job)
            wait_for(lambda: watcher.is_done(job, mode="force"), timeout=60, what="the watcher to see the cancel")
    finally:
        slurm("scancel", job, check=False)
    assert watcher.get_state(job, mode="cache") in ("CANCELLED", ENDED_UNRECORDED)
    said = [r.getMessage() for r in caplog.records if r.name.endswith("slurm_checks")]
    assert watcher.num_calls >= 3 and len(said) == 1 and "keeps no job accounting" in said[0], said


# -- the launcher: settings the cluster cannot satisfy ----------------------------------------------------------------

@pytest.mark.slurm
@pytest.mark.parametrize("override, expected", [
    ("hydra.launcher.partition=nope", ["hydra.launcher.partition=nope: nope is not a partition", "allowed: debug"]),
    ("hydra.launcher.mem_gb=100000", ["hydra.launcher.mem_gb=100000 is more memory than any node", " MB = "]),
    ("hydra.launcher.cpus_per_task=100000", ["needs 100000 CPUs on a node", "lower hydra.launcher.cpus_per_task"]),
    ("hydra.launcher.gpus_per_node=1", ["hydra.launcher.gpus_per_node=1 but", "has no GPUs",
                                        "set hydra.launcher.gpus_per_node=0 for CPU jobs"]),
], ids=["partition", "memory", "cpus", "gpus"])
def test_impossible_settings_are_refused_before_submitting(slurm_cluster, tmp_path, shared_cache, override,
                                                           expected):
    if override.endswith("partition=nope") and "debug" not in slurm("sinfo", "-h", "-o", "%R").stdout.split():
        expected = expected[:1]  # another cluster than the local one: its own partitions
    before = slurm("squeue", "--noheader", "--format=%i").stdout.split()
    proc = sweep(tmp_path, shared_cache, override)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for part in expected:
        assert part in lines[0], lines[0]
    assert not list(tmp_path.glob("outputs/multirun/*/.submitit"))  # nothing submitted
    assert slurm("squeue", "--noheader", "--format=%i").stdout.split() == before


# -- no cluster needed ------------------------------------------------------------------------------------------------

def test_no_sbatch_on_the_path_is_one_line(tmp_path):
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "sbatch").exists())
    proc = sweep(tmp_path, tmp_path / "cache", env={"PATH": path})  # (no job runs: no model needed in the cache)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    assert proc.stderr == ("error: hydra/launcher=slurm needs Slurm's sbatch on the PATH (not found); run on a cluster "
                           "login node, or start a local one with scripts/local_slurm.sh start\n")
    assert not list(tmp_path.glob("outputs/multirun/*/.submitit"))


def test_a_controller_that_does_not_answer_is_one_line(tmp_path, monkeypatch):
    from hydra_plugins.rewarduq_launchers.slurm_checks import check_submission

    fake = fake_tools(tmp_path / "bin", sbatch="exit 1\n", sinfo="exec sleep 30\n")
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(UserError, match=r"^Slurm's controller did not answer sinfo in 1 s, .*check the cluster"):
        check_submission({"partition": None, "mem_gb": 1}, timeout_s=1)


def test_gpus_are_counted_from_sinfo_gres():
    from hydra_plugins.rewarduq_launchers.slurm_checks import _gpu_count

    assert _gpu_count("(null)") == 0
    assert _gpu_count("gpu:4") == 4
    assert _gpu_count("gpu:a100:4(S:0,1),gpu:v100:2,shard:8") == 6
