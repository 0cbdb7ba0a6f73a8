"""Recalibration (rewarduq_exp/recalibration/): temperature, isotonic, the interval scale by EBCE, the conformal
guarantee on CF / N (200 random calibration/test splits of the synthetic world), calibration.json and its bounds."""

import json

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf
from scipy.stats import binom

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.metrics.preference import pairs_from_table
from rewarduq_exp.metrics.scoring import score_predictions
from rewarduq_exp.recalibration import (
    Calibration,
    fit_calibration,
    read_calibration,
    recalibrate_settings,
    recalibrated_metrics,
    save_calibration,
)
from rewarduq_exp.recalibration.conformal import (
    conformal_scale,
    coverage_thresholds,
    pair_thresholds,
    risk_at,
)
from rewarduq_exp.recalibration.probability import fit_isotonic, fit_temperature

METRIC = OmegaConf.create({"n_bins": 20, "alphas": [0.0, 0.2, 1.0], "scoring": "auto"})


def table(margin_c, margin_r, half_c, half_r, ids=None) -> pd.DataFrame:
    n = len(margin_c)
    return pd.DataFrame({
        "id": [str(i) for i in range(n)] if ids is None else ids, "subset": "s", "weight": 1.0,
        "chosen_reward": margin_c, "chosen_lower": margin_c - half_c, "chosen_upper": margin_c + half_c,
        "rejected_reward": margin_r, "rejected_lower": margin_r - half_r, "rejected_upper": margin_r + half_r})


def simulated(n: int, temperature: float, seed: int = 0) -> pd.DataFrame:
    """Pairs whose labels follow sigmoid(true margin) while the model's margin is ``temperature`` times it: a model
    miscalibrated by exactly that temperature."""
    rng = np.random.default_rng(seed)
    true = rng.normal(0, 2, n)
    first_wins = rng.random(n) < 1 / (1 + np.exp(-true))
    a, b = temperature * true / 2, -temperature * true / 2
    u = rng.uniform(0.1, 1.0, n)
    return table(np.where(first_wins, a, b), np.where(first_wins, b, a), u, u)


@pytest.mark.parametrize("true_t", [0.4, 2.5])
def test_a_fitted_temperature_recovers_the_true_one(true_t):
    frame = simulated(40_000, true_t)
    c, r, _ = pairs_from_table(frame)
    assert fit_temperature(c[:, 0] - r[:, 0]) == pytest.approx(true_t, rel=0.04)
    fitted = fit_calibration(frame.iloc[:8000], {"probability": "temperature"}, "sim_cal")
    assert fitted.temperature == pytest.approx(true_t, rel=0.1)
    # after it, the ECE of fresh pairs from the same model falls to sampling noise
    fresh = simulated(20_000, true_t, seed=1)
    after = recalibrated_metrics(fresh, fitted, METRIC)
    assert score_predictions(fresh, METRIC)["ece"] > 0.05
    assert after["recal/ece"] < 0.015


def test_weights_count_as_repetitions_in_the_temperature():
    frame = simulated(500, 2.0)
    c, r, _ = pairs_from_table(frame)
    m = c[:, 0] - r[:, 0]
    w = np.arange(len(m)) % 3
    assert fit_temperature(m, w) == pytest.approx(fit_temperature(np.repeat(m, w)), rel=1e-6)


@pytest.mark.parametrize("interval", ["rule", "conformal", "none"])
def test_recalibration_never_changes_a_win_rate(interval):
    frame = simulated(3000, 3.0)
    fitted = fit_calibration(frame.iloc[:1000], {"interval": interval, "probability": "isotonic"}, "cal")
    test = frame.iloc[1000:]
    raw, after = score_predictions(test, METRIC), recalibrated_metrics(test, fitted, METRIC)
    assert after["recal/win_rate"] == raw["win_rate"]
    assert after["recal/ct_rate"] + after["recal/ut_rate"] == pytest.approx(raw["win_rate"])
    # the per-response map keeps every ordering: the same pairs are ranked right
    rec = fitted.apply_predictions(test)
    assert ((rec.chosen_reward > rec.rejected_reward) == (test.chosen_reward > test.rejected_reward)).all()


