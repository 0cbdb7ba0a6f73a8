"""Best-of-n with a run's recalibration (downstream/calibrated_scale.py, selection_check.py), without a trained model:
recalibrated scores as the API computes them, the calibrated-scale picks against recalibrated scoring by hand, their
paired intervals per run and pooled, and the selection rule on raw and on recalibrated (fake) metrics side by side.
The end-to-end runs are in test_downstream.py."""

import numpy as np
import pandas as pd
import pytest
from fake_runs import block, make_run
from omegaconf import OmegaConf

from rewarduq_exp.api import RewardModel
from rewarduq_exp.downstream.best_of_n import (
    curves_frame,
    expected_best_of_n,
    kl_best_of_n,
    picked_per_prompt,
    powers_of_two,
)
from rewarduq_exp.downstream.calibrated_scale import (
    CAL,
    COMPARED,
    CONFORMAL,
    META,
    RAW,
    calibrated_lines,
    calibrated_picks,
    calibration_columns,
    calibration_info,
    recalibrated_scores,
)
from rewarduq_exp.downstream.overoptimization import overoptimization_table, paired_statistics
from rewarduq_exp.downstream.selection_check import COLUMNS, selection_check_lines, selection_rows
from rewarduq_exp.methods.base import Scores
from rewarduq_exp.recalibration import Calibration

NS = powers_of_two(64)
KL = kl_best_of_n(NS)
BETA = 2.0


def _calibration(temperature=0.6, rule=2.5, conformal=4.0) -> Calibration:
    return Calibration(kind="pairs", temperature=temperature, scales={"rule": rule, "conformal": conformal},
                       interval="rule")


class _Fixed:
    """A method that returns given scores (bounds reward +- beta u), to score through the API's own path."""

    beta = BETA

    def __init__(self, reward, u):
        self.reward, self.u = reward, u

    def score(self, prompts, completions):
        return Scores(self.reward, self.u, BETA)


def _world(prompts=24, m=64, seed=0):
    """Rewards with a noise that u measures: the conservative pick helps, more so with a larger scale."""
    rng = np.random.default_rng(seed)
    gold = rng.normal(size=(prompts, m))
    u = rng.gamma(2.0, 0.5, size=(prompts, m))
    reward = gold + u * rng.normal(size=(prompts, m)) * 2.0
    return reward, u, gold


def test_recalibrated_scores_are_the_apis_and_the_calibrated_pick_ranks_as_recalibrated_scoring():
    reward, u, gold = _world()
    calibration = _calibration()
    flat_r, flat_u = reward.ravel(), u.ravel()
    model = RewardModel(_Fixed(flat_r, flat_u), "run", None, calibration=calibration)
    texts = [f"t{i}" for i in range(flat_r.size)]
    raw_table = model.score(texts, texts, raw=True)
    api = model.score(texts, texts)
    r_cal, u_cal = recalibrated_scores(raw_table, calibration, BETA)
    np.testing.assert_array_equal(r_cal, api.reward.to_numpy())          # exactly what RewardModel.score gives
    np.testing.assert_array_equal(u_cal, api.uncertainty.to_numpy())
    np.testing.assert_allclose(u_cal, 2.5 * flat_u / 0.6)                # u' = s u / T
    r_cal, u_cal = r_cal.reshape(reward.shape), u_cal.reshape(reward.shape)

    info = calibration_info(calibration)
    assert info == {"temperature": 0.6, "interval": "rule", "scale": 2.5, "scale_conformal": 4.0}
    picks = calibrated_picks(reward, u, gold, info, 1.0, NS)
    assert set(picks) == {(RAW, 1.0), (CAL, 1.0), (CONFORMAL, 1.0)}
    on_raw = picked_per_prompt(reward, u, gold, [1.0], NS)
    on_cal = picked_per_prompt(r_cal, u_cal, gold, [1.0], NS)
    np.testing.assert_array_equal(picks[(RAW, 1.0)][0], on_raw[("conservative", 1.0)][0])   # r - u
    np.testing.assert_allclose(picks[(CAL, 1.0)][0], on_cal[("conservative", 1.0)][0])       # r - s u = r' - u'
    np.testing.assert_allclose(picks[(CONFORMAL, 1.0)][0], expected_best_of_n(reward - 4.0 * u, gold, NS))
    np.testing.assert_allclose(on_cal[("mean", 0.0)][0], on_raw[("mean", 0.0)][0])  # T > 0: the mean pick stays
    # without a calibration (a raw study, or a run without calibration.json) there is nothing to add
    assert calibration_info(None) == {} and calibrated_picks(reward, u, gold, {}, 1.0, NS) == {}
    # BoRP's rated responses have a conformal scale only: it is the scale applied, and the pick is made once each
    pointwise = Calibration(kind="pointwise", scales={"conformal": 3.0}, interval="conformal")
    assert calibration_info(pointwise)["scale"] == 3.0
    only = calibrated_picks(reward, u, gold, calibration_info(pointwise), 1.0, NS)
    np.testing.assert_array_equal(only[(CAL, 1.0)][0], only[(CONFORMAL, 1.0)][0])


