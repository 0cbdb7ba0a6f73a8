"""compute_metrics (columns read in place, bins by the floor of q * n_bins, the symmetrised rows never built, weighted
sums by chunks) against a straightforward reference written here: the symmetrised set concatenated, np.digitize of
the rounded probabilities, np.bincount and np.dot, as the metrics were first computed. Every value within 1e-12; up
to 8192 pairs (one chunk of the weighted sums) every value to the bit."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from rewarduq_exp.metrics import calibration_curves, compute_metrics
from rewarduq_exp.metrics.calibration import binned_curve
from rewarduq_exp.metrics.preference import REWARD_COLUMNS


def sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def reference_curve(q, y, w, n_bins):
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    b = np.digitize(np.round(q, 12), edges[1:-1])
    sw = np.bincount(b, weights=w, minlength=n_bins)
    swq = np.bincount(b, weights=w * q, minlength=n_bins)
    swy = np.bincount(b, weights=w * y, minlength=n_bins)
    occ = sw > 0
    conf, acc = np.full(n_bins, np.nan), np.full(n_bins, np.nan)
    conf[occ], acc[occ] = swq[occ] / sw[occ], swy[occ] / sw[occ]
    return occ, sw / sw.sum(), conf, acc


def reference_metrics(table: pd.DataFrame, n_bins: int, alphas=(0.0, 0.2, 1.0)) -> dict[str, float]:
    """Every key of compute_metrics for a table without true_margin whose bounds are in order."""
    cr, cl, cu, rr, rl, ru = (table[c].to_numpy(dtype=float) for c in REWARD_COLUMNS)
    w = table["weight"].to_numpy(dtype=float)
    total = w.sum()
    true, ct_rows, cf_rows = cr > rr, cl > ru, cu < rl
    sums = np.bincount(np.select([ct_rows, true, cf_rows], [0, 1, 2], 3), weights=w, minlength=4)
    ct, ut, cf, uf = sums / sums.sum()
    t = np.dot(w, true) / total
    out = {"win_rate": t, "ct_rate": ct, "ut_rate": ut, "cf_rate": cf, "uf_rate": uf}
    for a in alphas:
        den_t, den_f = (1 - a) * t + a, (1 - a) * (cf + uf) + a
        out[f"rs_{a}"] = (ct / den_t if den_t else 0.0) - (cf / den_f if den_f else 0.0)
    p, p_lo, p_hi = sigmoid(cr - rr), sigmoid(cl - ru), sigmoid(cu - rl)
    ys, ws = np.concatenate([np.ones_like(p), np.zeros_like(p)]), np.concatenate([w, w])
    curves = {key: reference_curve(np.concatenate([rows, 1.0 - flipped]), ys, ws, n_bins)
              for key, rows, flipped in (("pred", p, p), ("lower", p_lo, p_hi), ("upper", p_hi, p_lo))}
    occ, share, conf, acc = curves["pred"]
    out["ece"] = np.dot(share[occ], np.abs(acc - conf)[occ])
    out["mce"] = np.max(np.abs(acc - conf)[occ])
    occ, share, conf, acc = curves["lower"]
    out["elce"] = np.dot(share[occ], np.maximum(conf - acc, 0.0)[occ])
    occ, share, conf, acc = curves["upper"]
    out["euce"] = np.dot(share[occ], np.maximum(acc - conf, 0.0)[occ])
    out["ebce"] = 0.5 * (out["elce"] + out["euce"])
    out["brier"] = np.dot(w, (p - 1.0) ** 2) / total
    out["bound_width"] = np.dot(w, (cu - cl) + (ru - rl)) / (2.0 * total)
    out["pref_bound_width"] = np.dot(w, p_hi - p_lo) / total
    out["n_pairs"] = len(table)
    out["weight_sum"] = total
    return {k: float(v) for k, v in out.items()}


def random_table(n: int, seed: int) -> pd.DataFrame:
    """Rewards and bounds with ties, zero widths, saturated margins, margins whose probabilities sit on bin edges
    (sigmoid(0) = 0.5, and bounds equal to the reward), zero weights and one weight column in another dtype."""
    rng = np.random.default_rng(seed)
    cr = rng.normal(size=n) * rng.choice([0.5, 3.0, 40.0], n)
    rr = np.where(rng.uniform(size=n) < 0.1, cr, rng.normal(size=n))
    cu, ru = rng.exponential(size=n) * (rng.uniform(size=n) < 0.9), rng.exponential(size=n)
    w = rng.uniform(0, 3, n) * (rng.uniform(size=n) < 0.85)
    w[0] = 1.0
    return pd.DataFrame({"id": [f"p{i}" for i in range(n)], "weight": w, "chosen_reward": cr,
                         "chosen_lower": cr - rng.exponential(size=n), "chosen_upper": cr + cu,
                         "rejected_reward": rr, "rejected_lower": rr - ru, "rejected_upper": rr + ru})


@pytest.mark.parametrize("n_bins", [1, 7, 20, 100])
@pytest.mark.parametrize(("n", "seed"), [(1, 0), (50, 1), (8192, 2), (20_000, 3)])
def test_compute_metrics_equals_the_reference(n, seed, n_bins):
    table = random_table(n, seed)
    before = table.copy()
    got, expected = compute_metrics(table, n_bins=n_bins), reference_metrics(table, n_bins)
    assert got.keys() == expected.keys()
    for key in expected:
        if n <= 8192:
            assert got[key] == expected[key] or (np.isnan(got[key]) and np.isnan(expected[key])), key
        assert got[key] == pytest.approx(expected[key], rel=0, abs=1e-12), key
    pd.testing.assert_frame_equal(table, before)   # the columns are read in place, never written


def test_table_columns_in_other_dtypes_and_layouts_give_the_same_metrics():
    table = random_table(3000, 4)
    expected = compute_metrics(table)
    # One 2-D float block (strided columns), float32-exact integers as int64 weights, object-dtype columns.
    block = pd.DataFrame(table[["weight", *REWARD_COLUMNS]].to_numpy(), columns=["weight", *REWARD_COLUMNS])
    assert compute_metrics(block) == expected
    as_objects = table.astype({"chosen_reward": object, "rejected_upper": object})
    assert compute_metrics(as_objects) == expected
    integer_weights = table.assign(weight=np.arange(len(table)) % 3)
    assert compute_metrics(integer_weights) == compute_metrics(integer_weights.assign(
        weight=integer_weights["weight"].astype(float)))


def test_inversion_within_tolerance_is_clipped_without_touching_the_table():
    table = random_table(200, 5)
    table.loc[3, "chosen_lower"] = table.loc[3, "chosen_reward"] + 1e-9 * max(1.0, abs(table.loc[3, "chosen_reward"]))
    table.loc[4, "rejected_upper"] = table.loc[4, "rejected_reward"] - 1e-9
    before = table.copy()
    got = compute_metrics(table)
    clipped = table.assign(chosen_lower=np.minimum(table["chosen_lower"], table["chosen_reward"]),
                           rejected_upper=np.maximum(table["rejected_upper"], table["rejected_reward"]))
    assert got == compute_metrics(clipped)
    expected = reference_metrics(clipped, 20)
    for key in expected:
        assert got[key] == expected[key] or (np.isnan(got[key]) and np.isnan(expected[key])), key
    pd.testing.assert_frame_equal(table, before)


@pytest.mark.parametrize("n_bins", [3, 20])
def test_calibration_curves_equal_the_curves_of_the_symmetrised_rows(n_bins):
    table = random_table(20_000, 6)
    w = table["weight"].to_numpy()
    cr, cl, cu, rr, rl, ru = (table[c].to_numpy() for c in REWARD_COLUMNS)
    p, p_lo, p_hi = sigmoid(cr - rr), sigmoid(cl - ru), sigmoid(cu - rl)
    ys, ws = np.concatenate([np.ones_like(p), np.zeros_like(p)]), np.concatenate([w, w])
    curves = calibration_curves(table, n_bins=n_bins)
    for key, rows, flipped in (("pred", p, p), ("lower", p_lo, p_hi), ("upper", p_hi, p_lo)):
        expected = binned_curve(np.concatenate([rows, 1.0 - flipped]), ys, ws, n_bins)
        for field in ("edges", "weight", "confidence", "accuracy"):
            np.testing.assert_array_equal(getattr(curves[key], field), getattr(expected, field), err_msg=key)
