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


def test_closed_form_interval_alpha_equals_the_package():
    import krippendorff

    rng = np.random.default_rng(1)
    y = rng.integers(1, 6, 120).astype(float)
    p = y + rng.normal(0, 0.8, 120)
    ref = krippendorff.alpha(reliability_data=np.vstack([y, p]), level_of_measurement="interval")
    assert interval_alpha_two_raters(y, p) == pytest.approx(ref, abs=1e-10)
    assert krippendorff_alpha(y, p) == pytest.approx(ref, abs=1e-10)


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
