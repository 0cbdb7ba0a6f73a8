"""The scale s of the uncertainty u by a calibration criterion: the smallest s from which the EBCE of the
calibration pairs stays at or below a target (default 0.01, the RewardUQ paper's selection threshold).

EBCE (RewardUQ eq. 8) only falls towards 0 as the bounds widen (lower-bound probabilities sink below the observed
frequencies), so "the least EBCE" would always pick the widest interval; the smallest s that meets the target keeps the
interval as informative (CT as high) as calibration allows. The search runs over a log grid of s: EBCE is binned
and so not monotone in s at fine scale, hence "from which on it stays" rather than "the first s below the target".
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit

from rewarduq_exp.metrics.calibration import calibration_metrics

# s from 1e-3 to 1e3, 40 points per decade, and exactly 1 (the raw interval) among them.
SCALE_GRID = np.unique(np.concatenate([np.logspace(-3, 3, 241), [1.0]]))


def bound_margins(chosen: np.ndarray, rejected: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Margin chosen - rejected and its bounds when every response's bounds are scaled by ``scale`` around its
    reward: (m, m - s * H_lo, m + s * H_hi)."""
    m = chosen[:, 0] - rejected[:, 0]
    h_lo = (chosen[:, 0] - chosen[:, 1]) + (rejected[:, 2] - rejected[:, 0])
    h_hi = (chosen[:, 2] - chosen[:, 0]) + (rejected[:, 0] - rejected[:, 1])
    return m, m - scale * h_lo, m + scale * h_hi


def ebce_by_scale(chosen, rejected, weight, temperature: float, probability_map=None, n_bins: int = 20,
                  grid=SCALE_GRID) -> np.ndarray:
    """EBCE of the pairs at every s of ``grid`` after the probability map (temperature, then ``probability_map``)."""
    def mapped(margin):
        p = expit(margin / temperature)
        return probability_map(p) if probability_map is not None else p

    out = np.empty(len(grid))
    ones = np.ones(len(chosen))
    for i, s in enumerate(grid):   # ~240 binnings of N pairs: milliseconds for the calibration split's size
        m, lo, hi = bound_margins(chosen, rejected, s)
        p, p_lo, p_hi = mapped(m), mapped(lo), mapped(hi)
        out[i] = calibration_metrics(p, np.minimum(p_lo, p), np.maximum(p_hi, p), ones, weight, n_bins=n_bins)["ebce"]
    return out


def scale_for_ebce(ebce: np.ndarray, target: float, grid=SCALE_GRID) -> tuple[float, bool]:
    """(the smallest s of ``grid`` from which EBCE stays <= ``target``, whether the target is met at all; when it is
    not, the largest s)."""
    above = np.flatnonzero(ebce > target)
    if len(above) == 0:
        return float(grid[0]), True
    if above[-1] == len(grid) - 1:
        return float(grid[-1]), False
    return float(grid[above[-1] + 1]), True
