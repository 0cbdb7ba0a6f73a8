"""Preference metrics (win rate, confidence rates, ranking score), compute_metrics, invariances and input errors."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics import METRIC_NAMES, accuracy_metrics, compute_metrics


def make_table(pairs, weights=None, true_margin=None) -> pd.DataFrame:
    """pairs: list of ((chosen reward, lower, upper), (rejected reward, lower, upper))."""
    c = np.array([p[0] for p in pairs], dtype=float)
    r = np.array([p[1] for p in pairs], dtype=float)
    n = len(pairs)
    df = pd.DataFrame({
        "id": [f"pair{i}" for i in range(n)],
        "subset": "test",
        "weight": np.ones(n) if weights is None else np.asarray(weights, dtype=float),
        "chosen_reward": c[:, 0], "chosen_lower": c[:, 1], "chosen_upper": c[:, 2],
        "rejected_reward": r[:, 0], "rejected_lower": r[:, 1], "rejected_upper": r[:, 2],
    })
    if true_margin is not None:
        df["true_margin"] = np.asarray(true_margin, dtype=float)
    return df


def random_table(seed: int = 0, n: int = 200, *, int_weights: bool = True) -> pd.DataFrame:
    """Continuous rewards with a mix of confident/unconfident, true/false pairs, and a true margin."""
    rng = np.random.default_rng(seed)
    true_c, true_r = rng.normal(size=n), rng.normal(size=n)
    cr = 1.3 * true_c + rng.normal(scale=0.7, size=n) + 0.3
    rr = 1.3 * true_r + rng.normal(scale=0.7, size=n)
    beta = 0.8
    uc, ur = rng.gamma(2.0, 0.4, n), rng.gamma(2.0, 0.4, n)
    weights = rng.integers(0, 5, n).astype(float) if int_weights else rng.uniform(0.1, 3.0, n)
    weights[0] = 2.0  # never all zero
    df = make_table(list(zip(np.c_[cr, cr - beta * uc, cr + beta * uc], np.c_[rr, rr - beta * ur, rr + beta * ur])),
                    weights, true_margin=true_c - true_r)
    return df


# Five pairs, one of each kind, used by several hand-worked tests. Weights 1..5, total 15.
#   A: c.lower 1.5 > r.upper 0.5                  -> confidently true   (w=1)
#   B: true, c.lower 0 <= r.upper 1               -> unconfidently true (w=2)
#   C: c.upper 0.5 < r.lower 1.5                  -> confidently false  (w=3)
#   D: false, c.upper 1 >= r.lower 0              -> unconfidently false (w=4)
#   E: true, c.lower 2 == r.upper 2 (strict: not confident) -> unconfidently true (w=5)
FIVE = [
    ((2.0, 1.5, 2.5), (0.0, -0.5, 0.5)),
    ((1.0, 0.0, 2.0), (0.0, -1.0, 1.0)),
    ((0.0, -0.5, 0.5), (2.0, 1.5, 2.5)),
    ((0.0, -1.0, 1.0), (1.0, 0.0, 2.0)),
    ((3.0, 2.0, 4.0), (1.0, 0.0, 2.0)),
]
FIVE_W = [1, 2, 3, 4, 5]


def test_win_rate_counts_tie_as_false():
    pairs = [
        ((2.0, 2.0, 2.0), (1.0, 1.0, 1.0)),  # win
        ((1.0, 1.0, 1.0), (1.0, 1.0, 1.0)),  # tie -> false
        ((0.0, 0.0, 0.0), (3.0, 3.0, 3.0)),  # loss
        ((5.0, 5.0, 5.0), (-1.0, -1.0, -1.0)),  # win
    ]
    assert compute_metrics(make_table(pairs))["win_rate"] == pytest.approx(2 / 4)
    # Weights 1,2,1,0: wins carry 1 + 0 out of 4.
    assert compute_metrics(make_table(pairs, [1, 2, 1, 0]))["win_rate"] == pytest.approx(1 / 4)


def test_confidence_rates_by_hand():
    m = compute_metrics(make_table(FIVE, FIVE_W))
    assert m["ct_rate"] == pytest.approx(1 / 15)  # A
    assert m["ut_rate"] == pytest.approx(7 / 15)  # B + E = 2 + 5
    assert m["cf_rate"] == pytest.approx(3 / 15)  # C
    assert m["uf_rate"] == pytest.approx(4 / 15)  # D
    assert m["win_rate"] == pytest.approx(8 / 15)


def test_touching_bounds_are_not_confident():
    # Strict comparisons: c.lower == r.upper is not confidently true, c.upper == r.lower not confidently false.
    pairs = [
        ((3.0, 2.0, 4.0), (1.0, 0.0, 2.0)),  # true, c.lower 2 == r.upper 2 -> UT
        ((0.0, -1.0, 1.0), (2.0, 1.0, 3.0)),  # false, c.upper 1 == r.lower 1 -> UF
    ]
    m = compute_metrics(make_table(pairs))
    assert (m["ct_rate"], m["ut_rate"], m["cf_rate"], m["uf_rate"]) == (0.0, 0.5, 0.0, 0.5)


def test_ranking_score_alpha_0_2_by_hand():
    m = compute_metrics(make_table(FIVE, FIVE_W))
    # CT/(0.8T + 0.2) - CF/(0.8F + 0.2) with T = 8/15, F = 7/15 (multiply through by 15):
    # 1/(6.4 + 3) - 3/(5.6 + 3) = 1/9.4 - 3/8.6 = -0.2424543...
    assert m["rs_0.2"] == pytest.approx(1 / 9.4 - 3 / 8.6, rel=1e-12)
    assert m["rs_0.2"] == pytest.approx(-0.24245424, abs=1e-8)


def test_ranking_score_endpoints():
    m = compute_metrics(make_table(FIVE, FIVE_W))
    assert m["rs_0.0"] == pytest.approx((1 / 15) / (8 / 15) - (3 / 15) / (7 / 15))  # CT/T - CF/F = 1/8 - 3/7
    assert m["rs_1.0"] == pytest.approx(1 / 15 - 3 / 15)  # CT - CF
    rng_m = compute_metrics(random_table(3))
    t, f = rng_m["win_rate"], 1 - rng_m["win_rate"]
    assert rng_m["rs_0.0"] == pytest.approx(rng_m["ct_rate"] / t - rng_m["cf_rate"] / f, rel=1e-12)
    assert rng_m["rs_1.0"] == pytest.approx(rng_m["ct_rate"] - rng_m["cf_rate"], rel=1e-12)


def test_ranking_score_zero_over_zero_is_zero():
    # Only A (CT) and B (UT): T = 1, CT = 1/2, F = CF = 0, so the CF/F term is 0/0 := 0.
    m = compute_metrics(make_table(FIVE[:2]))
    assert m["win_rate"] == 1.0 and m["cf_rate"] == 0.0
    assert m["rs_0.0"] == pytest.approx(0.5)
    assert m["rs_0.2"] == pytest.approx(0.5 / (0.8 + 0.2))
    # Only D (UF): T = CT = 0 so the CT/T term is 0/0 := 0, and CF = 0 so RS is exactly 0, not NaN.
    m = compute_metrics(make_table(FIVE[3:4]))
    assert m["rs_0.0"] == 0.0 and not math.isnan(m["rs_0.0"])


def test_custom_alpha_key_names():
    m = compute_metrics(make_table(FIVE, FIVE_W), alphas=(0.01, 1))
    assert "rs_0.01" in m and "rs_1.0" in m and "rs_0.2" not in m
    assert m["rs_0.01"] == pytest.approx((1 / 15) / (0.99 * 8 / 15 + 0.01) - (3 / 15) / (0.99 * 7 / 15 + 0.01))


def test_accuracy_metrics_array_api_matches_table():
    c = np.array([p[0] for p in FIVE])
    r = np.array([p[1] for p in FIVE])
    arr = accuracy_metrics(c, r, np.array(FIVE_W, dtype=float))
    table = compute_metrics(make_table(FIVE, FIVE_W))
    assert list(arr) == ["win_rate", "ct_rate", "ut_rate", "cf_rate", "uf_rate", "rs_0.0", "rs_0.2", "rs_1.0"]
    for k, v in arr.items():
        assert v == pytest.approx(table[k], rel=1e-15), k
    # Without weights every pair counts once: CT = 1/5.
    assert accuracy_metrics(c, r)["ct_rate"] == pytest.approx(1 / 5)


def test_bound_width_by_hand():
    pairs = [((1.0, 0.0, 2.0), (0.0, -0.25, 0.25)), ((3.0, 2.5, 3.5), (0.0, 0.0, 0.0))]
    m = compute_metrics(make_table(pairs, [1, 3]))
    # Widths 2, 0.5 (w=1) and 1, 0 (w=3) over 2 * 4 response weights: (2 + 0.5 + 3) / 8.
    assert m["bound_width"] == pytest.approx(5.5 / 8)


def test_compute_metrics_keys_and_types():
    m = compute_metrics(random_table(0))
    assert tuple(m)[: len(METRIC_NAMES)] == METRIC_NAMES
    assert {"bound_width", "pref_bound_width", "n_pairs", "weight_sum"} <= set(m)
    assert type(m["n_pairs"]) is int and m["n_pairs"] == 200
    assert all(type(v) is float for k, v in m.items() if k != "n_pairs")
    assert all(k == k.lower() for k in m)
    assert {k for k in m if k.startswith("truth/")} == {
        "truth/bayes_win_rate", "truth/expected_bayes_win_rate", "truth/ece", "truth/prob_mae",
        "truth/margin_coverage"}
    assert not any(k.startswith("truth/") for k in compute_metrics(random_table(0).drop(columns="true_margin")))


def test_confidence_rates_partition_random():
    for seed in range(5):
        m = compute_metrics(random_table(seed, int_weights=False))
        assert m["ct_rate"] + m["ut_rate"] + m["cf_rate"] + m["uf_rate"] == pytest.approx(1.0, abs=1e-12)
        assert m["ct_rate"] + m["ut_rate"] == pytest.approx(m["win_rate"], abs=1e-12)
        assert min(m["ct_rate"], m["ut_rate"], m["cf_rate"], m["uf_rate"]) > 0  # the data exercise all four


def test_bound_inversion_within_tolerance_keeps_partition():
    # c.lower exceeds c.reward by 1e-9 (rounding): accepted, and the tie still counts as neither true nor
    # confidently true although the raw c.lower > r.upper.
    m = compute_metrics(make_table([((0.0, 1e-9, 1.0), (0.0, -1.0, 0.0))]))
    assert m["win_rate"] == 0.0 and m["ct_rate"] == 0.0
    assert m["ct_rate"] + m["ut_rate"] + m["cf_rate"] + m["uf_rate"] == 1.0


def _assert_same_metrics(a: dict, b: dict, skip=("n_pairs", "weight_sum")):
    assert set(a) == set(b)
    for k in a:
        if k not in skip:
            assert np.isclose(a[k], b[k], rtol=1e-9, atol=1e-12), (k, a[k], b[k])


def test_integer_weights_equal_repetition():
    df = random_table(1)
    w = df["weight"].to_numpy().astype(int)
    assert (w == 0).any() and (w > 1).any()
    repeated = df.loc[df.index.repeat(w)].assign(weight=1.0).reset_index(drop=True)
    a, b = compute_metrics(df), compute_metrics(repeated)
    _assert_same_metrics(a, b, skip=("n_pairs",))
    assert b["n_pairs"] == w.sum()


def test_weight_scaling_changes_nothing():
    df = random_table(2, int_weights=False)
    a = compute_metrics(df)
    b = compute_metrics(df.assign(weight=df["weight"] * 3.7))
    _assert_same_metrics(a, b)
    assert b["weight_sum"] == pytest.approx(3.7 * a["weight_sum"])


# --- errors ---------------------------------------------------------------------------------------------------


def test_n_bins_zero_raises():
    with pytest.raises(UserError, match="n_bins"):
        compute_metrics(random_table(0), n_bins=0)


def test_missing_column_raises():
    with pytest.raises(UserError, match="rejected_upper"):
        compute_metrics(random_table(0).drop(columns="rejected_upper"))


def test_nan_reward_raises():
    df = random_table(0)
    df.loc[7, "chosen_reward"] = np.nan
    with pytest.raises(UserError, match="chosen_reward.*'pair7'"):
        compute_metrics(df)
    # Without an id column the message gives the row position instead.
    with pytest.raises(UserError, match="chosen_reward.*row 7"):
        compute_metrics(df.drop(columns="id"))


def test_inf_bound_raises():
    df = random_table(0)
    df.loc[3, "rejected_lower"] = -np.inf
    with pytest.raises(UserError, match="rejected_lower"):
        compute_metrics(df)


def test_lower_above_reward_raises():
    df = make_table([((1.0, 1.5, 2.0), (0.0, -1.0, 1.0))])
    with pytest.raises(UserError, match="chosen_lower > chosen_reward"):
        compute_metrics(df)


def test_reward_above_upper_raises():
    df = make_table([((1.0, 0.0, 2.0), (0.0, -1.0, -0.5))])
    with pytest.raises(UserError, match="rejected_reward > rejected_upper"):
        compute_metrics(df)


def test_negative_weight_raises():
    df = random_table(0)
    df.loc[4, "weight"] = -1.0
    with pytest.raises(UserError, match="weight is negative"):
        compute_metrics(df)


def test_all_zero_weights_raise():
    with pytest.raises(UserError, match="all weights are zero"):
        compute_metrics(random_table(0).assign(weight=0.0))


def test_empty_table_raises():
    with pytest.raises(UserError, match="at least one pair"):
        compute_metrics(random_table(0).iloc[:0])


def test_mismatched_lengths_raise():
    c = np.array([p[0] for p in FIVE])
    r = np.array([p[1] for p in FIVE])
    with pytest.raises(UserError, match="same number of pairs"):
        accuracy_metrics(c, r[:4])
    with pytest.raises(UserError, match="one value per pair"):
        accuracy_metrics(c, r, np.ones(3))


@pytest.mark.parametrize("alphas", [(1.5,), (-0.1,), (float("nan"),)])
def test_alpha_out_of_range_raises(alphas):
    with pytest.raises(UserError, match="alpha"):
        compute_metrics(random_table(0), alphas=alphas)


def test_longer_wins_by_hand_ties_count_half():
    from rewarduq_exp.metrics.preference import longer_wins_rate

    # longer chosen -> 1, equal -> 0.5, longer rejected -> 0, equal -> 0.5
    chosen, rejected = [10, 5, 7, 3], [4, 5, 9, 3]
    assert longer_wins_rate(chosen, rejected) == pytest.approx(2 / 4)
    assert longer_wins_rate(chosen, rejected, [2, 1, 1, 1]) == pytest.approx((2 + 0.5 + 0 + 0.5) / 5)
    assert longer_wins_rate(chosen, rejected, [0, 0, 1, 0]) == 0.0
    with pytest.raises(UserError, match="one chosen length, rejected length and weight per pair"):
        longer_wins_rate([1, 2], [1])
    with pytest.raises(UserError, match="positive sum"):
        longer_wins_rate([1], [2], [0])


def test_longer_wins_of_an_eval_set_counts_the_characters_of_each_completion():
    from omegaconf import OmegaConf

    from rewarduq_exp.data.contract import make_preference_frame
    from rewarduq_exp.runner.evaluation import longer_wins_metrics

    def reply(*texts):
        return [{"role": "assistant", "content": t} for t in texts]

    data = make_preference_frame(
        ["a", "b", "c"], [[{"role": "user", "content": "hi"}]] * 3,
        [reply("longer one"), reply("abc"), reply("ab", "cd")],   # 10, 3 and 2 + 2 characters
        [reply("short"), reply("abcdef"), reply("wxyz")],         # 5, 6, 4: chosen wins, loses, ties
        weight=[1.0, 1.0, 2.0])
    predictions = make_table([((1.0, 1.0, 1.0), (0.0, 0.0, 0.0))] * 3, weights=[1.0, 1.0, 2.0])
    found = longer_wins_metrics(data, predictions, OmegaConf.create({"scoring": "auto"}))
    assert found == {"baseline/longer_wins/win_rate": pytest.approx((1 + 0 + 2 * 0.5) / 4)}
