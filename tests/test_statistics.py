"""The intervals of the best-of-n study: the design's variance by hand, coverage of known differences, the largest drop
on hand-made curves, Gao et al.'s functional form, the effect over worlds, and the coverage suite with known truth
(rewarduq_exp/downstream/statistics.py, interval_coverage.py)."""

import numpy as np
import pytest

from rewarduq_exp.downstream.statistics import (
    MIN_PROMPTS,
    bootstrap_means,
    cell_difference_interval,
    contrast_intervals,
    gao_fit,
    gao_fit_interval,
    gao_peak,
    largest_drop,
    largest_drop_interval,
    largest_drop_over_worlds,
    mean_interval,
    over_worlds_interval,
    paired_interval,
)


def test_bootstrap_means_is_the_mean_of_a_resample():
    values = np.arange(12.0).reshape(2, 3, 2)
    # one draw's weights reproduce np.mean over the resampled runs and prompts
    rng = np.random.default_rng(0)
    w_runs = rng.multinomial(2, [0.5, 0.5], size=1).astype(float)
    w_prompts = rng.multinomial(3, [1 / 3] * 3, size=1).astype(float)
    runs = np.repeat(np.arange(2), w_runs[0].astype(int))
    prompts = np.repeat(np.arange(3), w_prompts[0].astype(int))
    expected = values[runs][:, prompts].mean((0, 1))
    got = bootstrap_means(values, draws=1, seed=0)[0]
    np.testing.assert_allclose(got, expected)


@pytest.mark.parametrize("runs", [1, 5])
def test_the_paired_interval_of_a_known_difference_covers_it_at_its_nominal_rate(runs):
    """Prompts differ a lot in level (sd 2) and runs too (sd 1); the rule's true gain is 0.3 with noise sd 0.5 per
    run and prompt. The paired interval covers 0.3 in about 95 % of 400 simulated studies (binomial sd 1.1 %)."""
    rng = np.random.default_rng(7)
    prompts, delta, sims = 40, 0.3, 400
    covered, widths = 0, []
    for s in range(sims):
        level = rng.normal(0, 2, size=(1, prompts)) + rng.normal(0, 1, size=(runs, 1))
        base = level + rng.normal(0, 0.5, size=(runs, prompts))
        # the true gain of a study is delta; each run's own gain varies around it (sd 0.2) when there are runs
        run_gain = delta + (rng.normal(0, 0.2, size=(runs, 1)) if runs > 1 else 0.0)
        rule = level + run_gain + rng.normal(0, 0.5, size=(runs, prompts))
        _, lo, hi = mean_interval(rule - base, draws=400, seed=s)
        covered += lo <= delta <= hi
        widths.append(hi - lo)
        # the unpaired spread of the level is far wider: what a "within a standard error" of the level judged
    rate = covered / sims
    assert 0.91 <= rate <= 0.985, rate
    level_se = 2 / np.sqrt(prompts)
    assert np.mean(widths) < 2 * 1.96 * level_se / 2


def test_largest_drop_on_hand_made_curves():
    assert largest_drop([0.0, 1.0, 2.0, 3.0]) == (0.0, 0, 0)            # monotone: no drop
    assert largest_drop([0.0, 1.0, 0.5, 2.0]) == (0.5, 1, 2)            # dip and recover: the dip counts
    assert largest_drop([0.0, 2.0, 1.0, 0.5]) == (1.5, 1, 3)            # peak and fall
    assert largest_drop([0.0, 2.0, 0.0, 3.0, 0.5]) == (2.5, 3, 4)       # the larger of two falls
    assert largest_drop([1.0]) == (0.0, 0, 0)
    # the fall after the highest point misses a dip that recovers above the early peak: this does not
    g = [0.0, 1.0, 0.62, 1.5]
    drop, i, j = largest_drop(g)
    assert (i, j) == (1, 2) and drop == pytest.approx(0.38)


def _curves(shape, prompts, noise, rng):
    level = rng.normal(0, 2, size=(prompts, 1))  # prompts differ a lot in level, shared by every n
    return np.asarray(shape)[None, :] + level + rng.normal(0, noise, (prompts, len(shape)))


def test_largest_drop_interval_separates_a_fall_from_a_rise():
    rng = np.random.default_rng(3)
    rising = largest_drop_interval(_curves([0, 1, 2, 3, 3.5], 32, 0.3, rng), draws=1000)
    assert rising["lo"] == 0.0 and rising["drop"] == 0.0
    dip = largest_drop_interval(_curves([0, 1, 0.4, 1.5, 2.0], 32, 0.3, rng), draws=1000)
    assert dip["lo"] > 0 and (dip["from_index"], dip["to_index"]) == (1, 2)
    assert dip["lo"] <= dip["drop"] <= dip["hi"]
    flat = largest_drop_interval(_curves([1, 1, 1, 1, 1], 32, 0.3, rng), draws=1000)
    assert flat["lo"] == 0.0 < flat["drop"]  # noise alone makes some pair fall; the interval does not call it a fall


