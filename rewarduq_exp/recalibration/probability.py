"""The preference probability's map after training: a temperature on the margin, and isotonic regression where the
calibration split supports it.

Temperature scaling: p = sigmoid((r_c - r_r) / T), T > 0 fitted by the weighted Bradley-Terry negative
log-likelihood on the calibration pairs. Dividing every reward by T is the same map, so the recalibrated per-response
scores are r / T and no win rate changes (T > 0 keeps every margin's sign).

The more flexible map is isotonic regression of the label on the temperature-scaled probability, not Platt scaling:
on flip-symmetric data (every pair is also read as its flip, as every calibration metric here reads it) Platt's
intercept must be 0 and Platt is then exactly temperature scaling, so it adds nothing. Isotonic can bend the curve
(e.g. over-confident only at the extremes) and stays monotone, so bounds keep their order. It is used only where the
data supports it: at least ``min_pairs`` calibration pairs and a lower cross-fitted Brier score than the
temperature's (k folds by pair, each fold's map fitted on the others), since with few pairs its steps follow noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import expit, log_expit

# T is searched in [1e-3, 1e3] (log scale): wider than any model's miscalibration, and a finite answer when the
# margins carry no signal (T then sits at the upper end: p = 0.5 for every pair).
LOG_T_BOUNDS = (np.log(1e-3), np.log(1e3))
CV_FOLDS = 5


def fit_temperature(margin, weight=None) -> float:
    """T minimising sum_i w_i * -log sigmoid(m_i / T) (the label is 1: ``m`` is chosen minus rejected).

    A one-parameter convex problem in 1/T: a bounded scalar search on log T (scipy) is clearer than a classifier
    object, and unlike a logistic regression it cannot return a negative slope, which would flip every preference.
    """
    m = np.asarray(margin, dtype=float).ravel()
    w = np.ones_like(m) if weight is None else np.asarray(weight, dtype=float).ravel()
    if not np.any(m * w):   # no signal at all (every margin 0): nothing to scale
        return 1.0

    def nll(log_t: float) -> float:
        return float(-np.dot(w, log_expit(m * np.exp(-log_t))))

    found = minimize_scalar(nll, bounds=LOG_T_BOUNDS, method="bounded", options={"xatol": 1e-10})
    return float(np.exp(found.x))


@dataclass(frozen=True)
class IsotonicMap:
    """A monotone map of probabilities by its knots (``x`` increasing, ``y`` non-decreasing, both in [0, 1]), applied
    by linear interpolation between knots and held constant beyond them (scikit-learn's ``IsotonicRegression``
    predicts the same way)."""

    x: np.ndarray
    y: np.ndarray

    def __call__(self, p) -> np.ndarray:
        return np.interp(np.asarray(p, dtype=float), self.x, self.y)


def fit_isotonic(p, y, weight=None) -> IsotonicMap:
    """Isotonic regression of labels ``y`` on probabilities ``p`` on the symmetrised rows (each pair and its flip),
    so the map satisfies g(1 - p) = 1 - g(p) up to the knots' resolution."""
    from sklearn.isotonic import IsotonicRegression

    p = np.asarray(p, dtype=float)
    y = np.asarray(y, dtype=float)
    w = np.ones_like(p) if weight is None else np.asarray(weight, dtype=float)
    model = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip")
    model.fit(np.concatenate([p, 1 - p]), np.concatenate([y, 1 - y]), sample_weight=np.concatenate([w, w]))
    return IsotonicMap(np.asarray(model.X_thresholds_, dtype=float), np.asarray(model.y_thresholds_, dtype=float))


def _brier(q: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    return float(np.dot(w, (q - y) ** 2) / w.sum())


def cross_fitted_brier(margin, weight=None, folds: int = CV_FOLDS, seed: int = 0) -> dict[str, float]:
    """Brier scores on the calibration pairs of temperature scaling and of temperature + isotonic, each pair scored
    by the maps fitted on the other folds (pairs assigned to folds at random with ``seed``)."""
    m = np.asarray(margin, dtype=float)
    w = np.ones_like(m) if weight is None else np.asarray(weight, dtype=float)
    fold = np.random.default_rng(seed).permutation(len(m)) % folds
    q_temp, q_iso = np.empty_like(m), np.empty_like(m)
    for k in range(folds):   # a handful of folds: each needs its own fit
        out, inside = fold == k, fold != k
        t = fit_temperature(m[inside], w[inside])
        iso = fit_isotonic(expit(m[inside] / t), np.ones(inside.sum()), w[inside])
        q_temp[out] = expit(m[out] / t)
        q_iso[out] = iso(q_temp[out])
    ones = np.ones_like(m)
    return {"temperature": _brier(q_temp, ones, w), "isotonic": _brier(q_iso, ones, w)}