def _per_prompt(reward, u, gold, calibration, k=1.0):
    info = calibration_info(calibration)
    picked = picked_per_prompt(reward, u, gold, [k], NS) | calibrated_picks(reward, u, gold, info, k, NS)
    return {key: g for key, (g, _) in picked.items()} | {"use": {}, META: info}, picked


def test_calibrated_statistics_by_hand_per_run_and_pooled():
    runs = [_world(seed=s) for s in (1, 2)]
    per_prompt = [_per_prompt(r, u, g, _calibration(rule=2.0 + i))[0] for i, (r, u, g) in enumerate(runs)]
    one = paired_statistics(per_prompt[:1], KL, NS, 1.0, 500, 0)
    weights = np.diff(KL)
    weights = (np.r_[weights, 0] + np.r_[0, weights]) / 2 / (KL[-1] - KL[0])
    for name, rule, base in COMPARED:
        for suffix in ("", "_nmax"):
            column = f"{name}{suffix}"
            assert one[f"{column}_lo"] <= one[column] <= one[f"{column}_hi"], column
        diff = per_prompt[0][(rule, 1.0)] - per_prompt[0][(base, 0.0 if base == "mean" else 1.0)]
        assert one[name] == pytest.approx((diff @ weights).mean())
        assert one[f"{name}_nmax"] == pytest.approx(diff[:, -1].mean())
    # u measures the noise here: the larger scale helps, measurably
    assert one["conservative_cal_vs_raw_lo"] > 0 and one["conservative_conformal_gain_lo"] > 0
    # k = 1 on the recalibrated u is the calibrated pick: the task's own conservative gain, when scored recalibrated
    assert one["conservative_raw_gain"] == pytest.approx(one["conservative_gain"])
    pooled = paired_statistics(per_prompt, KL, NS, 1.0, 500, 0)
    both = np.stack([p[(CAL, 1.0)] - p[(RAW, 1.0)] for p in per_prompt]) @ weights
    assert pooled["conservative_cal_vs_raw"] == pytest.approx(both.mean())
    assert pooled["conservative_cal_vs_raw_lo"] <= pooled["conservative_cal_vs_raw"] <= pooled[
        "conservative_cal_vs_raw_hi"]
    assert calibration_columns(per_prompt[:1]) == {"recalibrated": True, "cal_temperature": 0.6,
                                                   "cal_interval": "rule", "cal_scale": 2.0,
                                                   "cal_scale_conformal": 4.0}
    assert calibration_columns(per_prompt, joined=True)["cal_scale"] == "2,3"
    # a cell with a run scored raw gets no pooled comparison (its runs did not all use the calibrated scale)
    raw_run = _per_prompt(*runs[0], None)[0]
    mixed = paired_statistics([per_prompt[1], raw_run], KL, NS, 1.0, 300, 0)
    assert not any(key.startswith(("conservative_cal", "conservative_raw", "conservative_conformal"))
                   for key in mixed)
    assert calibration_columns([per_prompt[1], raw_run]) == {"recalibrated": False}


