"""scripts/recalibration_table.py on fake run folders: the before/after table over seeds."""

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
