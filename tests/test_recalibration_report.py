"""scripts/recalibration_table.py on fake run folders: the before/after table over seeds."""

import numpy as np
import pytest
from fake_runs import block, make_run
from test_reports import run_script

from rewarduq_exp.analysis.recalibration_report import recalibration_rows, recalibration_table
from rewarduq_exp.runs.run_records import find_runs


def test_table_pairs_raw_and_recalibrated_over_seeds(tmp_path):
    root = tmp_path / "sweep"
    for seed, ece in ((0, 0.02), (1, 0.04)):
        recal = {"recal/ece": ece / 2, "recal/ebce": 0.001, "recal/rs_0.2": 0.5, "recal/ct_rate": 0.5,
                 "recal/cf_rate": 0.03, "recal/temperature": 1.5, "recal/scale": 0.8, "recal/conformal/scale": 2.0,
                 "recal/conformal/cf_share": 0.04, "recal/conformal/alpha": 0.05}
        make_run(root, f"s{seed}", seed=seed, metrics={"ultrafeedback_test": block(ece=ece, **recal)})
    make_run(root, "old", seed=2, hp={"learning_rate": 1e-2}, metrics={"ultrafeedback_test": block()})  # no recal/
    rows = recalibration_rows(find_runs([root]))
    assert len(rows) == 2 and set(rows["seed"]) == {0, 1}
    table = recalibration_table(rows)
    line = [x for x in table.splitlines() if x.startswith("| ens_mlp")][0]
    assert "0.030 (0.020-0.040) → 0.015 (0.010-0.020)" in line and "| 2 |" in line and "0.040 (0.05)" in line
    proc = run_script("recalibration_table.py", root, "--csv", tmp_path / "rows.csv")
    assert proc.returncode == 0, proc.stderr
    assert "0.030 (0.020-0.040) → 0.015 (0.010-0.020)" in proc.stdout and (tmp_path / "rows.csv").exists()


def _run_with_predictions(folder, table, temperature: float, scale: float):
    from rewarduq_exp.recalibration import Calibration, save_calibration

    (folder / "predictions").mkdir(parents=True)
    table.to_parquet(folder / "predictions" / "synthetic_eval.parquet")
    save_calibration(folder, Calibration(kind="pairs", temperature=temperature, scales={"rule": scale},
                                         interval="rule"))
    return folder


def _pairs(seed: int, n: int = 300):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    c, r, u = rng.normal(size=n), rng.normal(size=n), rng.uniform(0.1, 1.0, size=(2, n))
    return pd.DataFrame({"id": [f"p{i}" for i in range(n)], "weight": 1.0,
                         "chosen_reward": c + 0.5, "chosen_lower": c + 0.5 - u[0], "chosen_upper": c + 0.5 + u[0],
                         "rejected_reward": r, "rejected_lower": r - u[1], "rejected_upper": r + u[1]})


def test_difference_intervals_are_paired_and_zero_for_an_identity_recalibration(tmp_path):
    from omegaconf import OmegaConf

    from rewarduq_exp.analysis.recalibration_intervals import difference_intervals
    from rewarduq_exp.metrics.scoring import score_predictions
    from rewarduq_exp.recalibration import read_calibration
    from rewarduq_exp.recalibration.fit import recalibrated_metrics

    table = _pairs(0)
    same = _run_with_predictions(tmp_path / "identity", table, 1.0, 1.0)
    found = difference_intervals([(same, "synthetic_eval")], draws=20)
    assert all(v == (0.0, 0.0, 0.0) for v in found.values())   # recalibrated = raw on every resample: paired

    sharp = _run_with_predictions(tmp_path / "sharp", table, 0.5, 0.4)
    found = difference_intervals([(sharp, "synthetic_eval")], draws=60)
    cfg = OmegaConf.create({"n_bins": 20, "alphas": [0.0, 0.2, 1.0], "scoring": "pairs"})
    raw, recal = score_predictions(table, cfg), recalibrated_metrics(table, read_calibration(sharp), cfg)
    for m, (d, lo, hi) in found.items():
        assert abs(d - (recal[f"recal/{m}"] - raw[m])) < 1e-12 and lo <= hi
    assert found["ct_rate"][1] > 0   # a scale of 0.4 makes more pairs certain in every resample

    # A second run on the same pairs in another row order: aligned by id, it shares each draw's resample, so the
    # two runs do not differ: the interval is the pairs' alone (normal, from the same draws' spread) around the
    # single run's estimate, as wide as the single run's percentile interval up to the bootstrap's noise.
    shuffled = _run_with_predictions(tmp_path / "shuffled", table.sample(frac=1.0, random_state=1), 0.5, 0.4)
    both = difference_intervals([(sharp, "synthetic_eval"), (shuffled, "synthetic_eval")], draws=60)
    for m in found:
        assert abs(both[m][0] - found[m][0]) < 1e-12 and both[m][1] <= both[m][0] <= both[m][2]
        assert both[m][2] - both[m][1] == pytest.approx(found[m][2] - found[m][1], rel=0.5, abs=1e-9)

    # Runs that differ (three scales): at least Student's t with 2 degrees of freedom on the runs' spread
    from scipy.stats import t as t_dist

    third = _run_with_predictions(tmp_path / "third", table, 0.7, 0.9)
    runs = [(sharp, "synthetic_eval"), (same, "synthetic_eval"), (third, "synthetic_eval")]
    three = difference_intervals(runs, draws=60)
    points = np.array([[difference_intervals([run], draws=20)[m][0] for m in three] for run in runs])
    for j, m in enumerate(three):
        spread = t_dist.ppf(0.975, 2) * points[:, j].std(ddof=1) / np.sqrt(3)
        assert three[m][0] == pytest.approx(points[:, j].mean())
        assert three[m][2] - three[m][1] >= 2 * spread - 1e-12


def test_each_row_says_which_interval_its_s_is(tmp_path):
    """An evaluation with recalibrate_interval=conformal leaves the run's own rows (rule) and adds its own beside
    them: the table shows both, each with its interval; a run from before recal/interval shows '-'."""
    root = tmp_path / "sweep"
    own = {"recal/ece": 0.01, "recal/scale": 0.794, "recal/interval": "rule", "recal/temperature": 0.9}
    other = {"recal@conformal/ece": 0.012, "recal@conformal/scale": 1.642, "recal@conformal/interval": "conformal",
             "recal@conformal/temperature": 0.9}
    make_run(root, "new", seed=0, metrics={"synthetic_eval": block(**own, **other)})
    make_run(root, "old", seed=1, metrics={"synthetic_eval": block(**{"recal/ece": 0.02, "recal/scale": 0.5})})
    rows = recalibration_rows(find_runs([root]))
    assert sorted(zip(rows["run"], rows["interval"], rows["s"])) == [("new", "conformal", 1.642),
                                                                    ("new", "rule", 0.794), ("old", "-", 0.5)]
    table = recalibration_table(rows)
    assert "| T | interval | s |" in table
    assert "| 0.900 | rule | 0.794 |" in table and "| 0.900 | conformal | 1.642 |" in table
    assert "| - | 0.500 |" in table