def test_confident_pairs_depend_on_the_interval_scale_only():
    frame = simulated(2000, 1.5)
    base = Calibration(kind="pairs", temperature=1.0, scales={"rule": 0.7, "conformal": 2.0}, interval="rule")
    hot = Calibration(kind="pairs", temperature=7.0, scales={"rule": 0.7, "conformal": 2.0}, interval="rule")
    a, b = recalibrated_metrics(frame, base, METRIC), recalibrated_metrics(frame, hot, METRIC)
    for key in ("recal/ct_rate", "recal/cf_rate", "recal/rs_0.2"):
        assert a[key] == b[key]
    assert a["recal/ece"] != b["recal/ece"]


def test_isotonic_map_is_symmetric_and_monotone():
    rng = np.random.default_rng(3)
    p = rng.uniform(0, 1, 3000)
    y = (rng.random(3000) < p ** 2 / (p ** 2 + (1 - p) ** 2)).astype(float)
    g = fit_isotonic(p, y)
    grid = np.linspace(0, 1, 101)
    assert (np.diff(g(grid)) >= 0).all()
    np.testing.assert_allclose(g(1 - grid), 1 - g(grid), atol=0.02)


def test_the_isotonic_map_is_chosen_only_where_the_data_supports_it():
    few = fit_calibration(simulated(300, 2.0), {}, "cal")
    assert few.isotonic is None and "fewer than isotonic_min_pairs" in few.details["probability_choice"]
    # a model that is right at the extremes but overconfident in the middle: no temperature fixes that shape
    rng = np.random.default_rng(5)
    n = 6000
    true = rng.normal(0, 3, n)
    p_true = np.where(np.abs(true) > 2, 1 / (1 + np.exp(-true)), 0.5)
    first = rng.random(n) < p_true
    a, b = true / 2, -true / 2
    shaped = fit_calibration(table(np.where(first, a, b), np.where(first, b, a), np.full(n, .3), np.full(n, .3)),
                             {}, "cal")
    assert shaped.isotonic is not None
    brier = shaped.details["cross_fitted_brier"]
    assert brier["isotonic"] < brier["temperature"]


def world_pool(n: int = 20_000, seed: int = 0) -> tuple[pd.DataFrame, np.ndarray]:
    """Pairs of the synthetic world's eval distribution scored by a noisy, overconfident reward model whose
    uncertainty tracks its error; and each pair's probability that its label is the listed one (the world's truth),
    so a split's risk is computed without the labels' own noise."""
    world = SyntheticWorld(n_train=2, n_eval=n, n_ood=1, seed=seed)
    frame = world.load("eval")
    rng = np.random.default_rng(seed + 100)
    noise_sd = rng.uniform(0.2, 1.5, n)
    estimate = 1.7 * frame["true_margin"].to_numpy() + rng.normal(0, noise_sd)
    half = 0.5 * noise_sd   # u tracks the error's scale, on the wrong scale
    return table(estimate / 2, -estimate / 2, half, half), frame["true_prob"].to_numpy()


def expected_cf(frame: pd.DataFrame, p_listed: np.ndarray, scale: float) -> float:
    """CF / N of pairs at interval scale ``scale``, averaged over the labels' Bradley-Terry draw: a pair the bounds
    call certain is wrong with the probability that the other response is preferred."""
    c, r, _ = pairs_from_table(frame)
    margin = c[:, 0] - r[:, 0]
    width = (c[:, 2] - c[:, 0]) + (r[:, 0] - r[:, 1])
    confident_listed_loses = margin + scale * width < 0
    confident_listed_wins = margin - scale * width > 0
    return float(np.mean(np.where(confident_listed_loses, p_listed, 0.0)
                         + np.where(confident_listed_wins, 1 - p_listed, 0.0)))


def relabelled(frame: pd.DataFrame, p_listed: np.ndarray, rng) -> pd.DataFrame:
    """The pairs with labels drawn from the world's truth: chosen/rejected swapped where the other one wins."""
    swap = rng.random(len(frame)) >= p_listed
    out = frame.copy()
    for part in ("reward", "lower", "upper"):
        c, r = out[f"chosen_{part}"].to_numpy().copy(), out[f"rejected_{part}"].to_numpy().copy()
        out[f"chosen_{part}"], out[f"rejected_{part}"] = np.where(swap, r, c), np.where(swap, c, r)
    return out


