"""Probe metrics (BoRP sections 4 and 5.2) on hand-worked cases."""

import numpy as np
import pytest

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics.probe import (
    interval_alpha_two_raters,
    krippendorff_alpha,
    pearson,
    plot_probe_diagnostics,
    probe_metrics,
    rmse,
    rmse_by_uncertainty,
    spearman,
)

Y = np.array([1, 2, 3, 4, 5], dtype=float)
P = np.array([2, 1, 4, 3, 5], dtype=float)


def test_correlations_and_rmse_by_hand():
    # deviations (-2,-1,0,1,2) and (-1,-2,1,0,2): sum of products 8, sums of squares 10 and 10
    assert pearson(Y, P) == pytest.approx(0.8)
    assert spearman(Y, P) == pytest.approx(0.8)  # already ranks
    assert spearman(Y, P**3) == pytest.approx(0.8)  # monotone transform: same ranks
    assert rmse(Y, P) == pytest.approx(np.sqrt(4 / 5))
    assert np.isnan(pearson(Y, np.ones(5)))  # a constant prediction has no correlation


def test_krippendorff_alpha():
    assert krippendorff_alpha(Y, Y, "interval") == pytest.approx(1.0)
    assert krippendorff_alpha(Y, Y, "ordinal") == pytest.approx(1.0)
    # ordinal rounds the predictions to the 1..5 grid first
    assert krippendorff_alpha(Y, [1.2, 1.8, 3.4, 3.6, 5.3], "ordinal") == pytest.approx(1.0)
    # interval by hand: values 1,2,3,1,2,4 -> sum of squared deviations 35 - 6 (13/6)^2 = 41/6,
    # D_e = 2 (41/6) / 5 = 41/15, D_o = (0 + 0 + 1) / 3, alpha = 1 - (1/3) / (41/15) = 1 - 5/41
    assert krippendorff_alpha([1, 2, 3], [1, 2, 4]) == pytest.approx(1 - 5 / 41)
    rng = np.random.default_rng(0)
    y, noise = rng.integers(1, 6, 2000).astype(float), rng.uniform(1, 5, 2000)
    assert abs(krippendorff_alpha(y, noise, "interval")) < 0.05
    assert abs(krippendorff_alpha(y, noise, "ordinal")) < 0.05
    # systematic inflation (the paper's Qwen3-Max failure): perfect Pearson, poor alpha
    assert pearson(Y, Y + 2) == pytest.approx(1.0) and krippendorff_alpha(Y, Y + 2) < 0.5
    with pytest.raises(UserError, match="allowed: interval, ordinal"):
        krippendorff_alpha(Y, P, "ratio")


def brute_force_alpha(data, level: str, domain=None) -> float:
    """Krippendorff's alpha from its definition (Krippendorff 2011), one pair of values at a time: rows are coders,
    columns units, NaN a missing value. Coincidences o_ck = sum over units with m_u >= 2 values of (ordered c-k
    pairs of values from different coders) / (m_u - 1); alpha = 1 - (n - 1) sum o_ck d_ck / sum n_c n_k d_ck, with
    d_ck = (c - k)^2 (interval) or (sum_{g between c and k} n_g - (n_c + n_k) / 2)^2 (ordinal, g over the value
    domain ordered)."""
    data = np.asarray(data, dtype=float)
    values = sorted(set(np.unique(data[~np.isnan(data)])) | set(domain if domain is not None else []))
    index = {v: i for i, v in enumerate(values)}
    o = np.zeros((len(values), len(values)))
    for unit in data.T:
        present = [v for v in unit if not np.isnan(v)]
        m = len(present)
        if m < 2:
            continue
        for i in range(m):
            for j in range(m):
                if i != j:
                    o[index[present[i]], index[present[j]]] += 1.0 / (m - 1)
    n_c = o.sum(1)
    n = n_c.sum()
    d = np.zeros_like(o)
    for c in range(len(values)):
        for k in range(len(values)):
            if level == "interval":
                d[c, k] = (values[c] - values[k]) ** 2
            else:
                lo, hi = min(c, k), max(c, k)
                d[c, k] = (n_c[lo:hi + 1].sum() - (n_c[c] + n_c[k]) / 2) ** 2
    return 1.0 - (n - 1) * (o * d).sum() / (np.outer(n_c, n_c) * d).sum()


