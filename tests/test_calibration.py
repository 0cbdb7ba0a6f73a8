"""Calibration (ECE, MCE, ELCE/EUCE/EBCE, Brier), reliability curves and truth metrics."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics import (
    calibration_curves,
    calibration_metrics,
    compute_metrics,
    pairs_from_table,
    preference_probabilities,
    truth_metrics,
)
from rewarduq_exp.metrics.calibration import binned_curve


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def prob_table(probs, lower=None, upper=None, weights=None, true_margin=None) -> pd.DataFrame:
    """Pairs whose preference probabilities are exactly ``probs`` (bounds ``lower``/``upper``): the rejected
    response has reward 0 and zero-width bounds, the chosen one has reward logit(p)."""
    lower = probs if lower is None else lower
    upper = probs if upper is None else upper
    n = len(probs)
    df = pd.DataFrame({
        "id": [f"pair{i}" for i in range(n)],
        "subset": "test",
        "weight": np.ones(n) if weights is None else np.asarray(weights, dtype=float),
        "chosen_reward": [logit(p) for p in probs],
        "chosen_lower": [logit(p) for p in lower],
        "chosen_upper": [logit(p) for p in upper],
        "rejected_reward": 0.0, "rejected_lower": 0.0, "rejected_upper": 0.0,
    })
    if true_margin is not None:
        df["true_margin"] = np.asarray(true_margin, dtype=float)
    return df


def random_table(seed: int = 0, n: int = 200) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    true_c, true_r = rng.normal(size=n), rng.normal(size=n)
    cr = 1.3 * true_c + rng.normal(scale=0.7, size=n) + 0.3
    rr = 1.3 * true_r + rng.normal(scale=0.7, size=n)
    uc, ur = rng.gamma(2.0, 0.4, n), rng.gamma(2.0, 0.4, n)
    return pd.DataFrame({
        "id": [f"pair{i}" for i in range(n)], "subset": "test", "weight": rng.uniform(0.1, 3.0, n),
        "chosen_reward": cr, "chosen_lower": cr - uc, "chosen_upper": cr + uc,
        "rejected_reward": rr, "rejected_lower": rr - ur, "rejected_upper": rr + ur,
        "true_margin": true_c - true_r,
    })


CAL_KEYS = ("ece", "mce", "elce", "euce", "ebce", "brier")


def test_ece_two_bins_by_hand_with_symmetrised_rows():
    # p = 0.8, 0.6, 0.3 with weights 1, 1, 2, all label 1; n_bins = 2 -> bins [0, .5) and [.5, 1].
    # Symmetrised rows (q, y, w): (.8,1,1) (.6,1,1) (.3,1,2) and flips (.2,0,1) (.4,0,1) (.7,0,2).
    #   bin 0: .3(y1,w2) .2(y0,w1) .4(y0,w1): W=4, conf = (.6+.2+.4)/4 = .3, acc = 2/4 = .5, gap .2
    #   bin 1: .8(y1,w1) .6(y1,w1) .7(y0,w2): W=4, conf = (.8+.6+1.4)/4 = .7, acc = 2/4 = .5, gap .2
    # ECE = .5*.2 + .5*.2 = .2 (without symmetrisation it would be .5*.7 + .5*.3 = .5).
    m = compute_metrics(prob_table([0.8, 0.6, 0.3], weights=[1, 1, 2]), n_bins=2)
    assert m["ece"] == pytest.approx(0.2, abs=1e-12)
    assert m["mce"] == pytest.approx(0.2, abs=1e-12)


def test_ece_and_mce_four_bins_by_hand():
    # p = 0.6 (w=1), 0.9 (w=3), label 1, n_bins = 4; total symmetrised weight 8.
    #   .6 -> bin 2, gap .4, share 1/8      .9 -> bin 3, gap .1, share 3/8
    #   flip .4 (label 0) -> bin 1, gap .4, share 1/8   flip .1 (label 0) -> bin 0, gap .1, share 3/8
    # ECE = (.4 + .3 + .4 + .3) / 8 = .175, MCE = .4. (Flipping labels but not probabilities would put both rows of a
    # pair in one bin with frequency .5 and give .35.)
    m = compute_metrics(prob_table([0.6, 0.9], weights=[1, 3]), n_bins=4)
    assert m["ece"] == pytest.approx(0.175, abs=1e-12)
    assert m["mce"] == pytest.approx(0.4, abs=1e-12)


def test_elce_euce_by_hand():
    # Two pairs (label 1): (p, p_lo, p_hi) = (.6, .55, .9) and (.4, .2, .45); n_bins = 2.
    # Lower-bound rows: (.55,1) (.2,1) and flips 1-p_hi: (.1,0) (.55,0).
    #   bin 0: .2(1) .1(0): conf .15 < acc .5 -> 0;  bin 1: .55(1) .55(0): conf .55 > acc .5 -> .05
    #   ELCE = .5 * .05 = .025
    # Upper-bound rows: (.9,1) (.45,1) and flips 1-p_lo: (.45,0) (.8,0).
    #   bin 0: .45(1) .45(0): acc .5 > conf .45 -> .05;  bin 1: .9(1) .8(0): conf .85 > acc .5 -> 0
    #   EUCE = .5 * .05 = .025
    df = prob_table([0.6, 0.4], lower=[0.55, 0.2], upper=[0.9, 0.45])
    m = compute_metrics(df, n_bins=2)
    assert m["elce"] == pytest.approx(0.025, abs=1e-12)
    assert m["euce"] == pytest.approx(0.025, abs=1e-12)
    assert m["ebce"] == pytest.approx(0.025, abs=1e-12)
    assert m["pref_bound_width"] == pytest.approx(((0.9 - 0.55) + (0.45 - 0.2)) / 2)


def test_brier_by_hand():
    # (p - 1)^2 weighted 1, 1, 2: (.04 + .16 + 2 * .49) / 4 = 1.18 / 4.
    m = compute_metrics(prob_table([0.8, 0.6, 0.3], weights=[1, 1, 2]))
    assert m["brier"] == pytest.approx(0.295, abs=1e-12)


def test_bins_are_left_closed_with_one_in_last_bin():
    curve = binned_curve(np.array([0.0, 0.25, 0.5, 1.0]), np.ones(4), np.ones(4), n_bins=4)
    # 0 -> bin 0, .25 -> bin 1 (left edge), .5 -> bin 2, 1.0 -> bin 3 (not a fifth bin)
    np.testing.assert_array_equal(curve.weight, [1, 1, 1, 1])
    np.testing.assert_allclose(curve.confidence, [0.0, 0.25, 0.5, 1.0])


def test_zero_weight_rows_do_not_occupy_bins():
    # n_bins = 10. Rows .65, .85 and flips .35, .15 give gaps .35, .15, .35, .15 (MCE .35). A zero-weight pair at
    # p = .55 sits alone in bin 5 with gap |1 - .55| = .45; it must count as absent, so the bin stays empty and the
    # MCE stays .35.
    base = compute_metrics(prob_table([0.65, 0.85]), n_bins=10)
    df = prob_table([0.65, 0.85, 0.55], weights=[1, 1, 0])
    with_zero = compute_metrics(df, n_bins=10)
    assert base["mce"] == pytest.approx(0.35)
    for k in CAL_KEYS:
        assert with_zero[k] == pytest.approx(base[k], abs=1e-15), k
    curve = calibration_curves(df, n_bins=10)["pred"]
    assert curve.weight[5] == 0.0 and np.isnan(curve.confidence[5])


def test_calibration_curves_match_metrics():
    df = random_table(0)
    curves = calibration_curves(df, n_bins=15)
    m = compute_metrics(df, n_bins=15)
    assert set(curves) == {"pred", "lower", "upper"}
    for curve in curves.values():
        assert curve.edges.shape == (16,)
        assert curve.confidence.shape == curve.accuracy.shape == curve.weight.shape == (15,)
        assert curve.share.sum() == pytest.approx(1.0)
        empty = curve.weight == 0
        assert np.isnan(curve.confidence[empty]).all() and np.isnan(curve.accuracy[empty]).all()
        assert not np.isnan(curve.confidence[~empty]).any()
    assert curves["pred"].ece() == m["ece"]
    assert curves["pred"].mce() == m["mce"]
    assert curves["lower"].lower_error() == m["elce"]
    assert curves["upper"].upper_error() == m["euce"]


def test_flip_with_label_zero_gives_same_calibration():
    c, r, w = pairs_from_table(random_table(1))
    p, p_lo, p_hi = preference_probabilities(c, r)
    # Swap chosen and rejected: the pair is now labelled 0 and its bounds swap roles.
    fp, fp_lo, fp_hi = preference_probabilities(r, c)
    np.testing.assert_allclose(fp_lo, 1 - p_hi, atol=1e-15)
    a = calibration_metrics(p, p_lo, p_hi, np.ones_like(p), w)
    b = calibration_metrics(fp, fp_lo, fp_hi, np.zeros_like(p), w)
    for k in CAL_KEYS:
        assert np.isclose(a[k], b[k], rtol=1e-9, atol=1e-12), (k, a[k], b[k])
    assert a["ece"] > 0.01 and a["elce"] > 0.001  # non-trivial values, so equality means something


def test_elce_equals_euce_random():
    for seed in range(5):
        m = compute_metrics(random_table(seed), n_bins=20)
        assert m["elce"] > 0 or m["euce"] > 0
        assert m["elce"] == pytest.approx(m["euce"], rel=1e-9, abs=1e-15)
        assert m["ebce"] == pytest.approx(m["elce"], rel=1e-9, abs=1e-15)


def test_calibration_metrics_input_errors():
    with pytest.raises(UserError, match="n_bins"):
        calibration_metrics([0.6], [0.5], [0.7], [1], n_bins=-3)
    with pytest.raises(UserError, match="p_lo <= p <= p_hi"):
        calibration_metrics([0.6], [0.7], [0.8], [1])
    with pytest.raises(UserError, match="same length"):
        calibration_metrics([0.6, 0.7], [0.5, 0.6], [0.7, 0.8], [1])
    with pytest.raises(UserError, match=r"p_hi must hold finite values in \[0, 1\]"):
        calibration_metrics([0.6], [0.5], [1.2], [1])


# --- truth metrics --------------------------------------------------------------------------------------------


def test_truth_perfect_model():
    df = random_table(4)
    # Rewards equal to the true rewards: the margin is the true margin exactly, bounds have positive width.
    rng = np.random.default_rng(4)
    true_c = rng.normal(size=len(df))
    true_r = true_c - df["true_margin"].to_numpy()
    df["chosen_reward"], df["rejected_reward"] = true_c, true_r
    df["chosen_lower"], df["chosen_upper"] = true_c - 0.3, true_c + 0.3
    df["rejected_lower"], df["rejected_upper"] = true_r - 0.2, true_r + 0.2
    df["true_margin"] = df["chosen_reward"] - df["rejected_reward"]
    m = truth_metrics(df)
    assert m["truth/prob_mae"] == 0.0
    assert m["truth/ece"] == pytest.approx(0.0, abs=1e-15)
    assert m["truth/margin_coverage"] == 1.0
    # A realistic model is not perfect on the same metrics.
    noisy = truth_metrics(random_table(4))
    assert noisy["truth/prob_mae"] > 0.05 and noisy["truth/ece"] > 0.01 and noisy["truth/margin_coverage"] < 1


def test_truth_bayes_win_rate_by_hand():
    tm = [1.0, logit(0.4), 0.0, 2.0]
    df = prob_table([0.6, 0.6, 0.6, 0.6], lower=[0.4] * 4, upper=[0.8] * 4, weights=[1, 1, 1, 2], true_margin=tm)
    m = compute_metrics(df)
    # true_margin > 0 strictly: pairs 0 and 3 (weights 1 + 2) of 5; the tie at 0 counts false.
    assert m["truth/bayes_win_rate"] == pytest.approx(3 / 5)
    # max(p*, 1 - p*) = sigmoid(|true_margin|).
    sig = [1 / (1 + math.exp(-abs(t))) for t in tm]
    assert m["truth/expected_bayes_win_rate"] == pytest.approx((sig[0] + sig[1] + sig[2] + 2 * sig[3]) / 5)
    # Margin interval [logit .4, logit .8] = [-0.405, 1.386], closed: covers 1.0, logit .4 (its lower end) and 0.0,
    # not 2.0 (weight 2).
    assert m["truth/margin_coverage"] == pytest.approx(3 / 5)


def test_truth_ece_and_mae_by_hand():
    # One pair, p = .8, p* = sigmoid(logit .6) = .6; n_bins = 2. Rows (.8, target .6) and flip (.2, target .4):
    # gaps .2 and .2 -> truth/ece = .2; |p - p*| = .2.
    m = truth_metrics(prob_table([0.8], true_margin=[logit(0.6)]), n_bins=2)
    assert m["truth/ece"] == pytest.approx(0.2, abs=1e-12)
    assert m["truth/prob_mae"] == pytest.approx(0.2, abs=1e-12)


def test_truth_metrics_need_finite_true_margin():
    with pytest.raises(UserError, match="true_margin"):
        truth_metrics(random_table(0).drop(columns="true_margin"))
    df = random_table(0)
    df.loc[5, "true_margin"] = np.nan
    with pytest.raises(UserError, match="true_margin.*'pair5'"):
        compute_metrics(df)
