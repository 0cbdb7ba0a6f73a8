"""Temperature scaling of label rankers: one parameter T > 0 fitted on held-out rows by maximum likelihood.

Two uses share the 1-D search (:func:`fit_log_temperature`):

* :func:`fit_temperature`: RankClassifier's own temperature, softmax(logits / T) against class labels (the
  learner's ``calibrate=True`` on its internal hold-out);
* :func:`fit_distribution_temperature`: the post-hoc recalibration of any learner's predicted distribution, which the
  label-ranking run fits on a calibration share of each training fold. ``dist.temper(T)`` is each model's natural
  one-parameter family (:meth:`~rewarduq_exp.ranking.distribution.RankingDistribution.temper`: PL and PL-RPC
  log-weights / T, RankClassifier logits / T, Mallows theta / T, RPC pairwise logits / T), and T minimises the mean
  negative log-likelihood of the calibration rows' true rankings under it (RPC, which has no distribution over
  rankings: the Bernoulli likelihood of every pair of each true ranking). The likelihood as a function of T comes
  from ``dist.temperature_nll``, vectorised over samples and items: nothing loops over rankings or rows.

The search is bounded in log T (``minimize_scalar(method="bounded")``, xatol 1e-6, i.e. T to about 1e-6 relative),
which converges; the reference code's LBFGS with lr 0.01 and 50 steps moved T only part of the way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import logsumexp

# RankClassifier's own temperature: T in [1/20, 20] (kept as it was, so its runs keep their numbers).
RC_TEMPERATURE_BOUNDS = (1 / 20, 20.0)
# Post-hoc recalibration: T in [1/100, 100]. Wider than RC's: Mallows' theta or RPC's trees can be far off.
TEMPERATURE_BOUNDS = (1e-2, 1e2)


def fit_log_temperature(nll: Callable[[float], float], bounds=TEMPERATURE_BOUNDS) -> float:
    """T in ``bounds`` minimising ``nll(T)``: a bounded 1-D search over log T (xatol 1e-6)."""
    lo, hi = (math.log(float(b)) for b in bounds)
    res = minimize_scalar(lambda log_t: nll(math.exp(log_t)), bounds=(lo, hi), method="bounded",
                          options={"xatol": 1e-6})
    return float(math.exp(res.x))


def fit_temperature(logits: np.ndarray, labels: np.ndarray, bounds=RC_TEMPERATURE_BOUNDS) -> float:
    """T minimising the mean cross-entropy of softmax(logits / T) against ``labels`` (bounded search over log T)."""
    logits = np.asarray(logits, dtype=np.float64)
    picked = logits[np.arange(len(labels)), labels]

    def nll(t: float) -> float:
        return float(np.mean(logsumexp(logits / t, axis=1) - picked / t))

    return fit_log_temperature(nll, bounds)


@dataclass(frozen=True)
class TemperatureFit:
    """A fitted temperature and the calibration rows' mean negative log-likelihood before (T = 1) and after."""

    temperature: float
    nll_before: float
    nll_after: float
    rows: int
    at_bound: bool


def fit_distribution_temperature(dist, true_ranks, bounds=TEMPERATURE_BOUNDS) -> TemperatureFit:
    """The T of ``dist.temper(T)`` that minimises the mean negative log-likelihood of ``true_ranks`` (n, m), the
    calibration rows' rankings, under the tempered distribution.

    T = 1 is kept unless another T lowers the likelihood (a flat likelihood, e.g. a uniform Mallows model with
    theta = 0 or equal PL weights, leaves the distribution as it is). ``at_bound``: T ended within 1e-3 (relative)
    of a bound, i.e. the optimum may lie beyond it.
    """
    nll = dist.temperature_nll(true_ranks)
    before = float(nll(1.0))
    t = fit_log_temperature(nll, bounds)
    after = float(nll(t))
    if not after < before:
        t, after = 1.0, before
    at_bound = any(abs(math.log(t / float(b))) < 1e-3 for b in bounds)
    return TemperatureFit(temperature=t, nll_before=before, nll_after=after, rows=len(true_ranks),
                          at_bound=at_bound)