@pytest.mark.parametrize("guarantee", ["high_probability", "expectation"])
def test_the_conformal_guarantee_holds_over_200_random_splits(guarantee):
    pool, p_listed = world_pool()
    alpha, delta, n_cal, splits = 0.05, 0.1, 500, 200
    rng = np.random.default_rng(7)
    risks, naive_risks, scales = [], [], []
    for _ in range(splits):   # 200 fits of a sort and a binomial table: well under a second
        order = rng.permutation(len(pool))
        cal, test = order[:n_cal], order[n_cal:]
        labelled = relabelled(pool.iloc[cal], p_listed[cal], rng)
        c, r, _ = pairs_from_table(labelled)
        t = pair_thresholds(c, r)
        found = conformal_scale(t, alpha, guarantee=guarantee, delta=delta)
        assert found.feasible
        scales.append(found.scale)
        risks.append(expected_cf(pool.iloc[test], p_listed[test], found.scale))
        # the plug-in rule (the smallest s whose calibration risk is <= alpha) has no guarantee
        naive = np.sort(t)[::-1][int(np.floor(alpha * n_cal))]
        naive_risks.append(expected_cf(pool.iloc[test], p_listed[test], naive))
    risks, naive_risks = np.array(risks), np.array(naive_risks)
    assert np.ptp(scales) > 0   # the splits differ
    if guarantee == "high_probability":
        # P(risk > alpha) <= delta: the count of violating splits is at most a Binomial(200, delta)'s 99.9 % quantile
        assert (risks > alpha).sum() <= binom.ppf(0.999, splits, delta)
        assert (naive_risks > alpha).mean() > 0.25   # the test has power: without the guarantee it fails often
    else:
        # E[risk] <= alpha: the mean over splits, within three standard errors
        assert risks.mean() <= alpha + 3 * risks.std(ddof=1) / np.sqrt(splits)
        assert naive_risks.mean() > alpha   # the plug-in rule's risk is above alpha on average


def test_pointwise_split_conformal_covers_at_its_rate():
    rng = np.random.default_rng(11)
    n = 40_000
    sd = rng.uniform(0.1, 1.0, n)
    y = rng.normal(0, sd)
    half = 0.4 * sd      # intervals too narrow by 2.5x
    coverage = []
    for _ in range(200):
        order = rng.permutation(n)
        cal, test = order[:300], order[300:]
        found = conformal_scale(coverage_thresholds(y[cal], 0.0, half[cal]), 0.1, guarantee="expectation",
                                risk="miscoverage")
        coverage.append(np.mean(np.abs(y[test]) <= found.scale * half[test]))
    coverage = np.array(coverage)
    assert coverage.mean() >= 0.9 - 3 * coverage.std(ddof=1) / np.sqrt(200)
    assert coverage.mean() < 0.93   # and not trivially wide


def test_conformal_scale_edge_cases():
    # every pair ranked right: s = 0 meets any alpha
    assert conformal_scale(np.zeros(50), 0.05).scale == 0.0
    # too few pairs for alpha: infeasible, said so
    found = conformal_scale(np.array([1.0, 2.0, 0.0]), 0.05)
    assert not found.feasible
    # a wrong pair without width stays wrong at any s
    assert not conformal_scale(np.full(100, np.inf), 0.2, guarantee="expectation").feasible
    assert risk_at(np.array([0.5, 2.0, 0.0]), 1.0) == pytest.approx(1 / 3)
    with pytest.raises(UserError, match="recalibrate.alpha"):
        conformal_scale(np.zeros(5), 1.5)
    with pytest.raises(UserError, match="allowed values are high_probability, expectation"):
        conformal_scale(np.zeros(5), 0.1, guarantee="sometimes")


def test_expectation_form_is_split_conformal_quantile():
    t = np.arange(1, 101, dtype=float)       # n = 100 thresholds 1..100
    # alpha = 0.1: at most floor(0.1 * 101 - 1) = 9 losses: s = the 10th largest threshold = 91
    assert conformal_scale(t, 0.1, guarantee="expectation").scale == 91.0
    assert conformal_scale(t, 0.1, guarantee="expectation").risk_on_calibration == pytest.approx(0.09)