def test_krippendorff_alpha_by_hand_for_both_levels():
    # Units 1..4 rated (1,1), (2,3), (3,3), (3,2): coincidences o_11 = 2, o_23 = o_32 = 2, o_33 = 2, so n_1 = 2,
    # n_2 = 2, n_3 = 4, n = 8.
    # interval: d_12 = 1, d_13 = 4, d_23 = 1; observed sum o d = 4, expected sum n_c n_k d = 2 (4 + 32 + 8) = 88;
    #   alpha = 1 - 7 * 4 / 88 = 15 / 22.
    # ordinal: d_12 = (2 + 2 - 2)^2 = 4, d_13 = (8 - 3)^2 = 25, d_23 = (6 - 3)^2 = 9; observed 2 * 9 + 2 * 9 = 36,
    #   expected 2 (16 + 200 + 72) = 576; alpha = 1 - 7 * 36 / 576 = 0.5625.
    human, probe = [1, 2, 3, 3], [1, 3, 3, 2]
    assert krippendorff_alpha(human, probe, "interval") == pytest.approx(15 / 22)
    assert interval_alpha_two_raters(np.array(human, float), np.array(probe, float)) == pytest.approx(15 / 22)
    assert krippendorff_alpha(human, probe, "ordinal") == pytest.approx(0.5625)
    assert brute_force_alpha([human, probe], "interval") == pytest.approx(15 / 22)
    assert brute_force_alpha([human, probe], "ordinal", domain=range(1, 6)) == pytest.approx(0.5625)
    # the ordinal level reads ranks, not distances: spreading the top value changes interval, not ordinal
    assert krippendorff_alpha([1, 2, 5, 5], [1, 5, 5, 2], "ordinal") == pytest.approx(
        brute_force_alpha([[1, 2, 5, 5], [1, 5, 5, 2]], "ordinal", domain=range(1, 6)))


@pytest.mark.parametrize("level", ["interval", "ordinal"])
def test_krippendorff_alpha_equals_the_brute_force_definition(level):
    rng = np.random.default_rng(1)
    y = rng.integers(1, 6, 120).astype(float)
    p = y + rng.normal(0, 0.8, 120)
    # the probe's metric: humans and the probe as two coders of the same 120 units (ordinal: rounded to 1..5)
    reference = p if level == "interval" else np.clip(np.rint(p), 1, 5)
    expected = brute_force_alpha([y, reference], level, domain=range(1, 6))
    assert krippendorff_alpha(y, p, level) == pytest.approx(expected, abs=1e-10)
    # swapping the coders changes nothing; the units' order changes nothing
    order = rng.permutation(120)
    assert krippendorff_alpha(p[order], y[order], level) == pytest.approx(expected, abs=1e-10)


def test_closed_form_and_package_agree_with_the_definition_where_each_is_used(monkeypatch):
    import krippendorff

    from rewarduq_exp.metrics import probe as module

    rng = np.random.default_rng(2)
    y = rng.integers(1, 6, 60).astype(float)
    p = np.round(y + rng.normal(0, 1.0, 60), 1)
    expected = brute_force_alpha([y, p], "interval")
    assert interval_alpha_two_raters(y, p) == pytest.approx(expected, abs=1e-10)
    monkeypatch.setattr(module, "_KRIPPENDORFF_MAX_CELLS", 0)  # the closed-form path of large inputs
    assert krippendorff_alpha(y, p) == pytest.approx(expected, abs=1e-10)
    # with missing values (more than two coders) the package still matches the definition
    data = rng.integers(1, 6, (3, 40)).astype(float)
    data[rng.random((3, 40)) < 0.2] = np.nan
    assert krippendorff.alpha(reliability_data=data, level_of_measurement="interval") == pytest.approx(
        brute_force_alpha(data, "interval"), abs=1e-10)


