"""Recalibration in a run, as a user meets it: train.py fits it on the calibration split and writes calibration.json
and recal/<metric> beside every raw metric; evaluate.py and load_run apply it; a run folder from before it still
evaluates and loads (raw only, one line); a calibration split that overlaps an evaluated set is refused."""

import json

import numpy as np
import pandas as pd
import pytest
from test_cli import NO_FIGURES, run

import rewarduq_exp as r
from rewarduq_exp.recalibration import read_calibration

pytestmark = pytest.mark.e2e  # end to end: make test-e2e (.ci/run), not make test

SMALL = ["progress=false", "dataset.n_train=400", "dataset.n_eval=200", "dataset.n_ood=100", "dataset.n_cal=300"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_cache):
    cwd = tmp_path_factory.mktemp("recal")
    folder = cwd / "outputs" / "runs" / "bay_lin"
    proc = run("train.py", ["method=bay_lin", *SMALL, f"hydra.run.dir={folder}"], cwd, shared_cache)
    return cwd, folder, proc


def test_train_writes_calibration_and_recalibrated_metrics(trained):
    _, folder, proc = trained
    calibration = read_calibration(folder)
    assert calibration.fitted_on["split"] == "synthetic_cal" and calibration.fitted_on["n"] == 300
    data = json.loads((folder / "calibration.json").read_text())
    assert {"rule", "conformal"} == set(data["scales"]) and data["interval"] == "rule"
    assert data["conformal"]["alpha"] == 0.05 and data["conformal"]["guarantee"] == "high_probability"
    metrics = json.loads((folder / "metrics.json").read_text())
    for block in metrics.values():
        for key in ("win_rate", "ece", "ebce", "ct_rate", "cf_rate", "rs_0.2"):
            assert f"recal/{key}" in block
        assert block["recal/win_rate"] == block["win_rate"]
        assert block["recal/temperature"] == calibration.temperature
    # the calibration split is none of the evaluated sets: its rows are not in any predictions file
    summary = json.loads((folder / "data_summary.json").read_text())
    assert [s["dataset"] for s in summary][-1] == "synthetic_cal"
    assert "recalibrated" in proc.stdout   # the summary table's row under each dataset
    assert (folder / "figures" / "synthetic_eval" / "recalibrated" / "calibration_pred.png").exists()


def test_evaluate_applies_the_runs_recalibration(trained, tmp_path, shared_cache):
    _, folder, _ = trained
    before = json.loads((folder / "metrics.json").read_text())["synthetic_eval"]
    run("evaluate.py", [f"run={folder}", "dataset=synthetic_eval", "progress=false", *NO_FIGURES], tmp_path,
        shared_cache)
    after = json.loads((folder / "metrics.json").read_text())["synthetic_eval"]
    for key in ("recal/ece", "recal/ebce", "recal/rs_0.2", "recal/conformal/cf_share"):
        assert after[key] == pytest.approx(before[key], abs=1e-9)
    # the other criterion's scale goes beside the run's own rows, which stay; then raw only
    proc = run("evaluate.py", [f"run={folder}", "dataset=synthetic_eval", "progress=false",
                               "recalibrate_interval=conformal", *NO_FIGURES], tmp_path, shared_cache)
    conformal = json.loads((folder / "metrics.json").read_text())["synthetic_eval"]
    assert conformal["recal@conformal/scale"] == read_calibration(folder).scales["conformal"]
    assert conformal["recal@conformal/interval"] == "conformal" and conformal["recal/interval"] == "rule"
    for key in ("recal/ece", "recal/ct_rate", "recal/scale"):
        assert conformal[key] == pytest.approx(before[key], abs=1e-9)
    assert "recalibrated (conformal)" in proc.stdout
    run("evaluate.py", [f"run={folder}", "dataset=synthetic_eval", "progress=false", "recalibrated=false",
                        *NO_FIGURES], tmp_path, shared_cache)
    raw = json.loads((folder / "metrics.json").read_text())["synthetic_eval"]
    assert not [k for k in raw if k.startswith("recal/")] and raw["ece"] == before["ece"]
    # the calibration split itself is not evaluated with its own recalibration
    proc = run("evaluate.py", [f"run={folder}", "dataset=synthetic_cal", "progress=false", *NO_FIGURES], tmp_path,
               shared_cache, check=False)
    assert proc.returncode != 0 and "is the split this run's recalibration was fitted on" in proc.stderr


def test_load_run_scores_recalibrated_and_raw(trained):
    _, folder, _ = trained
    model = r.load_run(folder, progress=False)
    assert model.recalibrated and "recalibrated" in repr(model)
    prompts, texts = ["topic alpha", "topic beta"], ["a b c d e f g h", "h g f e d c b a"]
    raw, cal = model.score(prompts, texts, raw=True), model.score(prompts, texts)
    calibration = read_calibration(folder)
    expected = calibration.apply_arrays(raw.reward, raw.lower, raw.upper)
    for col, want in zip(("reward", "lower", "upper"), expected):
        np.testing.assert_allclose(cal[col], want, rtol=1e-12)
    np.testing.assert_allclose(cal.uncertainty, raw.uncertainty * calibration.scale / calibration.temperature,
                               rtol=1e-9)
    pairs = model.score_pairs(prompts, texts, texts[::-1])
    swapped = model.score(prompts, texts[::-1], raw=True)
    margin = (raw.reward - swapped.reward).to_numpy() / calibration.temperature
    np.testing.assert_allclose(pairs.p_chosen, calibration.probability(1 / (1 + np.exp(-margin))), rtol=1e-9)
    plain = r.load_run(folder, progress=False, recalibrated=False)
    assert not plain.recalibrated
    pd.testing.assert_frame_equal(plain.score(prompts, texts), raw)


def test_a_run_from_before_recalibration_evaluates_and_loads_raw(trained, tmp_path, shared_cache):
    import shutil

    _, folder, _ = trained
    old = tmp_path / "old_run"
    shutil.copytree(folder, old)
    (old / "calibration.json").unlink()
    proc = run("evaluate.py", [f"run={old}", "dataset=synthetic_eval", "progress=false", *NO_FIGURES], tmp_path,
               shared_cache)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "has no calibration.json" in line]
    assert len(lines) == 1 and "raw scores and metrics only" in lines[0]
    block = json.loads((old / "metrics.json").read_text())["synthetic_eval"]
    assert not [k for k in block if k.startswith("recal/")]
    assert not r.load_run(old, progress=False).recalibrated


def test_a_calibration_split_that_is_evaluated_is_refused(tmp_path, shared_cache):
    """Nothing reported may be fitted on what it is reported on: evaluating the calibration split in the same run is
    refused before training, in one line."""
    proc = run("train.py", ["method=bay_lin", *SMALL, *NO_FIGURES, "eval_datasets=[synthetic_eval,synthetic_cal]"],
               tmp_path, shared_cache, check=False)
    assert proc.returncode != 0
    line = [x for x in proc.stderr.splitlines() if "calibration split" in x]
    assert line and "shares 300 row(s) with the eval set synthetic_cal" in line[0]
    # with recalibration off, the same split may be evaluated
    run("train.py", ["method=bay_lin", *SMALL, *NO_FIGURES, "eval_datasets=[synthetic_cal]",
                     "recalibrate.enabled=false"], tmp_path, shared_cache)