@pytest.mark.parametrize("key,value,message", [
    ("interval", "wide", "recalibrate.interval='wide' is invalid: allowed values are rule, conformal, none"),
    ("alpha", 1.5, "recalibrate.alpha=1.5 is invalid: must be a number in (0, 1)"),
    ("probability", "platt", "allowed values are auto, temperature, isotonic"),
    ("enabled", "yes", "recalibrate.enabled='yes' is invalid: must be true or false"),
    ("bins", 3, "recalibrate.bins is not a setting; allowed: recalibrate.enabled"),
])
def test_bad_settings_are_one_line(key, value, message):
    with pytest.raises(UserError) as err:
        recalibrate_settings({key: value})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_calibration_json_round_trips_and_is_read_with_bounds(tmp_path):
    fitted = fit_calibration(simulated(1500, 2.0), {"probability": "isotonic"}, "synthetic_cal")
    save_calibration(tmp_path, fitted)
    text = (tmp_path / "calibration.json").read_text()
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert data["conformal"]["form"].startswith("P(risk > alpha) <= delta")
    back = read_calibration(tmp_path)
    assert back.temperature == fitted.temperature and back.scales == fitted.scales
    np.testing.assert_array_equal(back.isotonic.x, fitted.isotonic.x)
    frame = simulated(100, 2.0, seed=9)
    pd.testing.assert_frame_equal(back.apply_predictions(frame), fitted.apply_predictions(frame))

    def damaged(change) -> str:
        bad = json.loads(text)
        change(bad)
        (tmp_path / "calibration.json").write_text(json.dumps(bad))
        with pytest.raises(UserError) as err:
            read_calibration(tmp_path)
        assert "\n" not in str(err.value) and "calibration.json is refused" in str(err.value)
        return str(err.value)

    assert "temperature" in damaged(lambda d: d["probability"].update(temperature=-1))
    assert "temperature" in damaged(lambda d: d["probability"].update(temperature="2"))
    assert "scales.rule" in damaged(lambda d: d["scales"].update(rule=1e300))
    knots = json.loads(text)["probability"]["isotonic"]
    assert "knots" in damaged(lambda d: d["probability"]["isotonic"].update(x=knots["x"][::-1]))
    assert "knots" in damaged(lambda d: d["probability"]["isotonic"].update(y=[2.0] * len(knots["y"])))
    assert "format" in damaged(lambda d: d.update(format=99))
    assert "interval" in damaged(lambda d: d.update(interval="conformal", scales={"rule": 1.0}))
    (tmp_path / "calibration.json").write_text("[" * 200 + "]" * 200)
    with pytest.raises(UserError):
        read_calibration(tmp_path)


def test_a_run_without_calibration_json_reads_as_raw(tmp_path, caplog):
    assert read_calibration(tmp_path) is None
    assert "raw scores and metrics only" in caplog.text


def test_the_rule_scale_is_the_best_rs_among_calibrated_bounds():
    """On the calibration split the chosen s has EBCE <= the target and the highest RS_0.2 of all such s of the grid;
    zero-width bounds (s -> 0) meet the EBCE target too, but confidently call every false pair: the rule does not
    pick them."""
    from rewarduq_exp.recalibration.interval_scale import SCALE_GRID, metrics_by_scale

    frame = simulated(2000, 2.0)
    fitted = fit_calibration(frame, {"probability": "temperature"}, "cal")
    c, r, w = pairs_from_table(frame)
    by = metrics_by_scale(c, r, w, fitted.temperature)
    chosen = np.searchsorted(SCALE_GRID, fitted.scales["rule"])
    ok = by["ebce"] <= 0.01
    assert ok[chosen] and by["rs"][chosen] == by["rs"][ok].max()
    assert by["rs"][chosen] > by["rs"][0] and by["rs"][chosen] > by["rs"][-1]


def test_a_probability_on_a_bin_edge_and_its_flip_share_a_bin():
    """Isotonic maps output exact values such as 0.3; the flipped row is 1 - 0.7 = 0.30000000000000004. Both land in
    one bin, so a perfectly calibrated step map has ECE 0 (not rows split by label between two bins)."""
    from rewarduq_exp.metrics.calibration import calibration_metrics

    p = np.array([0.3] * 3 + [0.7] * 7)       # 30 % of the 0.3 pairs and 70 % of the 0.7 pairs are won
    y = np.array([1, 0, 0, 0, 0, 1, 1, 1, 1, 1], dtype=float)
    p = np.concatenate([p[:3], 1 - (1 - p[3:])])
    assert calibration_metrics(p, p, p, y, n_bins=20)["ece"] == pytest.approx(0.0, abs=1e-12)
