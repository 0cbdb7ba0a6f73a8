"""Recalibration that is never silently wrong (issue 54): an infeasible conformal scale is said in one line and never
applied (train, evaluate, downstream, old calibration.json files), a temperature from few pairs does not make the
probabilities worse, and the recalibrated rows say which interval scale they hold."""

import json
import logging

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.downstream.calibrated_scale import calibration_info
from rewarduq_exp.recalibration import (
    Calibration,
    fit_calibration,
    read_calibration,
    recalibrate_settings,
    recalibrated_metrics,
    recalibrated_pointwise_metrics,
    save_calibration,
)
from rewarduq_exp.recalibration.conformal import allowed_losses, conformal_scale, smallest_feasible_n
from rewarduq_exp.recalibration.fit import fit_probability_map, interval_prefix
from rewarduq_exp.recalibration.probability import cross_fitted_log_loss, fit_temperature

METRIC = OmegaConf.create({"n_bins": 20, "alphas": [0.0, 0.2, 1.0], "scoring": "auto"})


def pairs(margin, half=0.3) -> pd.DataFrame:
    """Pairs with chosen - rejected = ``margin`` and every bound ``half`` from its reward."""
    margin = np.asarray(margin, dtype=float)
    n = len(margin)
    half = np.broadcast_to(np.asarray(half, dtype=float), (n,))
    return pd.DataFrame({"id": [f"p{i}" for i in range(n)], "subset": "s", "weight": 1.0,
                         "chosen_reward": margin / 2, "chosen_lower": margin / 2 - half,
                         "chosen_upper": margin / 2 + half, "rejected_reward": -margin / 2,
                         "rejected_lower": -margin / 2 - half, "rejected_upper": -margin / 2 + half})


def simulated(n: int, temperature: float, seed: int = 0) -> pd.DataFrame:
    """Pairs labelled by sigmoid(true margin) whose model margin is ``temperature`` times it (T = 1: calibrated)."""
    rng = np.random.default_rng(seed)
    true = rng.normal(0, 2, n)
    sign = np.where(rng.random(n) < 1 / (1 + np.exp(-true)), 1.0, -1.0)
    return pairs(sign * temperature * true, rng.uniform(0.1, 1.0, n))


def conformal_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "conformal interval scale is infeasible" in r.getMessage()]


# ---------------------------------------------------------------------------------------------- 1. conformal
def test_the_smallest_feasible_calibration_size():
    assert smallest_feasible_n(0.05, "high_probability", 0.1) == 45    # (0.95)^45 = 0.0994 <= 0.1 < 0.95^44
    assert smallest_feasible_n(0.1, "high_probability", 0.1) == 22     # BoRP's pointwise_alpha
    assert smallest_feasible_n(0.05, "expectation", None) == 19        # floor(0.05 * 20 - 1) = 0
    for alpha in np.linspace(0.01, 0.6, 60):   # the smallest n, by the guarantee's own rule
        for guarantee, delta in (("high_probability", 0.05), ("high_probability", 0.2), ("expectation", None)):
            n = smallest_feasible_n(alpha, guarantee, delta)
            assert allowed_losses(n, alpha, guarantee, delta) >= 0
            assert n == 1 or allowed_losses(n - 1, alpha, guarantee, delta) < 0


def test_an_infeasible_scale_says_why():
    few = conformal_scale(np.zeros(20), 0.05)
    assert not few.feasible and few.min_n == 45
    assert "n=20 calibration pairs are too few" in few.reason and "alpha=0.05, delta=0.1" in few.reason
    assert "fewer than 45" in few.reason and "high_probability" in few.reason
    assert few.to_dict()["reason"] == few.reason and "reason" not in conformal_scale(np.zeros(50), 0.05).to_dict()
    flat = conformal_scale(np.r_[np.zeros(280), np.full(20, np.inf)], 0.05)   # 20 wrong pairs without width
    assert not flat.feasible and "20 of n=300 calibration pairs are ranked wrong with zero interval width" in \
        flat.reason
    assert "too few" not in flat.reason
    rated = conformal_scale(np.zeros(10), 0.05, guarantee="expectation", risk="miscoverage")
    assert "n=10 rated responses are too few for alpha=0.05 (expectation" in rated.reason and "19" in rated.reason


