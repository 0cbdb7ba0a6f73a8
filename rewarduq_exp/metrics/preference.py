"""Preference accuracy metrics (RewardUQ paper, eqs. 4-6) and the predictions-table contract.

A predictions table has one row per preference pair; ``chosen`` is the response humans preferred (label 1).
Each response carries a reward and bounds ``lower = reward - beta*u``, ``upper = reward + beta*u``. Every metric is a
weighted average with the ``weight`` column, so a weight of ``w`` is the same as repeating the pair ``w`` times.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from numbers import Real
from typing import NamedTuple

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


# OpenBLAS computes a dot product of more than 10000 values on several threads (its x86_64 ddot kernel), and on a
# busy machine the caller then waits for each worker to be scheduled: milliseconds per call, against microseconds
# for the work. Chunks below that size run on the calling thread.
_DOT_CHUNK = 8192


def weighted_sum(w: np.ndarray, x) -> float:
    """``np.dot(w, x)`` of two 1-D arrays, by chunks of 8192 added in order: np.dot's value to the bit up to 8192
    values; above, within a few ulps of it (and independent of the BLAS thread count, which np.dot is not).

    ``x`` may also be a function ``x(rows, out)`` returning the values of a slice of rows, written into ``out``
    (float64, as long as the slice): they are then computed a chunk at a time, with no array of N values.
    """
    n = len(w)
    size = max(1, min(n, _DOT_CHUNK))
    out = np.empty(size) if callable(x) else None
    total = 0.0
    for i in range(0, n, size):
        rows = slice(i, i + size)
        values = x(rows, out[:len(w[rows])]) if callable(x) else x[rows]
        total += float(np.dot(w[rows], values))
    return total


def _sigmoid_in_place(x: np.ndarray) -> np.ndarray:
    """:func:`sigmoid` of a float64 array, written over it: the same operations in the same order, so the same
    values, without the three temporary arrays (each a fresh allocation the size of ``x``)."""
    np.multiply(x, 0.5, out=x)
    np.tanh(x, out=x)
    np.add(x, 1.0, out=x)
    return np.multiply(x, 0.5, out=x)



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


class PairColumns(NamedTuple):
    """The six reward columns and the weights of N validated pairs: float64, 1-D, contiguous, bounds ordered
    (``lower <= reward <= upper``). Read only: they may be views of the caller's table."""

    chosen_reward: np.ndarray
    chosen_lower: np.ndarray
    chosen_upper: np.ndarray
    rejected_reward: np.ndarray
    rejected_lower: np.ndarray
    rejected_upper: np.ndarray
    weight: np.ndarray

    def chosen(self) -> np.ndarray:
        """The (N, 3) array reward, lower, upper of the chosen responses (a new C-ordered array)."""
        return np.stack(self[:3], axis=1)

    def rejected(self) -> np.ndarray:
        return np.stack(self[3:6], axis=1)

    @classmethod
    def of_arrays(cls, chosen: np.ndarray, rejected: np.ndarray, weight: np.ndarray) -> PairColumns:
        """Column views of validated (N, 3) arrays (see :func:`validate_pairs`)."""
        return cls(chosen[:, 0], chosen[:, 1], chosen[:, 2], rejected[:, 0], rejected[:, 1], rejected[:, 2], weight)

    def margins(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As :func:`pair_margins`."""
        return (self.chosen_reward - self.rejected_reward, self.chosen_lower - self.rejected_upper,
                self.chosen_upper - self.rejected_lower)

    def probabilities(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As :func:`preference_probabilities`, value for value: each margin and its sigmoid computed in place in the
        result, a chunk of rows at a time (in the CPU cache)."""
        p = np.empty((3, len(self.weight)))
        pairs = ((self.chosen_reward, self.rejected_reward), (self.chosen_lower, self.rejected_upper),
                 (self.chosen_upper, self.rejected_lower))
        for i in range(0, p.shape[1], _DOT_CHUNK):
            rows = slice(i, i + _DOT_CHUNK)
            for out, (a, b) in zip(p, pairs):
                _sigmoid_in_place(np.subtract(a[rows], b[rows], out=out[rows]))
        return p[0], p[1], p[2]


def _all_finite(x: np.ndarray) -> bool:
    # The sum is NaN/inf whenever any value is, so one allocation-free pass settles the common case; only a
    # non-finite sum (a bad value, or finite values overflowing) needs the elementwise test.
    return bool(np.isfinite(x.sum())) or bool(np.isfinite(x).all())


def check_pair_columns(
    columns: Sequence[np.ndarray], weight: np.ndarray | None, *, names: Sequence[str], ids: Sequence | None
) -> PairColumns:
    """Validate six equally long float64 columns (reward, lower, upper of chosen, then of rejected) and weights, as
    :func:`validate_pairs` does, with its messages in its order. Nothing is copied unless a column needs it: a
    strided one is made contiguous, and a bound inverted within ``BOUND_RTOL`` is clipped into a new array."""
    n = len(columns[0])
    if n == 0:
        raise UserError("no preference pairs: metrics need at least one pair")
    if weight is None:
        w = np.ones(n)
    else:
        w = np.ascontiguousarray(weight, dtype=float).reshape(-1)
        if len(w) != n:
            raise UserError(f"weight must have one value per pair ({n}), got {len(w)}")
        if not _all_finite(w):
            raise UserError(f"weight has NaN/inf values in {describe_rows(~np.isfinite(w), ids)}; "
                            "weights must be finite")
        if (w < 0).any():
            raise UserError(f"weight is negative in {describe_rows(w < 0, ids)}; weights must be >= 0")
    if not w.sum() > 0:
        raise UserError("all weights are zero; at least one pair needs a positive weight")

    cols = [np.ascontiguousarray(col, dtype=float) for col in columns]
    for col, name in zip(cols, names):
        if not _all_finite(col):
            raise UserError(f"{name} has NaN/inf values in {describe_rows(~np.isfinite(col), ids)}; "
                            "rewards and bounds must be finite")

    for k in (0, 3):
        reward, lower, upper = cols[k:k + 3]
        nm = names[k:k + 3]
        if _inverted(lower, reward, reward, nm[1], nm[0], ids):
            cols[k + 1] = np.minimum(lower, reward)
        if _inverted(reward, upper, reward, nm[0], nm[2], ids):
            cols[k + 2] = np.maximum(upper, reward)
    return PairColumns(*cols, w)


def _inverted(smaller, larger, reward, smaller_name: str, larger_name: str, ids) -> bool:
    """Whether ``smaller`` exceeds ``larger`` anywhere (a rounding inversion, to be clipped); a UserError where it
    does by more than BOUND_RTOL. Bounds in order need neither the tolerance nor clipping, and most tables have no
    inversion at all, so the tolerance is computed only when one exists."""
    if not (smaller > larger).any():
        return False
    bad = smaller > larger + BOUND_RTOL * np.maximum(1.0, np.abs(reward))
    if bad.any():
        raise UserError(f"{smaller_name} > {larger_name} in {describe_rows(bad, ids)}; "
                        "bounds must satisfy lower <= reward <= upper")
    return True


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
    w = None if weight is None else np.array(weight, dtype=float).reshape(-1)
    checked = check_pair_columns([c[:, 0], c[:, 1], c[:, 2], r[:, 0], r[:, 1], r[:, 2]], w, names=names, ids=ids)
    c[:, 1], c[:, 2], r[:, 1], r[:, 2] = checked[1], checked[2], checked[4], checked[5]   # the clipped bounds
    return c, r, checked.weight


def numeric_column(predictions: pd.DataFrame, name: str) -> np.ndarray:
    """One table column as float64."""
    # Non-numeric entries become NaN, so they are reported by the same finiteness check as NaN itself.
    return pd.to_numeric(predictions[name], errors="coerce").to_numpy(dtype=float)


def _column_view(predictions: pd.DataFrame, name: str) -> np.ndarray:
    """:func:`numeric_column` without its copy where the column is float64 already (then a view: read only)."""
    series = predictions[name]
    return series.to_numpy(copy=False) if series.dtype == np.float64 else numeric_column(predictions, name)


def table_ids(predictions: pd.DataFrame) -> Sequence | None:
    """Pair ids for error messages, indexable by position; None (messages give row positions) without ``id``."""
    # No list() copy: this is read only when a row is bad, and copying a million ids costs more than the metrics.
    return predictions["id"].array if "id" in predictions.columns else None


def table_columns(predictions: pd.DataFrame) -> PairColumns:
    """Validate a predictions table; return its pairs as :class:`PairColumns` (views of the table where its columns
    are float64 already, so nothing is copied). Errors as :func:`pairs_from_table`."""
    if not isinstance(predictions, pd.DataFrame):
        raise TypeError(f"predictions must be a pandas DataFrame, got {type(predictions).__name__}")
    missing = [c for c in REQUIRED_COLUMNS if c not in predictions.columns]
    if missing:
        raise UserError(f"predictions table is missing column(s) {', '.join(missing)}; "
                        f"required: {', '.join(REQUIRED_COLUMNS)}")
    return check_pair_columns([_column_view(predictions, c) for c in REWARD_COLUMNS],
                              _column_view(predictions, "weight"), names=REWARD_COLUMNS,
                              ids=table_ids(predictions))


def pairs_from_table(predictions: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate a predictions table; return ``(chosen, rejected, weight)`` as in :func:`validate_pairs`.

    Only the numeric columns are required (``id`` and ``subset`` are not used by the metrics; ``id`` names the
    offending row in error messages when present).
    """
    pairs = table_columns(predictions)
    return pairs.chosen(), pairs.rejected(), np.array(pairs.weight)


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
    return pair_accuracy(PairColumns.of_arrays(c, r, w), alphas)


def pair_accuracy(pairs: PairColumns, alphas: tuple[float, ...]) -> dict[str, float]:
    """Win rate, confidence rates and ranking scores of validated pairs (see :func:`accuracy_metrics`)."""
    w = pairs.weight
    true = pairs.chosen_reward > pairs.rejected_reward
    conf_true = pairs.chosen_lower > pairs.rejected_upper
    conf_false = pairs.chosen_upper < pairs.rejected_lower
    # One class per pair, so CT+UT+CF+UF sums to 1 and empty classes are exactly 0 (keeps 0/0 detection exact).
    # Class 0 if conf_true, else 1 if true, else 2 if conf_false, else 3 (np.where's chain of these, at a tenth of its
    # cost): ((1 + ~conf_false) * ~true + 1) * ~conf_true, in bytes, summed by np.add.at (in index order, as
    # np.bincount) without an array of N default integers.
    cls = np.logical_not(conf_false).view(np.uint8)
    cls += 1
    cls *= ~true
    cls += 1
    cls *= ~conf_true
    sums = np.zeros(4)
    np.add.at(sums, cls, w)
    ct, ut, cf, uf = (float(s) for s in sums / sums.sum())
    # The win rate from the rewards alone, not as CT + UT: the same for any bounds to the last bit (recalibration,
    # which moves pairs between CT and UT, must not change it even by rounding).
    t, f = weighted_sum(w, true) / float(w.sum()), cf + uf
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
    return pair_bound_width(PairColumns.of_arrays(c, r, w))


def pair_bound_width(pairs: PairColumns) -> float:
    """:func:`bound_width` of validated pairs."""
    def width(rows, out):
        np.subtract(pairs.chosen_upper[rows], pairs.chosen_lower[rows], out=out)
        return np.add(out, pairs.rejected_upper[rows] - pairs.rejected_lower[rows], out=out)

    return weighted_sum(pairs.weight, width) / float(2.0 * pairs.weight.sum())


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