def test_rmse_by_uncertainty_bins():
    y = np.array([1, 2, 3, 4, 1, 2, 3, 4], dtype=float)
    pred = y + np.array([0, 0, 0, 0, 2, -2, 2, -2])
    u = np.array([0.1, 0.2, 0.3, 0.4, 1, 2, 3, 4])
    table = rmse_by_uncertainty(y, pred, u, n_bins=2)
    assert table["count"].tolist() == [4, 4]
    assert table["rmse"].tolist() == pytest.approx([0.0, 2.0])
    assert table["u_low"].tolist() == pytest.approx([0.1, 0.7]) and table["u_high"].tolist()[-1] == 4
    assert table["u_mean"].tolist() == pytest.approx([0.25, 2.5])
    # tied u merge bins instead of splitting equal values
    tied = rmse_by_uncertainty(y, pred, np.r_[np.zeros(6), 1, 1], n_bins=4)
    assert tied["count"].sum() == 8 and len(tied) < 4
    m = probe_metrics(y, pred, u, n_bins=2)
    assert m["probe/rmse_low_u"] == 0 and m["probe/rmse_high_u"] == pytest.approx(2.0)
    assert m["probe/u_abs_error_spearman"] > 0.8
    assert all(k.startswith("probe/") for k in m)
    assert "probe/u_mean" not in probe_metrics(y, pred)


def test_bad_input():
    with pytest.raises(UserError, match="as many predictions as scores"):
        rmse(Y, P[:3])
    with pytest.raises(UserError, match="finite"):
        pearson(Y, [1, 2, np.nan, 4, 5])
    with pytest.raises(UserError, match="one finite value per sample"):
        rmse_by_uncertainty(Y, P, [1, 2])


def test_figure_is_a_png(tmp_path):
    rng = np.random.default_rng(2)
    y = rng.integers(1, 6, 200).astype(float)
    u = rng.uniform(0, 1, 200)
    pred = y + rng.normal(0, 1, 200) * u
    path = plot_probe_diagnostics(y, pred, u, tmp_path / "figures" / "probe_uncertainty.png", title="tiny")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in path.parent.iterdir()] == ["probe_uncertainty.png"]


@pytest.mark.parametrize("continuous", [False, True], ids=["rating-levels", "rater-means"])
def test_figure_mean_line_has_one_point_per_level_or_per_quantile_bin(tmp_path, monkeypatch, continuous):
    """Ratings on 1..5 get one mean point per level; scores that are means over raters (hundreds of distinct values)
    are binned into quantile bins, whose points are the bins' mean score and mean prediction."""
    from rewarduq_exp.metrics import probe

    rng = np.random.default_rng(3)
    y = rng.uniform(1, 5, 300) if continuous else rng.integers(1, 6, 300).astype(float)
    pred = y + rng.normal(0, 0.3, 300)
    figures = []
    monkeypatch.setattr(probe, "save_figure", lambda fig, path: figures.append(fig))
    plot_probe_diagnostics(y, pred, rng.uniform(0, 1, 300), tmp_path / "probe.png")
    (line,) = [ln for ln in figures[0].axes[0].get_lines() if ln.get_label() == "mean prediction"]
    x, means = line.get_data()
    if continuous:
        order = np.argsort(y, kind="stable")
        first = order[:30]  # 300 scores in 10 bins of 30
        assert len(x) == probe.MAX_SCORE_LEVELS
        assert x[0] == pytest.approx(y[first].mean()) and means[0] == pytest.approx(pred[first].mean())
        assert np.all(np.diff(x) > 0)
    else:
        np.testing.assert_array_equal(x, [1, 2, 3, 4, 5])
        assert means[2] == pytest.approx(pred[y == 3].mean())