def test_an_infeasible_conformal_scale_falls_back_to_the_rule_with_one_line(tmp_path, caplog):
    """20 calibration pairs, none misordered: the conformal scale would be s = 0 (every bound collapsed) without any
    guarantee. Asked for, the bounds get the rule's scale instead, one line says so, and the file records it."""
    frame = pairs(np.linspace(0.2, 3.0, 20))
    with caplog.at_level(logging.WARNING):
        fitted = fit_calibration(frame, {"interval": "conformal"}, "synthetic_cal")
    lines = conformal_lines(caplog)
    assert len(lines) == 1
    assert "n=20" in lines[0] and "alpha=0.05, delta=0.1" in lines[0] and "fewer than 45" in lines[0]
    assert "recalibrate.interval=conformal falls back to the rule's scale" in lines[0] and "recorded in" in lines[0]
    assert fitted.interval == "rule" and fitted.scale == fitted.scales["rule"] and fitted.scale > 0
    assert fitted.interval_requested == "conformal" and "fewer than 45" in fitted.interval_fallback
    assert fitted.conformal_scale is None and fitted.scales["conformal"] == 0.0   # kept in the file, never used
    save_calibration(tmp_path, fitted)
    data = json.loads((tmp_path / "calibration.json").read_text())
    assert (data["interval"], data["interval_requested"], data["conformal"]["feasible"]) == ("rule", "conformal",
                                                                                               False)
    assert data["interval_fallback"] == fitted.interval_fallback and data["scale"] == fitted.scales["rule"]
    caplog.clear()
    back = read_calibration(tmp_path)
    assert back.interval == "rule" and back.interval_fallback == fitted.interval_fallback
    assert not conformal_lines(caplog)   # said once, when it was fitted
    # nothing else uses it: downstream's conservative_conformal has no scale, the metrics report none
    assert calibration_info(back)["scale_conformal"] is None and calibration_info(back)["scale"] == back.scale
    found = recalibrated_metrics(pairs(np.linspace(-1, 2, 40)), back, METRIC)
    assert found["recal/interval"] == "rule" and found["recal/conformal/feasible"] is False
    assert "recal/conformal/scale" not in found and "recal/conformal/cf_share" not in found


def test_an_infeasible_scale_not_asked_for_is_still_said(caplog):
    with caplog.at_level(logging.WARNING):
        fitted = fit_calibration(pairs(np.linspace(0.2, 3.0, 20)), {}, "cal")
    lines = conformal_lines(caplog)
    assert len(lines) == 1 and "not used anywhere" in lines[0] and "recalibrate.interval=rule applies" in lines[0]
    assert fitted.interval == "rule" and fitted.interval_fallback is None and fitted.interval_requested == "rule"


def test_rated_responses_fall_back_to_no_scale(caplog):
    """BoRP's interval is the conformal one; infeasible (10 ratings for alpha 0.1 need 22), it is s = 1."""
    rated = pd.DataFrame({"id": [str(i) for i in range(10)], "score": np.arange(10.0), "prediction": np.arange(10.0),
                          "lower": np.arange(10.0) - 1, "upper": np.arange(10.0) + 1})
    with caplog.at_level(logging.WARNING):
        fitted = fit_calibration(rated, {}, "ratings_cal")
    lines = conformal_lines(caplog)
    assert len(lines) == 1 and "fewer than 22" in lines[0] and "falls back to no scale (none: s = 1)" in lines[0]
    assert (fitted.interval, fitted.scale, fitted.interval_requested) == ("none", 1.0, "conformal")
    found = recalibrated_pointwise_metrics(rated["score"], rated["prediction"], rated["lower"], rated["upper"],
                                           fitted)
    assert found["recal/interval"] == "none" and "recal/conformal/scale" not in found
    assert found["recal/probe/mean_width"] == found["probe/mean_width"]
    many = pd.concat([rated] * 5, ignore_index=True).assign(id=[str(i) for i in range(50)])
    assert fit_calibration(many, {}, "ratings_cal").interval == "conformal"   # 50 >= 22: feasible, applied


