"""scripts/calibration_size_table.py's core (rewarduq_exp/analysis/calibration_size.py) on small synthetic tables:
the batched ECE is the metric's ECE, the draws are paired and summarised over runs with the t-interval, and bad
input is one line."""

import numpy as np
import pandas as pd
import pytest
from test_reports import run_script

from rewarduq_exp.analysis.calibration_size import (
    batched_ece,
    run_differences,
    size_differences,
    size_summary,
    size_table,
)
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.downstream.statistics import paired_t_interval
from rewarduq_exp.metrics.calibration import calibration_metrics


def test_the_batched_ece_is_the_metrics_ece():
    rng = np.random.default_rng(0)
    p = rng.uniform(0, 1, (7, 300))
    p[0, :10] = [0.3, 0.7, 0.35, 0.65, 0.0, 1.0, 0.5, 0.05, 0.95, 0.45]   # on bin edges, and their flips
    w = rng.uniform(0.5, 2.0, 300)
    got = batched_ece(p, w, n_bins=20)
    for row, value in zip(p, got):
        assert value == pytest.approx(calibration_metrics(row, row, row, np.ones(300), w, n_bins=20)["ece"],
                                      abs=1e-12)
    assert batched_ece(p[:1], None, 7)[0] == pytest.approx(
        calibration_metrics(p[0], p[0], p[0], np.ones(300), n_bins=7)["ece"], abs=1e-12)


def _margins(n, temperature, seed):
    rng = np.random.default_rng(seed)
    true = rng.normal(0, 2, n)
    sign = np.where(rng.random(n) < 1 / (1 + np.exp(-true)), 1.0, -1.0)
    return sign * temperature * true, np.ones(n)


def test_size_differences_are_paired_across_variants_and_reproducible():
    cal, evaluated = _margins(600, 0.6, 1), _margins(3000, 0.6, 2)
    found = size_differences(*cal, *evaluated, sizes=(20, 100), draws=6, seed=3)
    assert len(found) == 2 * 2 * 6 and set(found.variant) == {"before", "after"}
    # same subsets for both variants: the 'before' T is the maximum-likelihood T of that subset, by draw
    again = size_differences(*cal, *evaluated, sizes=(20, 100), draws=6, seed=3)
    pd.testing.assert_frame_equal(found, again)
    # an underconfident model (T 0.6) gains with 100 pairs either way
    assert (found[(found["size"] == 100)]["diff"] < 0).mean() > 0.8
    with pytest.raises(UserError, match=r"calibration sizes \[601\] are not in 1..600"):
        size_differences(*cal, *evaluated, sizes=(20, 601), draws=2)


def test_the_summary_is_the_t_interval_over_runs_means():
    rows = []
    for run, shift in (("a", 0.01), ("b", -0.02), ("c", 0.005)):
        for draw, d in enumerate((shift - 0.01, shift + 0.01, shift)):
            rows.append({"group": "g ens_mlp", "run": run, "variant": "after", "size": 20, "draw": draw, "diff": d,
                         "temperature": 0.9, "isotonic": False, "raw_ece": 0.04})
    summary = size_summary(pd.DataFrame(rows))
    want = paired_t_interval(np.array([0.01, -0.02, 0.005]))
    got = summary.iloc[0]
    assert got["runs"] == 3 and got["mean"] == pytest.approx(float(want.mean))
    assert (got["low"], got["high"]) == (pytest.approx(float(want.lo)), pytest.approx(float(want.hi)))
    assert got["worse"] == pytest.approx(4 / 9)   # draws with diff > 0 (0 is not worse), pooled over the runs
    table = size_table(summary)
    assert "| g ens_mlp (3) | 20 | 0.040 |" in table and f"{float(want.mean):+.4f}" in table


def test_a_run_without_the_splits_predictions_is_one_line(tmp_path):
    (tmp_path / "predictions").mkdir()
    with pytest.raises(UserError) as err:
        run_differences(tmp_path, "synthetic_cal", "synthetic_eval")
    assert "synthetic_cal.parquet is missing" in str(err.value) and "'eval_datasets=[synthetic_cal]' " \
        "recalibrated=false" in str(err.value) and "\n" not in str(err.value)


def test_the_script_runs_on_a_fake_run(tmp_path):
    from fake_runs import make_run

    root = tmp_path / "sweep"
    run = make_run(root, "r0", method="bay_lin", metrics={"synthetic_eval": {"win_rate": 0.7}})
    (run / "predictions").mkdir(exist_ok=True)
    for name, (n, seed) in {"synthetic_cal": (300, 1), "synthetic_eval": (1000, 2)}.items():
        margin, _ = _margins(n, 0.7, seed)
        pd.DataFrame({"id": [f"{name}{i}" for i in range(n)], "weight": 1.0, "chosen_reward": margin / 2,
                      "chosen_lower": margin / 2 - 0.3, "chosen_upper": margin / 2 + 0.3,
                      "rejected_reward": -margin / 2, "rejected_lower": -margin / 2 - 0.3,
                      "rejected_upper": -margin / 2 + 0.3}).to_parquet(run / "predictions" / f"{name}.parquet")
    proc = run_script("calibration_size_table.py", root, "--draws", "3", "--sizes", "20", "50", "--csv",
                      tmp_path / "draws.csv")
    assert proc.returncode == 0, proc.stderr
    assert "| sweep bay_lin (1) | 20 |" in proc.stdout and "ECE change after [95 %]" in proc.stdout
    assert len(pd.read_csv(tmp_path / "draws.csv")) == 2 * 2 * 3
    bad = run_script("calibration_size_table.py", root, "--sizes", "5000")
    assert bad.returncode == 2 and "calibration sizes [5000] are not in 1..300" in bad.stderr
