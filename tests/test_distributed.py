"""``torchrun --nproc_per_node 2 train.py ...`` on CPU (gloo): one run folder, written by rank 0 only."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rewarduq_exp.distributed import launcher_overrides

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
SMALL = ["dataset.n_train=96", "dataset.n_eval=32", "dataset.n_ood=32", "progress=false", "device=cpu"]


def _torchrun(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "WANDB_MODE": "disabled"}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(ROOT / "train.py"), *SMALL, *overrides]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("method", ["mcd_dpo", "bay_lin"])
def test_torchrun_two_processes_one_run_folder(tmp_path, method):
    t0 = time.perf_counter()
    extra = ["method.num_samples=3"] if method == "mcd_dpo" else []
    proc = _torchrun(tmp_path, f"method={method}", "hydra.run.dir=outputs/runs/ddp", *extra)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    runs = sorted(p.name for p in (tmp_path / "outputs" / "runs").iterdir())
    assert runs == ["ddp"]
    run = tmp_path / "outputs" / "runs" / "ddp"
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "completed" and status["world_size"] == 2
    assert (run / "metrics.json").exists() and (run / "predictions").is_dir() and (run / "model").is_dir()
    assert proc.stdout.count("run folder:") == 1            # the summary is printed by rank 0 only
    # train.log is rank 0's: each "trained ..." line once, not once per rank
    assert (run / "train.log").read_text().count("trained ") == 1
    if method == "mcd_dpo":  # the ranks' shared datasets directory is removed after training
        assert not any((tmp_path / "outputs" / "cache" / "mcd_dpo_datasets").iterdir())
    assert seconds < 60, f"2-process run took {seconds:.1f} s"


def test_launcher_needs_an_explicit_run_dir(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    extra, error = launcher_overrides(["method=mcd_dpo"])
    assert "hydra.run.dir=" in error
    assert launcher_overrides(["hydra.run.dir=x"]) == (["hydra.output_subdir=null"], None)  # rank 1: no .hydra/
    monkeypatch.setenv("RANK", "0")
    assert launcher_overrides(["hydra.run.dir=x"]) == ([], None)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert launcher_overrides(["method=mcd_dpo"]) == ([], None)