def test_the_cells_lines_name_the_scales_and_the_paired_gains():
    rows, per_prompt = [], {}
    for seed in (0, 1):
        label = f"ens_mlp/seed={seed}"
        per_prompt[(label, "eval")] = _per_prompt(*_world(seed=seed), _calibration())[0]
        rows.append({"run": label, "method": "ens_mlp", "split": "eval", "world": 0, "seed": seed,
                     "filler_bias": 0.0, "gold_best": 1.0, "gold_nmax": 1.0, "best_n": 64})
    table = overoptimization_table(pd.DataFrame(rows), per_prompt, "filler_bias", KL, NS, 1.0, 300, 0)
    assert bool(table.recalibrated.iloc[0]) and table.cal_scale.iloc[0] == "2.5,2.5"
    (line,) = calibrated_lines(table, "filler_bias", 1.0)
    assert line.startswith("eval world=0 ens_mlp (2 runs; s = 2.5,2.5 by rule,rule, T = 0.6,0.6): r - 1 s u vs mean ")
    assert "vs r - 1 u" in line and "; conformal s = 4,4: vs mean" in line
    assert calibrated_lines(table.assign(recalibrated=False), "filler_bias", 1.0) == []


def _fake_study(tmp_path, with_recal=True):
    """Three fake runs of one world, their metrics chosen so the raw rule and the recalibrated rule pick different
    runs: a passes the raw thresholds with the best raw RS, c only after recalibration (with the best recal RS)."""
    from rewarduq_exp.downstream.best_of_n_task import summarise
    from rewarduq_exp.downstream.world_runs import WorldRun
    from rewarduq_exp.runs.run_records import find_runs

    metrics = {"a": block(rs=0.5, ece=0.02, ebce=0.005, **{"recal/ece": 0.09, "recal/ebce": 0.02,
                                                          "recal/rs_0.2": 0.6}),
               "b": block(rs=0.4, ece=0.03, ebce=0.004, **{"recal/ece": 0.01, "recal/ebce": 0.003,
                                                          "recal/rs_0.2": 0.3}),
               "c": block(rs=0.9, ece=0.20, ebce=0.050, **{"recal/ece": 0.02, "recal/ebce": 0.004,
                                                          "recal/rs_0.2": 0.5})}
    if not with_recal:
        metrics = {name: {k: v for k, v in m.items() if not k.startswith("recal/")} for name, m in metrics.items()}
    runs, per_prompt, curves = [], {}, []
    for i, (name, m) in enumerate(metrics.items()):
        folder = make_run(tmp_path, name, dataset="synthetic", seed=i, metrics={"synthetic_eval": m})
        (record,) = find_runs([folder])
        config = OmegaConf.load(folder / ".hydra" / "config.yaml")
        config.dataset.seed = 0        # one world (the fake runs' dataset seed follows the model's)
        runs.append(WorldRun(record, config, name))
        reward, u, gold = _world(seed=10 + i)
        gold = gold + 0.5 * i          # c is downstream's best, a its worst
        per_prompt[(name, "eval")], picked = _per_prompt(reward, u, gold, _calibration())
        curves.append(curves_frame(picked, NS).assign(run=name, split="eval"))
    task = OmegaConf.create({"k_compare": 1.0, "draws": 300, "seed": 0})
    return summarise(pd.concat(curves, ignore_index=True), runs, per_prompt, task, NS), per_prompt


