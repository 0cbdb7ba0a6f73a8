"""Preference accuracy metrics (RewardUQ paper, eqs. 4-6) and the predictions-table contract.

A predictions table has one row per preference pair; ``chosen`` is the response humans preferred (label 1).
Each response carries a reward and bounds ``lower = reward - beta*u``, ``upper = reward + beta*u``. Every metric is a
weighted average with the ``weight`` column, so a weight of ``w`` is the same as repeating the pair ``w`` times.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from numbers import Real

import numpy as np
import pandas as pd

from rewarduq_exp.core.checks import check_n_bins  # noqa: F401 (part of this module's interface)
from rewarduq_exp.core.errors import UserError

REWARD_COLUMNS = (
    "chosen_reward",
    "chosen_lower",
    "chosen_upper",
    "rejected_reward",
    "rejected_lower",
    "rejected_upper",
)
REQUIRED_COLUMNS = ("weight", *REWARD_COLUMNS)
DEFAULT_ALPHAS = (0.0, 0.2, 1.0)
# Bounds come out of float32 models as reward -/+ beta*u, so a tiny inversion is rounding, not a bug.
BOUND_RTOL = 1e-6

# Names used in error messages for the array API (the table API uses the column names).
_ARRAY_NAMES = tuple(
    f"{side}[:, {i}] ({part})" for side in ("chosen", "rejected") for i, part in enumerate(("reward", "lower", "upper"))
)


def ranking_score_weight(x, alpha: float):
    """f_alpha(x) = x / (x + alpha (1 - x)) (RewardUQ eq. 20), the weight RS_alpha puts on the relative confidence:

        RS_alpha = f_alpha(w) * CT / w - f_alpha(1 - w) * CF / (1 - w),   w = win rate,

    so f_alpha(w) is the largest RS_alpha can reach at win rate w (every true prediction confident) and
    -f_alpha(1 - w) the smallest. f_0 = 1 everywhere (RS_0 in [-1, 1]); f_1(x) = x (RS_1 in [w - 1, w]).
    """
    x = np.asarray(x, dtype=float)
    den = x + alpha * (1.0 - x)
    # x = 0: 0 for alpha > 0; for alpha = 0 the limit x / x = 1.
    out = np.divide(x, den, out=np.full_like(x, 1.0 if alpha == 0 else 0.0), where=den > 0)
    return out if out.ndim else float(out)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Logistic function; the tanh form never overflows."""
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=float)))




def check_alphas(alphas: Iterable[float] | float) -> tuple[float, ...]:
    """Return the ranking-score alphas as floats, or raise UserError unless each is in [0, 1]."""
    values = (alphas,) if isinstance(alphas, Real) else tuple(alphas)
    for a in values:
        if isinstance(a, bool) or not isinstance(a, Real) or not 0.0 <= float(a) <= 1.0:
            raise UserError(f"ranking-score alpha must be a number in [0, 1], got {a!r}")
    return tuple(float(a) for a in values)


def describe_rows(bad: np.ndarray, ids: Sequence | None) -> str:
    """'<count> row(s), first at id <id>' for an error message about the rows where ``bad`` is True."""
    first = int(np.flatnonzero(bad)[0])
    at = f"id {str(ids[first])!r}" if ids is not None else f"row {first}"
    return f"{int(bad.sum())} row(s), first at {at}"