def test_evaluate_asking_for_an_infeasible_scale_gets_the_fallback(caplog):
    feasible = Calibration(kind="pairs", scales={"rule": 0.4, "conformal": 1.2}, interval="rule",
                           conformal={"feasible": True})
    assert feasible.with_interval("conformal").scale == 1.2
    infeasible = Calibration(kind="pairs", scales={"rule": 0.4, "conformal": 0.0}, interval="rule",
                             conformal={"feasible": False, "n": 20, "reason": "n=20 calibration pairs are too few"})
    with caplog.at_level(logging.WARNING):
        got = infeasible.with_interval("conformal")
    assert got.interval == "rule" and got.scale == 0.4 and got.interval_requested == "conformal"
    lines = conformal_lines(caplog)
    assert len(lines) == 1 and "recalibrate_interval=conformal falls back to the rule's scale, s = 0.4" in lines[0]
    assert "recorded" not in lines[0]   # evaluate.py writes no calibration.json
    with pytest.raises(UserError, match="recalibrate_interval='wide' is invalid for this run: allowed values are "
                                        "rule, conformal, none"):
        infeasible.with_interval("wide")


def _old_file(tmp_path, **change) -> None:
    """A calibration.json as written before interval_requested / interval_fallback existed."""
    data = {"format": 1, "kind": "pairs", "interval": "rule", "scale": 0.5,
            "probability": {"map": "temperature", "temperature": 0.8, "isotonic": None},
            "scales": {"rule": 0.5, "conformal": 0.0},
            "conformal": {"scale": 0.0, "feasible": False, "n": 20, "alpha": 0.05}, "fitted_on": {}, "details": {}}
    data.update(change)
    (tmp_path / "calibration.json").write_text(json.dumps(data))


def test_old_files_read_as_before_and_never_apply_an_infeasible_scale(tmp_path, caplog):
    _old_file(tmp_path)
    old = read_calibration(tmp_path)
    assert (old.interval, old.interval_requested, old.interval_fallback, old.scale) == ("rule", "rule", None, 0.5)
    _old_file(tmp_path, interval="conformal", scale=0.0)   # an old run trained with interval=conformal on 20 pairs
    with caplog.at_level(logging.WARNING):
        old = read_calibration(tmp_path)
    assert old.interval == "rule" and old.scale == 0.5 and old.interval_requested == "conformal"
    lines = conformal_lines(caplog)
    assert len(lines) == 1 and "written before infeasible scales were refused" in lines[0]
    assert "n=20" in old.interval_fallback


@pytest.mark.parametrize("change,message", [
    ({"interval_requested": "wide"}, "interval_requested 'wide' is not one of rule, conformal, none"),
    ({"interval_fallback": 7}, "interval_fallback must be null or a text"),
    ({"interval_fallback": "x" * 1001}, "interval_fallback must be null or a text of 1..1000 characters"),
    ({"interval_requested": "conformal"}, "differs from interval 'rule' without an interval_fallback"),
    ({"interval_requested": "none", "interval_fallback": "why"}, "only for an infeasible conformal scale"),
    ({"interval_requested": "conformal", "interval_fallback": "why",
      "conformal": {"feasible": True}}, "only for an infeasible conformal scale"),
])
def test_the_new_keys_are_read_with_bounds(tmp_path, change, message):
    _old_file(tmp_path, **change)
    with pytest.raises(UserError) as err:
        read_calibration(tmp_path)
    assert message in str(err.value) and "calibration.json is refused" in str(err.value)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------- 2. temperature
def test_the_prior_shrinks_log_t_towards_zero_and_many_pairs_override_it():
    frame = simulated(40_000, 2.5)
    margin = (frame.chosen_reward - frame.rejected_reward).to_numpy()
    mle = fit_temperature(margin)
    assert fit_temperature(margin, prior_sd=0.2) == pytest.approx(mle, rel=0.01)   # 40 000 pairs: data win
    few = margin[:20]
    t_mle, t_map = fit_temperature(few), fit_temperature(few, prior_sd=0.2)
    assert abs(np.log(t_map)) < abs(np.log(t_mle))   # towards T = 1
    assert fit_temperature(few, prior_sd=1e-4) == pytest.approx(1.0, abs=1e-3)
    # the MAP objective: its derivative in log T vanishes at the answer
    lt, h = np.log(t_map), 1e-5

    def objective(x):
        return -np.sum(np.log(1 / (1 + np.exp(-few * np.exp(-x))))) + x ** 2 / (2 * 0.2 ** 2)

    assert abs(objective(lt + h) - objective(lt - h)) / (2 * h) < 1e-3