def test_partial_correlation_by_hand_and_against_lstsq():
    from rewarduq_exp.metrics.probe import length_covariates, length_metrics, partial_pearson

    # x = 1..4; e and f are orthogonal to 1, to x and to each other, so the residuals on [1, x] are e and e + f:
    # corr = e.(e + f) / (|e| |e + f|) = 4 / (2 * sqrt(24)) = 1 / sqrt(6)
    x = np.array([1.0, 2.0, 3.0, 4.0])
    e, f = np.array([1.0, -1.0, -1.0, 1.0]), np.array([-1.0, 3.0, -3.0, 1.0])
    assert partial_pearson(x + e, 2 * x + e + f, x[:, None]) == pytest.approx(1 / np.sqrt(6))
    assert np.isnan(partial_pearson(3 * x, 2 * x + e, x[:, None]))  # length explains the first entirely

    rng = np.random.default_rng(0)
    lengths = np.c_[rng.integers(5, 400, 60), rng.integers(1, 80, 60), rng.integers(2, 120, 60)].astype(float)
    y = 1 + np.log1p(lengths[:, 0]) / 2 + rng.normal(0, 0.5, 60)
    pred = y + rng.normal(0, 0.5, 60)
    design = np.c_[np.ones(60), lengths, np.log1p(lengths)]
    assert np.allclose(length_covariates(lengths), design[:, 1:])

    def residual(v):
        return v - design @ np.linalg.lstsq(design, v, rcond=None)[0]

    found = length_metrics(y, pred, lengths)
    assert found["probe/partial_pearson_given_length"] == pytest.approx(
        np.corrcoef(residual(pred), residual(y))[0, 1], abs=1e-10)
    assert found["probe/pearson_with_log_length"] == pytest.approx(
        np.corrcoef(pred, np.log1p(lengths[:, 0]))[0, 1], abs=1e-10)
    with pytest.raises(UserError, match=r"\(n, 3\) array of counts"):
        length_covariates(lengths[:, :2])


def test_figure_compares_the_probe_with_the_baselines(tmp_path, monkeypatch):
    from rewarduq_exp.metrics import probe

    metrics = {"probe/alpha_interval": 0.7, "probe/pearson": 0.8, "probe/rmse": 0.5,
               "probe/baseline/length_ridge/alpha_interval": 0.6, "probe/baseline/length_ridge/pearson": 0.65,
               "probe/baseline/length_ridge/rmse": 0.6, "probe/baseline/score_judge/rmse": 1.5,
               "probe/baseline/score_judge/constant": True}  # a constant judge: no alpha, no Pearson
    compare = probe.comparison(metrics)
    assert list(compare) == ["probe", "length_ridge", "score_judge"]
    assert compare["length_ridge"]["pearson"] == 0.65 and np.isnan(compare["score_judge"]["alpha_interval"])
    figures = []
    monkeypatch.setattr(probe, "save_figure", lambda fig, path: figures.append(fig))
    rng = np.random.default_rng(1)
    y = rng.integers(1, 6, 50).astype(float)
    plot_probe_diagnostics(y, y + rng.normal(0, 0.5, 50), rng.uniform(0, 1, 50), tmp_path / "p.png",
                           compare=compare)
    agreement, error = figures[0].axes[2:]
    # three models x (alpha, Pearson), and the probe's partial correlation given length (n/a: not in these metrics)
    assert len(agreement.patches) == 3 * 2 + 1
    assert [t.get_text() for t in agreement.texts].count("n/a") == 2 + 1  # the constant judge's alpha and Pearson
    # the RMSEs on an axis of their own, whose scale the judge's 1.5 sets without squeezing the correlations
    assert [round(p.get_height(), 2) for p in error.patches] == [0.5, 0.6, 1.5]
    assert agreement.get_ylim()[1] < 1.5
