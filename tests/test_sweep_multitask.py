"""Multi-GPU runs from the sweep launcher: ``hydra.launcher.tasks_per_node=N`` makes each job of a sweep one
torch.distributed run of N processes (rank 0 writes the run folder). Tested on CPU with submitit's local executor
(2 tasks, gloo), and on the sbatch script submitit writes for the 4-GPU Slurm profile."""

import json
import os

import pytest
from conftest import ROOT
from test_cli import run
from test_sweep import sbatch_dry_run

pytestmark = pytest.mark.e2e  # end to end: make test-e2e (.ci/run), not make test

TINY = ["method=bay_lin", "seed=0", "device=cpu", "progress=false", "dataset.n_train=96", "dataset.n_eval=32",
        "dataset.n_ood=32", "metric.diagrams=false"]


def test_two_task_local_job_is_one_distributed_run(tmp_path, shared_cache):
    sweep_dir = tmp_path / "sweep"
    proc = run("train.py", [*TINY, "hydra/launcher=local", "hydra.launcher.tasks_per_node=2",
                            f"hydra.sweep.dir={sweep_dir}"], tmp_path, shared_cache, flags=["-m"])
    log = proc.stdout + proc.stderr
    assert "sweep: 1 jobs: 1 completed" in log, log[-3000:]

    folders = [p.parent for p in sweep_dir.glob("*/status.json")]
    assert len(folders) == 1  # both tasks ran in the one run folder
    folder = folders[0]
    status = json.loads((folder / "status.json").read_text())
    assert status["state"] == "completed" and status["world_size"] == 2, status
    assert (folder / "metrics.json").exists()

    # The copy of the config: one .hydra folder in the sweep, written by rank 0 once it had claimed the folder.
    assert [p.relative_to(sweep_dir) for p in sweep_dir.rglob(".hydra")] == [folder.relative_to(sweep_dir) / ".hydra"]
    assert (folder / ".hydra" / "hydra.yaml").is_file() and (folder / ".hydra" / "overrides.yaml").is_file()
    # train.log is rank 0's alone (rank 1 logs to its own submitit log file only).
    assert (folder / "train.log").read_text().count("trained BayLin") == 1

    # Two submitit tasks of one job, ranks 0 and 1 of 2, both successful; the summary is printed once (rank 0).
    task_logs = sorted(sweep_dir.glob(".submitit/*/*_log.out"))
    assert len(task_logs) == 2, task_logs
    outs = [p.read_text() for p in task_logs]
    errs = [p.with_name(p.name.replace("_log.out", "_log.err")).read_text() for p in task_logs]
    for rank, (out, err) in enumerate(zip(outs, errs)):
        assert f"task {rank} of 2 of one torch.distributed job (master 127.0.0.1:" in out + err, out + err
        assert "Job completed successfully" in out + err and "Traceback" not in out + err, out + err
        assert "trained BayLin" in out  # every process trains
    assert sum(out.count("run folder:") for out in outs) == 1 and "run folder:" in outs[0]

    # Launched again: skipped before anything is submitted.
    again = run("train.py", [*TINY, "hydra/launcher=local", "hydra.launcher.tasks_per_node=2",
                             f"hydra.sweep.dir={sweep_dir}"], tmp_path, shared_cache, flags=["-m"])
    assert "sweep: 1 jobs: 0 completed, 1 skipped" in again.stdout
    assert sorted(sweep_dir.glob(".submitit/*/*_log.out")) == task_logs


def _export(monkeypatch, ntasks: int, rank: int):
    from hydra_plugins.rewarduq_launchers.skip_completed import _export_torch_distributed_env

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # recorded, so that what the export sets is undone after the test
        monkeypatch.delenv(key)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    env = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "4242", "SUBMITIT_LOCAL_NTASKS": str(ntasks),
           "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_NODEID": "0",
           "SUBMITIT_LOCAL_GLOBALID": str(rank), "SUBMITIT_LOCAL_LOCALID": str(rank)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return _export_torch_distributed_env()


def test_one_task_jobs_export_nothing(monkeypatch):
    assert _export(monkeypatch, ntasks=1, rank=0) is False
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ and "MASTER_ADDR" not in os.environ


def test_several_tasks_export_the_torch_distributed_env_and_keep_all_gpus(monkeypatch):
    assert _export(monkeypatch, ntasks=2, rank=1) is True
    assert {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    assert 20000 <= int(os.environ["MASTER_PORT"]) <= 60000  # from the job id: the same in every task
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"  # each process sees all GPUs and uses cuda:LOCAL_RANK


def test_slurm_script_for_the_4gpu_profile(tmp_path, shared_cache):
    args = ["sweep=bay_lin", "model=qwen3-0.6b", "hydra/launcher=example_h100_4gpu", "method.learning_rate=1e-3",
            "method.reg_lambda=1e-3,1e-2"]
    script = sbatch_dry_run(tmp_path, shared_cache, args, flags=["-m", "--config-dir", str(ROOT / "slurm")])
    for line in ("#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4", "#SBATCH --cpus-per-task=8",
                 "#SBATCH --nodes=1", "#SBATCH --partition=gpu-h100", "#SBATCH --array=0-1%2"):
        assert line in script, f"{line!r} not in the sbatch script:\n{script}"
    assert "srun" in script and "submitit.core._submit" in script
