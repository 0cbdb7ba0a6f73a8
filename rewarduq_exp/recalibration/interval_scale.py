"""The scale s of the uncertainty u by the RewardUQ paper's own selection rule, applied to s: among the scales whose
EBCE on the calibration split is at most a target (default 0.01, the paper's threshold), the one with the highest
RS_0.2 there (paper eq. 6; ties: the smaller s).

EBCE (eq. 8) alone cannot choose s: it only falls as the bounds widen, and a well-calibrated probability already
meets 0.01 with bounds of zero width (EBCE is then about ECE / 2), so "the least EBCE" picks the widest interval and
"the smallest s under the target" nearly the narrowest, whose CF is every false pair. RS_0.2 rewards confident true
pairs and penalises confident false ones, so it peaks in between; the EBCE target keeps the bounds calibrated.
When no s meets the target, the one with the least EBCE. The search runs over a log grid of s (both metrics are
step functions of s).
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit

from rewarduq_exp.metrics.calibration import calibration_metrics
from rewarduq_exp.metrics.preference import ranking_score

# s from 1e-3 to 1e3, 40 points per decade, and exactly 1 (the raw interval) among them.
SCALE_GRID = np.unique(np.concatenate([np.logspace(-3, 3, 241), [1.0]]))


def bound_margins(chosen: np.ndarray, rejected: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Margin chosen - rejected and its bounds when every response's bounds are scaled by ``scale`` around its
    reward: (m, m - s * H_lo, m + s * H_hi)."""
    m = chosen[:, 0] - rejected[:, 0]
    h_lo = (chosen[:, 0] - chosen[:, 1]) + (rejected[:, 2] - rejected[:, 0])
    h_hi = (chosen[:, 2] - chosen[:, 0]) + (rejected[:, 0] - rejected[:, 1])
    return m, m - scale * h_lo, m + scale * h_hi


def metrics_by_scale(chosen, rejected, weight, temperature: float, probability_map=None, n_bins: int = 20,
                     rank_alpha: float = 0.2, grid=SCALE_GRID) -> dict[str, np.ndarray]:
    """EBCE (after the probability map: temperature, then ``probability_map``) and RS_``rank_alpha`` of the pairs at
    every s of ``grid``."""
    def mapped(margin):
        p = expit(margin / temperature)
        return probability_map(p) if probability_map is not None else p

    ebce, rs = np.empty(len(grid)), np.empty(len(grid))
    ones = np.ones(len(chosen))
    total = weight.sum()
    true = float(np.dot(weight, chosen[:, 0] > rejected[:, 0]) / total)
    for i, s in enumerate(grid):   # ~240 binnings of N pairs: well under a second for a calibration split
        m, lo, hi = bound_margins(chosen, rejected, s)
        p, p_lo, p_hi = mapped(m), mapped(lo), mapped(hi)
        ebce[i] = calibration_metrics(p, np.minimum(p_lo, p), np.maximum(p_hi, p), ones, weight,
                                      n_bins=n_bins)["ebce"]
        ct, cf = float(np.dot(weight, lo > 0) / total), float(np.dot(weight, hi < 0) / total)
        rs[i] = ranking_score(ct, cf, true, 1.0 - true, rank_alpha)
    return {"ebce": ebce, "rs": rs}


def scale_by_rule(ebce: np.ndarray, rs: np.ndarray, target: float, grid=SCALE_GRID) -> tuple[float, bool]:
    """(the s of ``grid`` with the highest RS among those with EBCE <= ``target``, the smallest on ties; whether any
    s met the target: if none did, the s with the least EBCE)."""
    ok = ebce <= target
    if not ok.any():
        return float(grid[int(np.argmin(ebce))]), False
    best = np.flatnonzero(ok & (rs == rs[ok].max()))
    return float(grid[best[0]]), True
