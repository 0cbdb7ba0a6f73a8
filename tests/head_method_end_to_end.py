"""The end-to-end checks every head on cached features meets as a user runs it (train.py on the tiny model, then
evaluate.py, the Python API, downstream.py's best-of-n and the planner), written once for the methods' own test
files (tests/test_knn_method.py, test_ddu_method.py, test_sngp.py)."""

import json
import math

import pandas as pd
import pytest
from conftest import ROOT
from entry_points import run_entry_point
from test_cli import NO_FIGURES, run

from rewarduq_exp.metrics import METRIC_NAMES

TINY_RUN = ["progress=false", "dataset.n_train=200", "dataset.n_eval=40", "dataset.n_ood=40", *NO_FIGURES]


def train_tiny(tmp_path_factory, shared_cache, method: str):
    """(cwd, run folder, process) of ``train.py method=<method>`` on the tiny defaults."""
    cwd = tmp_path_factory.mktemp(f"{method}_run")
    folder = cwd / "outputs" / "runs" / method
    proc = run("train.py", [f"method={method}", *TINY_RUN, f"hydra.run.dir={folder}"], cwd, shared_cache)
    return cwd, folder, proc


def assert_completed(folder, proc, method: str) -> dict:
    """The run completed and printed its table; returns method.json."""
    assert json.loads((folder / "status.json").read_text())["state"] == "completed"
    assert "synthetic_ood" in proc.stdout and "win_rate" in proc.stdout
    info = json.loads((folder / "model" / "method.json").read_text())
    assert info["method"] == method
    return info


def assert_evaluate_and_api_reproduce(folder, tmp_path, shared_cache):
    """evaluate.py on the saved run gives the training run's ood metrics (the saved state is all it needs), and the
    Python API scores as evaluate.py does."""
    from test_api import assert_api_scores_as_evaluate

    from rewarduq_exp.data.synthetic import SyntheticWorld

    before = json.loads((folder / "metrics.json").read_text())["synthetic_ood"]
    run("evaluate.py", [f"run={folder}", "dataset=synthetic_ood", "progress=false", *NO_FIGURES], tmp_path,
        shared_cache)
    after = json.loads((folder / "metrics.json").read_text())["synthetic_ood"]
    for key in METRIC_NAMES:
        if before.get(key) is not None and not (isinstance(before[key], float) and math.isnan(before[key])):
            assert after[key] == pytest.approx(before[key], abs=1e-9), key
    assert_api_scores_as_evaluate(folder, "synthetic_eval", SyntheticWorld(n_train=200, n_eval=40, n_ood=40)
                                  .load("eval"))


def assert_best_of_n_reads(run_folder, shared_cache, method: str):
    cwd, folder, _ = run_folder
    out = cwd / "outputs" / "bon"
    run("downstream.py", ["progress=false", f"hydra.run.dir={out}", "task=best_of_n", f"run={folder}",
                          "task.prompts=4", "task.n_max=32"], cwd, shared_cache)
    summary = pd.read_csv(out / "summary.csv")
    assert set(summary.method) == {method} and set(summary.split) == {"eval", "ood"}
    assert summary.gold_nmax.notna().all()


def assert_plans(tmp_path, method: str, part: str):
    """``plan=true`` at Qwen3-4B on UltraFeedback prints the plan with the method's own ``part`` and makes nothing."""
    proc = run_entry_point(ROOT / "train.py", [f"method={method}", "model=qwen3-4b", "dataset=ultrafeedback",
                                               "plan=true", f"paths.output_root={tmp_path}/out"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert part in proc.stdout and "62135 train pairs" in proc.stdout
    assert not (tmp_path / "out").exists()