def validate_pairs(
    chosen: np.ndarray,
    rejected: np.ndarray,
    weight: np.ndarray | None = None,
    *,
    names: Sequence[str] = _ARRAY_NAMES,
    ids: Sequence | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check (N, 3) reward/lower/upper arrays and weights; return float64 copies with bounds clipped.

    Raises UserError for wrong shapes, mismatched lengths, NaN/inf, negative or all-zero weights, no pairs, and
    bounds out of order beyond ``BOUND_RTOL``. Inversions within the tolerance are clipped to
    ``lower <= reward <= upper``; that makes CT a subset of T and CF a subset of F, so the four confidence rates
    partition the pairs exactly.
    """
    c = np.array(chosen, dtype=float)
    r = np.array(rejected, dtype=float)
    for side, arr in (("chosen", c), ("rejected", r)):
        if arr.ndim != 2 or arr.shape[1] != 3:
            raise UserError(f"{side} must have shape (N, 3) with columns reward, lower, upper; got {arr.shape}")
    if len(c) != len(r):
        raise UserError(f"chosen and rejected must have the same number of pairs, got {len(c)} and {len(r)}")
    n = len(c)
    if n == 0:
        raise UserError("no preference pairs: metrics need at least one pair")

    if weight is None:
        w = np.ones(n)
    else:
        w = np.array(weight, dtype=float).reshape(-1)
        if len(w) != n:
            raise UserError(f"weight must have one value per pair ({n}), got {len(w)}")
        if not np.isfinite(w).all():
            raise UserError(f"weight has NaN/inf values in {describe_rows(~np.isfinite(w), ids)}; "
                            "weights must be finite")
        if (w < 0).any():
            raise UserError(f"weight is negative in {describe_rows(w < 0, ids)}; weights must be >= 0")
    if not w.sum() > 0:
        raise UserError("all weights are zero; at least one pair needs a positive weight")

    for j, name in enumerate(names):
        col = (c if j < 3 else r)[:, j % 3]
        bad = ~np.isfinite(col)
        if bad.any():
            raise UserError(f"{name} has NaN/inf values in {describe_rows(bad, ids)}; "
                            "rewards and bounds must be finite")

    for side, arr, nm in (("chosen", c, names[:3]), ("rejected", r, names[3:])):
        reward, lower, upper = arr[:, 0], arr[:, 1], arr[:, 2]
        tol = BOUND_RTOL * np.maximum(1.0, np.abs(reward))
        for bad, what in ((lower > reward + tol, f"{nm[1]} > {nm[0]}"), (reward > upper + tol, f"{nm[0]} > {nm[2]}")):
            if bad.any():
                raise UserError(f"{what} in {describe_rows(bad, ids)}; bounds must satisfy lower <= reward <= upper")
        arr[:, 1] = np.minimum(lower, reward)
        arr[:, 2] = np.maximum(upper, reward)
    return c, r, w


def numeric_column(predictions: pd.DataFrame, name: str) -> np.ndarray:
    """One table column as float64."""
    # Non-numeric entries become NaN, so they are reported by the same finiteness check as NaN itself.
    return pd.to_numeric(predictions[name], errors="coerce").to_numpy(dtype=float)


def table_ids(predictions: pd.DataFrame) -> Sequence | None:
    """Pair ids for error messages, indexable by position; None (messages give row positions) without ``id``."""
    # No list() copy: this is read only when a row is bad, and copying a million ids costs more than the metrics.
    return predictions["id"].array if "id" in predictions.columns else None


def pairs_from_table(predictions: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate a predictions table; return ``(chosen, rejected, weight)`` as in :func:`validate_pairs`.

    Only the numeric columns are required (``id`` and ``subset`` are not used by the metrics; ``id`` names the
    offending row in error messages when present).
    """
    if not isinstance(predictions, pd.DataFrame):
        raise TypeError(f"predictions must be a pandas DataFrame, got {type(predictions).__name__}")
    missing = [c for c in REQUIRED_COLUMNS if c not in predictions.columns]
    if missing:
        raise UserError(f"predictions table is missing column(s) {', '.join(missing)}; "
                        f"required: {', '.join(REQUIRED_COLUMNS)}")
    values = np.column_stack([numeric_column(predictions, c) for c in REWARD_COLUMNS])
    return validate_pairs(values[:, :3], values[:, 3:], numeric_column(predictions, "weight"),
                          names=REWARD_COLUMNS, ids=table_ids(predictions))


def pair_margins(chosen: np.ndarray, rejected: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reward margin chosen-minus-rejected and its bounds: ``(c.reward - r.reward, c.lower - r.upper,
    c.upper - r.lower)``."""
    return chosen[:, 0] - rejected[:, 0], chosen[:, 1] - rejected[:, 2], chosen[:, 2] - rejected[:, 1]


def preference_probabilities(chosen: np.ndarray, rejected: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bradley-Terry probability that chosen beats rejected, with bounds: sigmoid of :func:`pair_margins`."""
    m, m_lo, m_hi = pair_margins(chosen, rejected)
    return sigmoid(m), sigmoid(m_lo), sigmoid(m_hi)


def _safe_div(num: float, den: float) -> float:
    # Only 0/0 reaches den == 0 (CT <= T, CF <= F); the paper defines it as 0.
    return 0.0 if den == 0 else num / den


def ranking_score(ct: float, cf: float, t: float, f: float, alpha: float) -> float:
    """Ranking score RS_alpha (eq. 6): ``CT / ((1-a)T + a) - CF / ((1-a)F + a)``, with 0/0 := 0.

    RS_1 = CT - CF; RS_0 = CT/T - CF/F.
    """
    a = check_alphas([alpha])[0]
    return _safe_div(ct, (1.0 - a) * t + a) - _safe_div(cf, (1.0 - a) * f + a)


def _accuracy(c: np.ndarray, r: np.ndarray, w: np.ndarray, alphas: tuple[float, ...]) -> dict[str, float]:
    true = c[:, 0] > r[:, 0]
    conf_true = c[:, 1] > r[:, 2]
    conf_false = c[:, 2] < r[:, 1]
    # One class per pair, so CT+UT+CF+UF sums to 1 and empty classes are exactly 0 (keeps 0/0 detection exact).
    cls = np.where(conf_true, 0, np.where(true, 1, np.where(conf_false, 2, 3)))
    sums = np.bincount(cls, weights=w, minlength=4)
    ct, ut, cf, uf = (float(s) for s in sums / sums.sum())
    # The win rate from the rewards alone, not as CT + UT: the same for any bounds to the last bit (recalibration,
    # which moves pairs between CT and UT, must not change it even by rounding).
    t, f = float(np.dot(w, true) / w.sum()), cf + uf
    out = {"win_rate": t, "ct_rate": ct, "ut_rate": ut, "cf_rate": cf, "uf_rate": uf}
    for a in alphas:
        out[f"rs_{a}"] = ranking_score(ct, cf, t, f, a)
    return out


def accuracy_metrics(
    chosen: np.ndarray,
    rejected: np.ndarray,
    weight: np.ndarray | None = None,
    alphas: Iterable[float] = DEFAULT_ALPHAS,
) -> dict[str, float]:
    """Win rate (eq. 4), confidence rates (eq. 5) and ranking scores (eq. 6) of N preference pairs.

    ``chosen`` and ``rejected`` have shape (N, 3) with columns reward, lower, upper. All comparisons are strict,
    so ties count as false. Keys: ``win_rate`` (T), ``ct_rate`` = avg[c.lower > r.upper], ``ut_rate`` = T - CT,
    ``cf_rate`` = avg[c.upper < r.lower], ``uf_rate`` = F - CF, and ``rs_<alpha>`` for each alpha.
    """
    alphas = check_alphas(alphas)
    c, r, w = validate_pairs(chosen, rejected, weight)
    return _accuracy(c, r, w, alphas)


def bound_width(c: np.ndarray, r: np.ndarray, w: np.ndarray) -> float:
    """Weighted mean of ``upper - lower`` over the 2N responses (chosen and rejected, each with the pair weight)."""
    return float(np.dot(w, (c[:, 2] - c[:, 1]) + (r[:, 2] - r[:, 1])) / (2.0 * w.sum()))


def longer_wins_rate(chosen_length, rejected_length, weight=None) -> float:
    """Win rate of the length baseline "the longer completion wins": the weighted mean over pairs of 1 where the
    chosen completion is longer, 0.5 where both are equally long, 0 where the rejected one is longer (compare with
    ``win_rate``, where a tie counts as false). Lengths in any unit (the runner counts characters)."""
    c = np.asarray(chosen_length, dtype=float).ravel()
    r = np.asarray(rejected_length, dtype=float).ravel()
    w = np.ones(len(c)) if weight is None else np.asarray(weight, dtype=float).ravel()
    if not (len(c) == len(r) == len(w)) or len(c) == 0:
        raise UserError(f"longer-wins needs one chosen length, rejected length and weight per pair (got {len(c)}, "
                        f"{len(r)} and {len(w)}; at least one pair)")
    if not (np.isfinite(c).all() and np.isfinite(r).all() and np.isfinite(w).all()) or (w < 0).any() \
            or w.sum() <= 0:
        raise UserError("longer-wins needs finite lengths and finite weights >= 0 with a positive sum")
    return float(np.dot(w, np.sign(c - r) * 0.5 + 0.5) / w.sum())