def test_the_cross_fitted_check_keeps_t_where_it_helps_held_out():
    sharp = (lambda f: (f.chosen_reward - f.rejected_reward).to_numpy())(simulated(2000, 0.4))
    loss = cross_fitted_log_loss(sharp, prior_sd=0.2)
    assert loss["fitted"] < loss["raw"]   # an underconfident model: T = 0.4 helps on held-out pairs
    t, _, details = fit_probability_map(sharp, None, recalibrate_settings({"probability": "temperature"}))
    assert t == pytest.approx(0.4, rel=0.1) and details["temperature_choice"].startswith("fitted: T = ")
    # a calibrated model and a few pairs: the fitted T does not beat T = 1 held out, and the raw scale is kept
    calibrated = (lambda f: (f.chosen_reward - f.rejected_reward).to_numpy())(simulated(20, 1.0, seed=3))
    t, _, details = fit_probability_map(calibrated, None, recalibrate_settings({}))
    loss = details["cross_fitted_log_loss"]
    assert (t == 1.0) == (loss["fitted"] >= loss["raw"])
    off = recalibrate_settings({"temperature_check": False, "temperature_prior_sd": None})
    t_off, _, details = fit_probability_map(calibrated, None, off)
    assert t_off == fit_temperature(calibrated) and "temperature_check=false" in details["temperature_choice"]


def test_few_pairs_no_longer_make_the_ece_worse():
    """The measurement of scripts/calibration_size_table.py in small, 60 subsets of 20 calibration pairs. A model
    underconfident by T = 0.8: the maximum-likelihood T makes its eval ECE worse on average (the reviewer's finding,
    +0.026), the guarded T better. A model that is exactly calibrated cannot gain, and every T but 1 costs it: the
    guards cut that cost from +0.05 to a tenth of it and make far fewer draws worse (the docs say so too)."""
    from rewarduq_exp.analysis.calibration_size import margins, size_differences

    def ece_changes(temperature):
        cal, evaluated = margins(simulated(3000, temperature, seed=1)), margins(simulated(20_000, temperature, seed=2))
        found = size_differences(*cal, *evaluated, sizes=(20,), draws=60, seed=4)
        return [found[found.variant == v]["diff"].to_numpy() for v in ("before", "after")]

    before, after = ece_changes(0.8)
    assert before.mean() > 0.01 and after.mean() < 0 and (after > 0).mean() < 0.1
    before, after = ece_changes(1.0)
    assert before.mean() > 0.02 and (before > 0).mean() > 0.8
    assert after.mean() < 0.15 * before.mean() and (after > 0).mean() < 0.5


@pytest.mark.parametrize("change,message", [
    ({"temperature_prior_sd": -1}, "recalibrate.temperature_prior_sd=-1 is invalid: must be null (maximum "
                                   "likelihood) or a number in (0, 100]"),
    ({"temperature_prior_sd": "wide"}, "recalibrate.temperature_prior_sd='wide' is invalid"),
    ({"temperature_prior_sd": True}, "recalibrate.temperature_prior_sd=True is invalid"),
    ({"temperature_check": "yes"}, "recalibrate.temperature_check='yes' is invalid: must be true or false"),
    ({"isotonic_z": -1}, "recalibrate.isotonic_z=-1 is invalid: must be a number in [0, 10]"),
    ({"isotonic_z": None}, "recalibrate.isotonic_z=None is invalid"),
])
def test_bad_temperature_settings_are_one_line(change, message):
    with pytest.raises(UserError) as err:
        recalibrate_settings(change)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_temperature_choice_is_recorded(tmp_path):
    fitted = fit_calibration(simulated(300, 0.5), {}, "cal")
    save_calibration(tmp_path, fitted)
    details = json.loads((tmp_path / "calibration.json").read_text())["details"]
    assert details["temperature_prior_sd"] == 0.2 and details["temperature_choice"].startswith("fitted: T = ")
    assert set(details["cross_fitted_log_loss"]) == {"fitted", "raw"}


