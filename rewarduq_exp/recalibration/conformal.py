"""A scale s of the uncertainty u with a finite-sample guarantee on a risk of the intervals.

Both risks used here are shares of items whose loss is 1 below a threshold of s and 0 above it, so the risk only
falls as s grows (a monotone loss):

* pairs (reward models): CF / N, the share of pairs the bounds call certain and that are wrong. With the bounds
  r +- s * beta * u, pair i is confidently false when (r_c - r_r) + s * H_i < 0, H_i = (upper_c - r_c) +
  (r_r - lower_r), i.e. when s < t_i = -(r_c - r_r) / H_i (a pair ranked right never is: t_i = 0; a wrong pair
  without any width always is: t_i = inf). Temperature scaling divides both sides by T and leaves t_i unchanged.
* rated responses (BoRP): miscoverage, the share of ratings outside r +- s * beta * u: t_i = |y_i - r_i| / (beta u_i).

Two guarantees, for a new item exchangeable with the n calibration items:

* ``expectation`` (conformal risk control, Angelopoulos et al. 2024, with loss bound B = 1): the smallest s with
  (n * R_n(s) + 1) / (n + 1) <= alpha; then E[risk(s)] <= alpha. For miscoverage this is split conformal
  prediction's quantile.
* ``high_probability`` (risk-controlling prediction sets, Bates et al. 2021, with the exact binomial bound; for a
  monotone loss Learn-then-Test's fixed-sequence test gives the same s): the smallest s whose count of losses c(s)
  has P(Binomial(n, alpha) <= c(s)) <= delta; then P(risk(s) > alpha) <= delta over the draw of the calibration set.

A few lines of numpy and scipy's binomial: MAPIE's risk control is built for multi-label sets and crepes for
regression intervals, neither for this pairwise risk; the thresholds make both guarantees exact without a grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import binom

from rewarduq_exp.core.errors import UserError

GUARANTEES = ("high_probability", "expectation")
FORMS = {
    "high_probability": "P(risk > alpha) <= delta over the draw of the calibration set (risk-controlling prediction "
                        "sets with the exact binomial bound; Learn-then-Test's fixed-sequence test for this monotone "
                        "risk)",
    "expectation": "E[risk] <= alpha for a new exchangeable item (conformal risk control, loss bound 1)",
}


@dataclass(frozen=True)
class ConformalScale:
    """The chosen scale and what it guarantees. ``feasible`` is False when no s reaches the guarantee (too few
    items for alpha, or items whose loss stays 1 at any s): ``scale`` is then the largest finite threshold and
    carries no guarantee."""

    scale: float
    risk: str
    alpha: float
    delta: float | None
    guarantee: str
    n: int
    feasible: bool
    risk_on_calibration: float

    def to_dict(self) -> dict:
        return {"scale": self.scale, "risk": self.risk, "alpha": self.alpha, "delta": self.delta,
                "guarantee": self.guarantee, "form": FORMS[self.guarantee], "n": self.n, "feasible": self.feasible,
                "risk_on_calibration": self.risk_on_calibration}


def pair_thresholds(chosen: np.ndarray, rejected: np.ndarray) -> np.ndarray:
    """t_i of each pair: the pair is confidently false (CF) exactly when s < t_i. ``chosen``/``rejected`` are (N, 3)
    arrays of reward, lower, upper."""
    margin = chosen[:, 0] - rejected[:, 0]
    width = (chosen[:, 2] - chosen[:, 0]) + (rejected[:, 0] - rejected[:, 1])
    t = np.zeros(len(margin))
    wrong = margin < 0
    with np.errstate(divide="ignore"):
        t[wrong] = np.where(width[wrong] > 0, -margin[wrong] / np.where(width[wrong] > 0, width[wrong], 1.0),
                            np.inf)
    return t


def coverage_thresholds(y, reward, half_width) -> np.ndarray:
    """t_i of each rated response: the rating lies outside r +- s * half_width exactly when s < t_i."""
    gap = np.abs(np.asarray(y, dtype=float) - np.asarray(reward, dtype=float))
    h = np.asarray(half_width, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(h > 0, gap / np.where(h > 0, h, 1.0), np.where(gap > 0, np.inf, 0.0))


def risk_at(thresholds: np.ndarray, scale: float) -> float:
    """The empirical risk R_n(s): the share of items with a loss at scale s (s < t_i)."""
    return float(np.mean(np.asarray(thresholds) > scale))


def allowed_losses(n: int, alpha: float, guarantee: str, delta: float | None) -> int:
    """The largest count of losses among n calibration items that still meets the guarantee (-1: none does)."""
    if guarantee == "expectation":
        return int(np.floor(alpha * (n + 1) - 1 + 1e-12))
    counts = np.arange(n + 1)
    ok = np.flatnonzero(binom.cdf(counts, n, alpha) <= delta)
    return int(ok[-1]) if len(ok) else -1


def conformal_scale(thresholds, alpha: float, *, guarantee: str = "high_probability", delta: float | None = 0.1,
                    risk: str = "cf_rate") -> ConformalScale:
    """The smallest s >= 0 meeting ``guarantee`` for the risk whose per-item thresholds are ``thresholds``."""
    if guarantee not in GUARANTEES:
        raise UserError(f"recalibrate.guarantee={guarantee!r} is invalid: allowed values are {', '.join(GUARANTEES)}")
    if not 0 < alpha < 1:
        raise UserError(f"recalibrate.alpha={alpha!r} is invalid: must be in (0, 1)")
    if guarantee == "high_probability" and (delta is None or not 0 < delta < 1):
        raise UserError(f"recalibrate.delta={delta!r} is invalid: must be in (0, 1)")
    t = np.sort(np.asarray(thresholds, dtype=float))[::-1]   # descending
    n = len(t)
    if n == 0:
        raise UserError("conformal calibration needs at least one calibration item")
    k = allowed_losses(n, alpha, guarantee, delta)
    finite = t[np.isfinite(t)]
    largest = float(finite[0]) if len(finite) else 0.0
    if k >= n:
        scale, feasible = 0.0, True
    elif k < 0 or not np.isfinite(t[k]):
        scale, feasible = largest, False
    else:
        # s = t_(k+1) (descending): exactly the items with t_i > s lose, at most k of them.
        scale, feasible = max(float(t[k]), 0.0), True
    return ConformalScale(scale=scale, risk=risk, alpha=float(alpha), delta=None if guarantee == "expectation"
                          else float(delta), guarantee=guarantee, n=n, feasible=feasible,
                          risk_on_calibration=risk_at(t, scale))
