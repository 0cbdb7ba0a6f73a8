"""Calibration bins computed directly (``bin_index``: floor of q times n_bins) are those of the former
``np.digitize(np.round(q, 12), edges[1:-1])``, row for row, and every calibration metric is today's to the bit: the
reference below is the former binning and curve, written here."""

import numpy as np
import pytest

from rewarduq_exp.metrics.calibration import bin_index, binned_curve, calibration_metrics, symmetrise
from rewarduq_exp.metrics.preference import check_n_bins

N_BINS = [1, 2, 3, 7, 10, 15, 20, 33, 100]


def digitize_bins(q, n_bins):
    return np.digitize(np.round(q, 12), np.linspace(0.0, 1.0, n_bins + 1)[1:-1])


def reference_curve(q, y, w, n_bins):
    """The former binned_curve: (edges, confidence, accuracy, weight)."""
    n_bins = check_n_bins(n_bins)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    b = digitize_bins(q, n_bins)
    sw = np.bincount(b, weights=w, minlength=n_bins)
    swq = np.bincount(b, weights=w * q, minlength=n_bins)
    swy = np.bincount(b, weights=w * y, minlength=n_bins)
    occ = sw > 0
    conf, acc = np.full(n_bins, np.nan), np.full(n_bins, np.nan)
    conf[occ], acc[occ] = swq[occ] / sw[occ], swy[occ] / sw[occ]
    return edges, conf, acc, sw


def reference_metrics(p, p_lo, p_hi, y, w, n_bins):
    q, q_lo, q_hi, ys, ws = symmetrise(p, p_lo, p_hi, y, w)
    curves = {}
    for key, x in (("pred", q), ("lower", q_lo), ("upper", q_hi)):
        edges, conf, acc, sw = reference_curve(x, ys, ws, n_bins)
        occ, share = sw > 0, sw / sw.sum()
        curves[key] = (occ, share, conf, acc)
    occ, share, conf, acc = curves["pred"]
    elce = float(np.dot(curves["lower"][1][curves["lower"][0]],
                        np.maximum(curves["lower"][2] - curves["lower"][3], 0.0)[curves["lower"][0]]))
    euce = float(np.dot(curves["upper"][1][curves["upper"][0]],
                        np.maximum(curves["upper"][3] - curves["upper"][2], 0.0)[curves["upper"][0]]))
    return {"ece": float(np.dot(share[occ], np.abs(acc - conf)[occ])),
            "mce": float(np.max(np.abs(acc - conf)[occ])), "elce": elce, "euce": euce, "ebce": 0.5 * (elce + euce),
            "brier": float(np.dot(w, (p - y) ** 2) / w.sum()),
            "pref_bound_width": float(np.dot(w, p_hi - p_lo) / w.sum())}


def hard_probabilities(n_bins, n=4000, seed=0):
    """Random probabilities with every edge of ``n_bins`` (and of 10 and 20 bins), their flips, their neighbours one
    ulp away, values within 1e-13 of an edge (rounded onto it), 0 and 1."""
    rng = np.random.default_rng(seed)
    edges = np.concatenate([np.linspace(0.0, 1.0, k + 1) for k in {n_bins, 10, 20}] + [np.arange(101) / 100])
    special = np.concatenate([edges, 1.0 - edges, np.nextafter(edges, 0.0), np.nextafter(edges, 1.0),
                              np.clip(edges + 3e-14, 0, 1), np.clip(edges - 3e-14, 0, 1), [0.0, 1.0, 0.5, -0.0],
                              np.arange(1, 20) * 0.05, 1.0 - np.arange(1, 20) * 0.05])
    special = np.clip(special, 0.0, 1.0)
    return np.concatenate([special, rng.uniform(size=n), 1.0 - rng.uniform(size=n)])


@pytest.mark.parametrize("n_bins", N_BINS)
def test_bins_equal_digitize_row_for_row(n_bins):
    q = hard_probabilities(n_bins)
    got = bin_index(q, np.linspace(0.0, 1.0, n_bins + 1))
    np.testing.assert_array_equal(got, digitize_bins(q, n_bins))
    assert got.min() >= 0 and got.max() <= n_bins - 1


@pytest.mark.parametrize("n_bins", N_BINS)
def test_curve_equals_the_digitize_curve_exactly(n_bins):
    rng = np.random.default_rng(n_bins)
    q = hard_probabilities(n_bins, seed=n_bins)
    y = rng.integers(0, 2, len(q)).astype(float)
    w = rng.uniform(0, 2, len(q))
    w[rng.uniform(size=len(q)) < 0.2] = 0.0   # zero weights: a bin of only zero-weight rows is empty
    curve = binned_curve(q, y, w, n_bins)
    edges, conf, acc, sw = reference_curve(q, y, w, n_bins)
    np.testing.assert_array_equal(curve.edges, edges)
    np.testing.assert_array_equal(curve.weight, sw)
    np.testing.assert_array_equal(curve.confidence, conf)   # NaN where empty, in the same bins
    np.testing.assert_array_equal(curve.accuracy, acc)


@pytest.mark.parametrize("n_bins", [1, 5, 10, 20, 40])
@pytest.mark.parametrize("seed", [0, 1])
def test_calibration_metrics_equal_the_digitize_metrics(n_bins, seed):
    rng = np.random.default_rng(seed)
    base = hard_probabilities(n_bins, n=3000, seed=seed)
    n = len(base)
    p = base
    lo = np.clip(p - rng.uniform(0, 0.3, n) * (rng.uniform(size=n) < 0.9), 0, 1)
    hi = np.clip(p + rng.uniform(0, 0.3, n) * (rng.uniform(size=n) < 0.9), 0, 1)
    edge_rows = rng.uniform(size=n) < 0.3   # bounds that sit exactly on edges too
    lo[edge_rows] = np.minimum(p, np.floor(p * n_bins) / n_bins)[edge_rows]
    y = rng.integers(0, 2, n).astype(float)
    y[::7] = rng.uniform(size=len(y[::7]))   # soft labels
    w = rng.uniform(0, 3, n)
    w[rng.uniform(size=n) < 0.15] = 0.0
    got = calibration_metrics(p, lo, hi, y, w, n_bins=n_bins)
    expected = reference_metrics(p, lo, hi, y, w, n_bins)
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=0, abs=0), key   # to the bit
