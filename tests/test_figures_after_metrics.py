"""matplotlib only when a figure is drawn, and a run's figures after its metrics: importing the runner, the metrics or
any figure module imports no matplotlib; evaluate_method can leave its diagrams for later; RunOutput.draw_figures
draws them, a failure logged and named without losing the others (a refused write fails the run); train.py writes
metrics.json and prints the summary table before it draws, and a figure that fails leaves the run complete with its
metrics."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT
from entry_points import run_entry_point
from omegaconf import OmegaConf

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.base import Scores
from rewarduq_exp.runner.evaluation import evaluate_method
from rewarduq_exp.runner.run_output import RunOutput
from rewarduq_exp.runs.run_folder import RunFolder

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.e2e   # a fresh interpreter importing the whole package (8 s on 2 cores): make test-e2e
def test_importing_the_runner_metrics_and_figure_modules_imports_no_matplotlib():
    code = """
import importlib, pkgutil, sys
import rewarduq_exp
for package in ("runner", "metrics", "downstream", "analysis"):
    root = importlib.import_module(f"rewarduq_exp.{package}")
    for module in pkgutil.walk_packages(root.__path__, f"{root.__name__}."):
        importlib.import_module(module.name)
print(sorted(m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout[-3000:]


class FixedScores:
    """A method that scores each completion by a fixed table: reward and u from the completion's text."""

    uses_feature_cache = True

    def __init__(self, n: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.chosen = Scores(rng.normal(size=n) + 0.4, rng.gamma(2.0, 0.3, n))
        self.rejected = Scores(rng.normal(size=n), rng.gamma(2.0, 0.3, n))

    def score_pairs(self, data):
        return self.chosen, self.rejected


def pairs_frame(n: int) -> pd.DataFrame:
    return pd.DataFrame({"id": [f"p{i}" for i in range(n)], "subset": "test", "weight": np.ones(n)})


def test_evaluate_method_leaves_its_diagrams_for_later(tmp_path):
    metric_cfg = OmegaConf.load(ROOT / "conf" / "metric" / "rewarduq.yaml")
    now, later_folder = RunFolder(tmp_path / "now"), RunFolder(tmp_path / "later")
    metrics_now, figures_now = evaluate_method(FixedScores(300), pairs_frame(300), "eval", now, metric_cfg)
    later = []
    metrics, figures = evaluate_method(FixedScores(300), pairs_frame(300), "eval", later_folder, metric_cfg,
                                       later=later)
    assert metrics == metrics_now and figures == [] and len(later) == 1
    assert later_folder.predictions_path("eval").is_file() and not later_folder.figures_dir("eval").exists()
    drawn = later[0]()
    assert [p.name for p in drawn] == [p.name for p in figures_now] == ["calibration_pred.png",
                                                                         "calibration_bounds.png"]
    for a, b in zip(drawn, figures_now):
        assert a.read_bytes()[:8] == PNG_MAGIC and a.read_bytes() == b.read_bytes()   # the same figures


def test_draw_figures_logs_a_failure_and_draws_the_others(tmp_path, caplog):
    def broken():
        raise RuntimeError("no canvas")

    png = tmp_path / "b.png"

    def draw():
        png.write_bytes(PNG_MAGIC)
        return [png]

    result = RunOutput({"a": {}, "b": {}}, {}, figures={"a": []}, drawings={"a": [broken], "b": [draw]})
    with caplog.at_level("WARNING"):
        failed = result.draw_figures()
    assert failed == ["a: RuntimeError: no canvas"]
    assert result.figures == {"a": [], "b": [png]} and result.drawings == {}
    assert "a: figures not drawn (RuntimeError: no canvas)" in caplog.text
    assert result.draw_figures() == []   # drawn once


def test_a_refused_write_while_drawing_fails_the_run():
    def refused():
        raise UserError("figures is a symbolic link")

    with pytest.raises(UserError, match="symbolic link"):   # as every refused write of a run (test_write_time_links)
        RunOutput({"a": {}}, {}, drawings={"a": [refused]}).draw_figures()


@pytest.mark.e2e   # a whole train.py run: make test-e2e
def test_train_writes_metrics_and_prints_the_summary_before_it_draws(tmp_path, shared_cache, monkeypatch):
    from rewarduq_exp.metrics import diagrams

    run_dir = tmp_path / "run"
    seen = []

    def drawing_fails(predictions, out_dir, **kwargs):
        # what the run has written and printed when its first figure is drawn
        seen.append(json.loads((run_dir / "metrics.json").read_text()))
        print("drawing now", flush=True)
        raise RuntimeError("the canvas broke")

    monkeypatch.setattr(diagrams, "plot_calibration_diagrams", drawing_fails)
    args = [f"paths.output_root={tmp_path / 'outputs'}", f"paths.cache_dir={shared_cache}", "progress=false",
            "dataset.n_train=600", "dataset.n_eval=200", "dataset.n_ood=200", "eval_datasets=[synthetic_eval]",
            "recalibrate.enabled=false", f"hydra.run.dir={run_dir}"]
    proc = run_entry_point(ROOT / "train.py", args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert seen == [metrics] and set(metrics) == {"synthetic_eval"}   # metrics.json complete before the drawing
    out = proc.stdout
    assert out.index("run folder:") < out.index("\ndataset ") < out.index("drawing now")
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed"
    assert status["figures_failed"] == ["synthetic_eval: RuntimeError: the canvas broke"]
    warning = "synthetic_eval: figures not drawn (RuntimeError: the canvas broke)"
    assert warning in proc.stdout + proc.stderr and warning in (run_dir / "train.log").read_text()
    assert not (run_dir / "figures").exists()