def test_the_recalibrated_selection_rule_reads_the_recal_metrics(tmp_path):
    summary, per_prompt = _fake_study(tmp_path)
    assert summary["recal/rs_0.2"].tolist() == [0.6, 0.3, 0.5] and summary.recalibrated.all()
    table = selection_rows(summary, ["eval"], per_prompt, 300, 0)
    assert list(table.columns) == list(COLUMNS)
    assert table.rule.tolist() == ["raw", "recalibrated", "raw-filter-recalibrated-rank"]
    raw, recal, mixed = (table[table.rule == rule].iloc[0] for rule in table.rule)
    # raw: a and b pass ECE <= 0.05 and EBCE <= 0.01, a has the higher RS; recalibrated: b and c pass, c the higher;
    # raw filter, recalibrated rank: a and b pass, a has the higher recal/rs_0.2
    assert (raw.picked, raw.passing, raw["rank"], raw.best) == ("a", 2, 3, "c")
    assert (recal.picked, recal.passing, recal["rank"], recal.best) == ("c", 2, 1, "c")
    assert (mixed.picked, mixed.passing, mixed.same_as_raw) == ("a", 2, True)
    assert [(r.filter_on, r.rank_on) for r in (raw, recal, mixed)] == [
        ("raw", "raw"), ("recalibrated", "recalibrated"), ("raw", "recalibrated")]
    # per threshold, on the metrics each rule filters on
    assert (raw.passing_ece, raw.passing_ebce, recal.passing_ece, recal.passing_ebce) == (2, 2, 2, 2)
    assert not recal.same_as_raw and recal.vs_best == 0 and recal.vs_best_lo <= 0 <= recal.vs_best_hi
    at_nmax = {run: per_prompt[(run, "eval")][("mean", 0.0)][:, -1] for run in "abc"}
    assert raw.vs_mean == pytest.approx(np.mean(at_nmax["a"] - np.mean(list(at_nmax.values()), axis=0)))
    assert raw.vs_best == pytest.approx(np.mean(at_nmax["a"] - at_nmax["c"]))
    for row in (raw, recal):
        assert row.vs_mean_lo <= row.vs_mean <= row.vs_mean_hi and row.vs_best_lo <= row.vs_best <= row.vs_best_hi
    lines = selection_check_lines(table)
    assert lines[0].startswith("eval: the selection rule picks a; passing ece <= 0.05: 2 of 3, ebce <= 0.01: 2 of 3, "
                               "both: 2 (filtered on raw metrics, as the paper does); downstream it ranks 3 of 3 "
                               "(best: c)")
    assert lines[1].startswith("eval, recalibrated metrics: the selection rule picks c; passing recal/ece <= 0.05: 2 "
                               "of 3, recal/ebce <= 0.01: 2 of 3, both: 2 (filtered on recalibrated metrics); "
                               "downstream it ranks 1 of 3")
    assert lines[1].endswith("; not the raw rule's pick")
    assert lines[2].startswith("eval, raw filter, recalibrated rank: the selection rule picks a; passing ece <= 0.05: "
                               "2 of 3, ebce <= 0.01: 2 of 3, both: 2 (filtered on raw metrics, as the paper does);")
    assert lines[2].endswith("; the same run as the raw rule's") and "filter nothing" not in " ".join(lines)

    # recalibrated, a passes too: every run passes, and the line says the thresholds decided nothing
    passes_all = summary.assign(**{"recal/ece": 0.01, "recal/ebce": 0.002})
    table = selection_rows(passes_all, ["eval"], per_prompt, 300, 0)
    recal = table[table.rule == "recalibrated"].iloc[0]
    assert (recal.picked, recal.passing_ece, recal.passing_ebce, recal.passing) == ("a", 3, 3, 3)
    assert ("both: 3 (filtered on recalibrated metrics); every run passes, so the thresholds filter nothing and the "
            "pick is the ranking's alone; downstream it ranks 3 of 3") in selection_check_lines(table)[1]


def test_runs_without_recalibrated_metrics_have_no_recalibrated_pick(tmp_path):
    summary, per_prompt = _fake_study(tmp_path, with_recal=False)
    assert summary["recal/rs_0.2"].isna().all()
    table = selection_rows(summary, ["eval"], per_prompt, 300, 0)
    recal = table[table.rule == "recalibrated"].iloc[0]
    assert pd.isna(recal.picked) and not recal.same_as_raw
    lines = selection_check_lines(table)
    assert lines[1] == (
        "eval, recalibrated metrics: the runs have no recal/rs_0.2 on this split; no selection to check (trained "
        "before recalibration existed, or with recalibrate.enabled=false)")
    assert lines[2].startswith("eval, raw filter, recalibrated rank: the runs have no recal/rs_0.2 on this split")
    assert lines[0].startswith("eval: the selection rule picks a; passing ece <= 0.05: 2 of 3")
    # and a summary of old runs without the recal/ columns at all reads the same
    old = summary.drop(columns=[c for c in summary.columns if c.startswith("recal/")])
    assert selection_rows(old, ["eval"], per_prompt, 300, 0).picked.iloc[1:].isna().all()