def test_largest_drop_interval_covers_the_true_drop():
    """A dip of 0.6 with noise: the simultaneous band's interval covers the true largest drop at least at about its
    nominal rate (it is conservative by construction) over 200 studies."""
    rng = np.random.default_rng(11)
    shape = np.array([0, 1.0, 0.4, 0.8, 1.2])
    covered = sum(lo <= 0.6 <= hi for lo, hi in (
        (r["lo"], r["hi"]) for r in (largest_drop_interval(_curves(shape, 24, 0.5, rng), draws=400, seed=s)
                                     for s in range(200))))
    assert covered / 200 >= 0.92


def test_gao_fit_recovers_the_form_and_its_peak():
    d = np.sqrt(np.log([1, 2, 4, 8, 16, 32, 64]) - (np.array([1, 2, 4, 8, 16, 32, 64]) - 1) / [1, 2, 4, 8, 16, 32, 64])
    gain = d * (2.0 - 0.8 * d)
    alpha, beta = gao_fit(d, gain)
    assert alpha == pytest.approx(2.0) and beta == pytest.approx(0.8)
    d_peak, peak = gao_peak(alpha, beta)
    assert d_peak == pytest.approx(2.0 / 1.6) and peak == pytest.approx(4.0 / 3.2)
    assert gao_peak(1.0, -0.1)[0] == np.inf  # never turns down
    rng = np.random.default_rng(0)
    values = 0.5 + gain[None, :] + rng.normal(0, 1, size=(64, 1)) + rng.normal(0, 0.05, size=(64, d.size))
    fit = gao_fit_interval(d, values, draws=500)
    assert fit["alpha_lo"] <= 2.0 <= fit["alpha_hi"] and fit["beta_lo"] <= 0.8 <= fit["beta_hi"]
    assert fit["r2"] > 0.95


def test_the_difference_of_two_cells_covers_it_at_its_nominal_rate():
    """Two cells of one world: 5 runs each (run effects sd 0.3), the same 30 prompts (prompt effects sd 2, shared).
    The true difference of the cells' expected levels is 0.5; the interval resamples the shared prompts once and
    each cell's runs apart, and covers 0.5 in about 95 % of 300 studies."""
    rng = np.random.default_rng(5)
    covered = 0
    for s in range(300):
        prompts = rng.normal(0, 2, size=(1, 30))
        a = 0.5 + prompts + rng.normal(0, 0.3, size=(5, 1)) + rng.normal(0, 0.4, size=(5, 30))
        b = prompts + rng.normal(0, 0.3, size=(5, 1)) + rng.normal(0, 0.4, size=(5, 30))
        estimate, lo, hi, _ = cell_difference_interval(a, b, draws=400, seed=s)
        assert lo <= estimate <= hi
        covered += lo <= 0.5 <= hi
    assert 0.9 <= covered / 300 <= 0.985, covered / 300


def test_the_design_variance_is_the_crossed_anova_estimate_by_hand():
    """With Student's t as the binding critical value (normal data, many draws), the interval's half-width over t is
    the standard error (MS_runs + MS_prompts - MS_E) / (R P) of the balanced crossed design, worked out here with
    plain sums; for one run it is sd / sqrt(P)."""
    from scipy.stats import t as t_dist

    from rewarduq_exp.downstream.statistics import _contrast_moments

    rng = np.random.default_rng(4)
    y = rng.normal(0, 0.5, (4, 1)) + rng.normal(0, 0.4, (1, 9)) + rng.normal(0, 0.3, (4, 9))
    r, p = y.shape
    grand, rows, cols = y.mean(), y.mean(1), y.mean(0)
    ms_runs = p * ((rows - grand) ** 2).sum() / (r - 1)
    ms_prompts = r * ((cols - grand) ** 2).sum() / (p - 1)
    ms_noise = ((y - rows[:, None] - cols[None] + grand) ** 2).sum() / ((r - 1) * (p - 1))
    expected = (ms_runs + ms_prompts - ms_noise) / (r * p)
    found = _contrast_moments([y[:, :, None]], [1.0], [np.ones((1, r))], np.ones((1, p)))
    assert found.mean[0, 0] == pytest.approx(grand) and found.var[0, 0] == pytest.approx(expected)
    # a resample's weights equal repeating its rows and columns
    w_r, w_p = np.array([[2.0, 0, 1, 1]]), np.array([[0, 1, 1, 3, 0, 2, 1, 0, 1.0]])
    repeated = np.repeat(np.repeat(y, w_r[0].astype(int), 0), w_p[0].astype(int), 1)
    again = _contrast_moments([repeated[:, :, None]], [1.0], [np.ones((1, r))], np.ones((1, p)))
    weighted = _contrast_moments([y[:, :, None]], [1.0], [w_r], w_p)
    assert weighted.var[0, 0] == pytest.approx(again.var[0, 0])
    assert weighted.mean[0, 0] == pytest.approx(again.mean[0, 0])
    one = rng.normal(size=40)
    iv = paired_interval(one, draws=4000)
    half = t_dist.ppf(0.975, 39) * one.std(ddof=1) / np.sqrt(40)
    assert iv.estimate == pytest.approx(one.mean())
    assert iv.hi - iv.lo >= 2 * half - 1e-12   # never narrower than Student's t
    assert iv.hi - iv.lo < 2 * half * 1.15      # and, on normal data, about as wide


