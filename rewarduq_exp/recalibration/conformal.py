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

No s meets a guarantee when the calibration set is too small for it (even zero losses among n items do not show
risk <= alpha: :func:`smallest_feasible_n`) or when more items than allowed lose at every s (a wrong pair, or a rating
off its prediction, with zero interval width). Such a scale is marked infeasible with the reason in one line
(:attr:`ConformalScale.reason`), and nothing applies it (:mod:`rewarduq_exp.recalibration.fit`).
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
    carries no guarantee, ``reason`` says why in one line, and ``min_n`` is the smallest calibration set that could
    meet the guarantee (the same for feasible scales)."""

    scale: float
    risk: str
    alpha: float
    delta: float | None
    guarantee: str
    n: int
    feasible: bool
    risk_on_calibration: float
    min_n: int = 1
    reason: str = ""

    def to_dict(self) -> dict:
        return {"scale": self.scale, "risk": self.risk, "alpha": self.alpha, "delta": self.delta,
                "guarantee": self.guarantee, "form": FORMS[self.guarantee], "n": self.n, "feasible": self.feasible,
                "risk_on_calibration": self.risk_on_calibration, "min_n": self.min_n,
                **({} if self.feasible else {"reason": self.reason})}


# What the items of each risk are, and what a loss at every scale is, for the one-line reasons.
ITEMS = {"cf_rate": ("calibration pairs", "ranked wrong with zero interval width (confidently false at every scale)"),
         "miscoverage": ("rated responses", "off their prediction with zero interval width (outside it at every "
                                            "scale)")}


def guarantee_text(alpha: float, guarantee: str, delta: float | None) -> str:
    """``alpha=0.05, delta=0.1 (high_probability: P(risk > alpha) <= delta)``: the guarantee in one phrase."""
    if guarantee == "expectation":
        return f"alpha={alpha:g} (expectation: E[risk] <= alpha)"
    return f"alpha={alpha:g}, delta={delta:g} (high_probability: P(risk > alpha) <= delta)"


def smallest_feasible_n(alpha: float, guarantee: str = "high_probability", delta: float | None = 0.1) -> int:
    """The fewest calibration items with which some scale can meet the guarantee (all n items without a loss).

    high_probability: the smallest n with P(Binomial(n, alpha) <= 0) = (1 - alpha)^n <= delta, i.e.
    ceil(log delta / log(1 - alpha)) (45 for alpha 0.05, delta 0.1; 22 for alpha 0.1); expectation: the smallest n
    with floor(alpha (n + 1) - 1) >= 0, i.e. ceil(1 / alpha) - 1 (19 for alpha 0.05)."""
    if guarantee == "expectation":
        n = max(int(np.ceil(1.0 / alpha)) - 1, 1)
    else:
        n = max(int(np.ceil(np.log(delta) / np.log1p(-alpha))), 1)
    # The closed forms can be one off where they land within rounding of an integer: settle n on the rule itself.
    while n > 1 and allowed_losses(n - 1, alpha, guarantee, delta) >= 0:
        n -= 1
    while allowed_losses(n, alpha, guarantee, delta) < 0:
        n += 1
    return n

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
    delta = None if guarantee == "expectation" else float(delta)
    min_n, reason = smallest_feasible_n(alpha, guarantee, delta), ""
    items, lost_always = ITEMS.get(risk, ("calibration items", "with a loss at every scale"))
    if k >= n:
        scale, feasible = 0.0, True
    elif k < 0:
        scale, feasible = largest, False
        reason = (f"n={n} {items} are too few for {guarantee_text(alpha, guarantee, delta)}: no scale can meet it "
                  f"with fewer than {min_n}")
    elif not np.isfinite(t[k]):
        scale, feasible = largest, False
        reason = (f"{int(np.isinf(t).sum())} of n={n} {items} are {lost_always}, more than the {k} losses "
                  f"{guarantee_text(alpha, guarantee, delta)} allows")
    else:
        # s = t_(k+1) (descending): exactly the items with t_i > s lose, at most k of them.
        scale, feasible = max(float(t[k]), 0.0), True
    return ConformalScale(scale=scale, risk=risk, alpha=float(alpha), delta=delta, guarantee=guarantee, n=n,
                          feasible=feasible, risk_on_calibration=risk_at(t, scale), min_n=min_n, reason=reason)