# ---------------------------------------------------------------------------------------------- 3. labels
@pytest.mark.parametrize("interval", ["rule", "conformal", "none"])
def test_recalibrated_rows_name_their_interval(interval):
    calibration = Calibration(kind="pairs", temperature=0.8, scales={"rule": 0.4, "conformal": 1.3},
                              interval=interval, conformal={"feasible": True, "alpha": 0.05})
    frame = simulated(500, 1.5)
    found = recalibrated_metrics(frame, calibration, METRIC)
    assert found["recal/interval"] == interval and found["recal/scale"] == calibration.scale
    other = recalibrated_metrics(frame, calibration, METRIC, interval_prefix(interval))
    assert {k.replace(f"recal@{interval}/", "recal/"): v for k, v in other.items()} == found


def test_evaluate_keeps_the_runs_own_rows_beside_another_interval(tmp_path):
    """evaluate.py recalibrate_interval=<x>: the run's own calibration and, only where x is another scale, that one."""
    from rewarduq_exp.runner.evaluate_run import run_calibration

    save_calibration(tmp_path, Calibration(kind="pairs", scales={"rule": 0.4, "conformal": 1.3}, interval="rule",
                                           conformal={"feasible": True}))
    own, other = run_calibration(tmp_path, OmegaConf.create({"recalibrate_interval": "conformal"}))
    assert own.interval == "rule" and other.interval == "conformal" and other.scale == 1.3
    assert run_calibration(tmp_path, OmegaConf.create({"recalibrate_interval": "rule"}))[1] is None
    assert run_calibration(tmp_path, OmegaConf.create({"recalibrate_interval": None}))[1] is None
    assert run_calibration(tmp_path, OmegaConf.create({"recalibrated": False})) == (None, None)


def test_the_summary_table_prints_another_intervals_row_under_the_runs_own():
    from rewarduq_exp.runner.summary import summary_table

    block = {"win_rate": 0.7, "ece": 0.06, "recal/win_rate": 0.7, "recal/ece": 0.03, "recal@conformal/win_rate": 0.7,
             "recal@conformal/ece": 0.04}
    lines = summary_table({"synthetic_eval": block}).splitlines()
    own = [x for x in lines if x.strip().startswith("recalibrated ") and "(" not in x]
    other = [x for x in lines if "recalibrated (conformal)" in x]
    assert len(own) == 1 and own[0].rstrip().endswith("0.0300") and other[0].rstrip().endswith("0.0400")


def test_the_configs_recalibrate_block_is_the_code_defaults():
    """conf/train.yaml and DEFAULTS name the same settings with the same values (a new setting lands in both)."""
    from conftest import ROOT

    from rewarduq_exp.recalibration.fit import DEFAULTS

    assert dict(OmegaConf.load(ROOT / "conf" / "train.yaml").recalibrate) == DEFAULTS


@pytest.mark.parametrize("scale, said", [(0.0, "u = 0 everywhere"), (1e9, "1e+09 times as wide"),
                                         (1e-5, "almost the reward alone")])
def test_an_extreme_interval_scale_is_read_with_one_warning(tmp_path, caplog, scale, said):
    """Fourth hardening round, "also seen": s = 0 (u = 0 everywhere) and s = 1e9 (bounds of +-7.7e9) were applied
    silently; they are within the file's bounds, so they are read, and one line says what they do."""
    save_calibration(tmp_path, Calibration(kind="pairs", scales={"rule": scale}, interval="rule"))
    with caplog.at_level("WARNING"):
        assert read_calibration(tmp_path).scale == scale
    (line,) = [r.getMessage() for r in caplog.records if "interval scale" in r.getMessage()]
    assert said in line and "fitted grid spans 0.001..1000" in line
    caplog.clear()
    save_calibration(tmp_path, Calibration(kind="pairs", scales={"rule": 2.0}, interval="rule"))
    with caplog.at_level("WARNING"):
        read_calibration(tmp_path)
    assert not caplog.records