def test_the_contrast_of_two_cells_is_their_difference_and_flipping_it_flips_the_interval():
    rng = np.random.default_rng(8)
    a, b = rng.normal(1, 1, (3, 20)), rng.normal(0, 1, (5, 20))
    ab, ba = cell_difference_interval(a, b, seed=2), cell_difference_interval(b, a, seed=2)
    assert ab.estimate == pytest.approx(a.mean() - b.mean())
    assert ab.estimate == pytest.approx(-ba.estimate)
    # the cells' runs are resampled apart (they are different runs), the prompts together: a contrast of a cell
    # with a shifted copy of itself still varies with the runs, but not with the prompts it shares
    shifted = contrast_intervals([a[:, :, None], a[:, :, None] + 0.3], [1.0, -1.0], seed=2)[0]
    runs_only = cell_difference_interval(a.mean(1, keepdims=True) * np.ones((1, 20)),
                                         a.mean(1, keepdims=True) * np.ones((1, 20)) + 0.3, seed=2)
    assert shifted.estimate == pytest.approx(-0.3) and shifted.lo < -0.3 < shifted.hi
    assert shifted.hi - shifted.lo == pytest.approx(runs_only.hi - runs_only.lo, rel=0.35)


def test_exact_and_unbounded_cases_say_what_they_are():
    assert paired_interval(np.zeros(32))[:3] == (0.0, 0.0, 0.0)            # a rule that changes nothing
    assert paired_interval(np.full((3, 32), 2.0))[:3] == (2.0, 2.0, 2.0)
    assert mean_interval(np.zeros(32)) == (0.0, 0.0, 0.0)
    # one prompt of 32 differs: resamples without it are a third of all, so no finite upper end can be promised
    one = np.zeros(32)
    one[5] = 1.0
    iv = paired_interval(one)
    assert iv.hi == np.inf and "unbounded" in iv.note and iv.lo < one.mean()
    few = paired_interval(np.random.default_rng(0).normal(size=MIN_PROMPTS - 1))
    assert f"fewer than {MIN_PROMPTS}" in few.note and np.isfinite(few.hi)
    two = paired_interval(np.random.default_rng(0).normal(size=(2, 32)))
    assert "2 runs" in two.note
    # one prompt (3 prompts cut into 2 to choose k on and 1 to report on): the estimate, no interval, said so
    single = paired_interval(np.array([[0.3], [0.5]]))
    assert single.estimate == pytest.approx(0.4) and np.isnan(single.lo) and "1 prompt" in single.note
    drop = largest_drop_interval(np.array([[0.0, 1.0, 0.5]]))
    assert drop["drop"] == pytest.approx(0.5) and np.isnan(drop["lo"]) and drop["note"] == "1 prompt: no interval"


def test_over_worlds_is_the_t_interval_of_the_worlds_estimates():
    from scipy.stats import t as t_dist

    x = np.array([0.2, -0.1, 0.5, 0.3, 0.0])
    iv = over_worlds_interval(x)
    half = t_dist.ppf(0.975, 4) * x.std(ddof=1) / np.sqrt(5)
    assert (iv.estimate, iv.lo, iv.hi, iv.note) == pytest.approx((x.mean(), x.mean() - half, x.mean() + half, ""))
    assert "fewer than" in over_worlds_interval(x[:2]).note
    assert np.isnan(over_worlds_interval([0.3]).lo) and over_worlds_interval([np.nan, 0.3]).estimate == 0.3
    # the mean curve over worlds falls from the 2nd point to the 3rd in every world: a drop the band shows
    curves = np.array([[0, 1.0, 0.2, 0.5], [0, 1.1, 0.3, 0.4], [0, 0.9, 0.1, 0.6], [0, 1.0, 0.25, 0.5]])
    found = largest_drop_over_worlds(curves)
    assert (found["from_index"], found["to_index"]) == (1, 2) and found["lo"] > 0 and found["worlds"] == 4
    assert largest_drop_over_worlds(np.cumsum(np.ones((4, 5)), 1))["hi"] == 0.0   # rises everywhere
