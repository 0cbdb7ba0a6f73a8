"""Metrics against the true reward margin, available only on the synthetic dataset (column ``true_margin``).

``true_margin`` is the true reward of chosen minus rejected in logit units, so the true preference probability is
``p* = sigmoid(true_margin)``. These metrics measure how close the model gets to the truth rather than to the
sampled labels.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics.calibration import binned_curve
from rewarduq_exp.metrics.preference import (
    check_n_bins,
    describe_rows,
    numeric_column,
    sigmoid,
    table_columns,
    table_ids,
)

TRUTH_COLUMN = "true_margin"


def true_margins(predictions: pd.DataFrame) -> np.ndarray:
    """The validated ``true_margin`` column; raise UserError if it is absent or not finite."""
    if TRUTH_COLUMN not in predictions.columns:
        raise UserError(f"predictions table has no {TRUTH_COLUMN} column; truth metrics need the synthetic dataset")
    tm = numeric_column(predictions, TRUTH_COLUMN)
    bad = ~np.isfinite(tm)
    if bad.any():
        raise UserError(f"{TRUTH_COLUMN} has NaN/inf values in {describe_rows(bad, table_ids(predictions))}; "
                        "it must be finite")
    return tm


def _truth(margins: tuple[np.ndarray, np.ndarray, np.ndarray], w: np.ndarray, tm: np.ndarray,
           n_bins: int) -> dict[str, float]:
    m, m_lo, m_hi = margins
    p, p_star = sigmoid(m), sigmoid(tm)
    total = w.sum()

    def avg(x: np.ndarray) -> float:
        return float(np.dot(w, x) / total)

    # ECE against the true probability: p* is a soft label, so the flipped row (1 - p) gets target 1 - p*.
    q, target, ws = np.concatenate([p, 1.0 - p]), np.concatenate([p_star, 1.0 - p_star]), np.concatenate([w, w])
    return {
        "truth/bayes_win_rate": avg(tm > 0),
        "truth/expected_bayes_win_rate": avg(np.maximum(p_star, 1.0 - p_star)),
        "truth/ece": binned_curve(q, target, ws, n_bins).ece(),
        "truth/prob_mae": avg(np.abs(p - p_star)),
        "truth/margin_coverage": avg((m_lo <= tm) & (tm <= m_hi)),
    }


def truth_metrics(predictions: pd.DataFrame, *, n_bins: int = 20) -> dict[str, float]:
    """Metrics against the true margin ``true_margin`` (p* = sigmoid(true_margin)), all weighted by ``weight``.

    - ``truth/bayes_win_rate``: avg[true_margin > 0], the win rate (eq. 4) the true reward gets on these labels;
    - ``truth/expected_bayes_win_rate``: avg[max(p*, 1-p*)], its expectation over label noise;
    - ``truth/ece``: ECE (eq. 7) of p with the bin accuracy replaced by the mean of p* (symmetrised, 1-p* on
      flipped rows);
    - ``truth/prob_mae``: avg|p - p*|;
    - ``truth/margin_coverage``: avg[m_lower <= true_margin <= m_upper] (inclusive: coverage of a closed interval).
    """
    n_bins = check_n_bins(n_bins)
    pairs = table_columns(predictions)
    return _truth(pairs.margins(), pairs.weight, true_margins(predictions), n_bins)
