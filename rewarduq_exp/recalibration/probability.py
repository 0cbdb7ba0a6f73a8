"""The preference probability's map after training: a temperature on the margin, and isotonic regression where the
calibration split supports it.

Temperature scaling: p = sigmoid((r_c - r_r) / T), T > 0 fitted by the weighted Bradley-Terry negative
log-likelihood on the calibration pairs. Dividing every reward by T is the same map, so the recalibrated per-response
scores are r / T and no win rate changes (T > 0 keeps every margin's sign).

The more flexible map is isotonic regression of the label on the temperature-scaled probability, not Platt scaling:
on flip-symmetric data (every pair is also read as its flip, as every calibration metric here reads it) Platt's
intercept must be 0 and Platt is then exactly temperature scaling, so it adds nothing. Isotonic can bend the curve
(e.g. over-confident only at the extremes) and stays monotone, so bounds keep their order. It is used only where the
data supports it: at least ``min_pairs`` calibration pairs and a cross-fitted Brier score lower than the
temperature's by more than ``isotonic_z`` (:data:`ISOTONIC_Z`) standard errors of their paired difference (k folds by
pair, each fold's map fitted on the others), since its steps follow noise: chosen whenever its Brier score was lower
at all (10-20 % of the draws of 500-2000 calibration pairs), it made the eval ECE worse than T alone by 0.004-0.013
in 74-93 % of those draws on the default synthetic world (docs/recalibration.md).

A temperature from a small calibration split is noisy too (from 20 pairs T landed anywhere in 0.19-1.15 for a model
whose T is 0.7), and a noisy T makes the ECE of new pairs worse than the raw one on average: ECE is smallest near the
true T, so every error of T costs. Two guards, both measured (scripts/calibration_size_table.py,
docs/recalibration.md): ``prior_sd`` shrinks log T towards 0 (T = 1: the raw probabilities) by a normal prior, the
MAP estimate, so few pairs move T little and many pairs override the prior; and :func:`cross_fitted_log_loss` lets the
caller keep T = 1 unless the fitted temperature lowers the log loss of held-out calibration pairs.
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
# By default isotonic must beat the temperature's cross-fitted Brier score by this many standard errors of the paired
# difference (a one-sided 5 % test; recalibrate.isotonic_z): with a plain "lower" (0) it was chosen in 10-20 % of
# the draws of models it made worse.
ISOTONIC_Z = 1.645


def fit_temperature(margin, weight=None, prior_sd: float | None = None) -> float:
    """T minimising sum_i w_i * -log sigmoid(m_i / T) (the label is 1: ``m`` is chosen minus rejected), plus
    (log T)^2 / (2 prior_sd^2) with ``prior_sd``: the MAP estimate under log T ~ N(0, prior_sd^2) (weights count as
    repetitions of a pair, the prior once).

    A one-parameter problem on log T: a bounded scalar search (scipy) is clearer than a classifier object, and unlike
    a logistic regression it cannot return a negative slope, which would flip every preference.
    """
    m = np.asarray(margin, dtype=float).ravel()
    w = np.ones_like(m) if weight is None else np.asarray(weight, dtype=float).ravel()
    if not np.any(m * w):   # no signal at all (every margin 0): nothing to scale
        return 1.0
    precision = 0.0 if prior_sd is None else 1.0 / float(prior_sd) ** 2

    def nll(log_t: float) -> float:
        return float(-np.dot(w, log_expit(m * np.exp(-log_t)))) + 0.5 * precision * log_t ** 2

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


def _folds(n: int, folds: int, seed: int) -> np.ndarray:
    """Each pair's fold: a random permutation (``seed``) dealt round-robin, so fold sizes differ by at most one."""
    return np.random.default_rng(seed).permutation(n) % folds


def cross_fitted_log_loss(margin, weight=None, prior_sd: float | None = None, folds: int = CV_FOLDS,
                          seed: int = 0) -> dict[str, float]:
    """Weighted mean log loss of the calibration pairs with the temperature fitted (``prior_sd`` as in
    :func:`fit_temperature`) on the other folds (``fitted``), and with T = 1 (``raw``: the model's own
    probabilities). Fewer pairs than folds: one fold per pair (leave-one-out)."""
    m = np.asarray(margin, dtype=float)
    w = np.ones_like(m) if weight is None else np.asarray(weight, dtype=float)
    fold = _folds(len(m), min(folds, len(m)), seed)
    t = np.empty_like(m)
    for k in range(int(fold.max()) + 1):   # a handful of folds: each needs its own fit
        t[fold == k] = fit_temperature(m[fold != k], w[fold != k], prior_sd)
    total = w.sum()
    return {"fitted": float(-np.dot(w, log_expit(m / t)) / total), "raw": float(-np.dot(w, log_expit(m)) / total)}


def cross_fitted_brier(margin, weight=None, folds: int = CV_FOLDS, seed: int = 0,
                       fit_t=fit_temperature) -> dict[str, float]:
    """Brier scores on the calibration pairs of temperature scaling and of temperature + isotonic, each pair scored
    by the maps fitted on the other folds (pairs assigned to folds at random with ``seed``), and the standard error
    of their difference (``difference_se``: of the weighted mean of the per-pair differences, which are paired);
    ``fit_t(margin, weight)`` fits the temperature as the caller does (a prior, or T = 1 where the caller keeps the
    raw scale)."""
    m = np.asarray(margin, dtype=float)
    w = np.ones_like(m) if weight is None else np.asarray(weight, dtype=float)
    fold = _folds(len(m), folds, seed)
    q_temp, q_iso = np.empty_like(m), np.empty_like(m)
    for k in range(folds):   # a handful of folds: each needs its own fit
        out, inside = fold == k, fold != k
        t = fit_t(m[inside], w[inside])
        iso = fit_isotonic(expit(m[inside] / t), np.ones(inside.sum()), w[inside])
        q_temp[out] = expit(m[out] / t)
        q_iso[out] = iso(q_temp[out])
    ones = np.ones_like(m)
    d = (q_iso - 1.0) ** 2 - (q_temp - 1.0) ** 2
    mean = np.dot(w, d) / w.sum()
    se = float(np.sqrt(np.dot(w ** 2, (d - mean) ** 2) * len(m) / max(len(m) - 1, 1)) / w.sum())
    return {"temperature": _brier(q_temp, ones, w), "isotonic": _brier(q_iso, ones, w), "difference_se": se}
