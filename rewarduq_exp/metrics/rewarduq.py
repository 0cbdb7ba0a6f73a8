"""All RewardUQ metrics of one predictions table (paper eqs. 4-8, appendix A): the ``metric=rewarduq`` suite."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from rewarduq_exp.metrics.calibration import _calibration
from rewarduq_exp.metrics.preference import (
    DEFAULT_ALPHAS,
    check_alphas,
    check_n_bins,
    pair_accuracy,
    pair_bound_width,
    table_columns,
)
from rewarduq_exp.metrics.truth import TRUTH_COLUMN, _truth, true_margins

# Core flat metric names with the default alphas, in reporting order.
METRIC_NAMES = (
    "win_rate",
    "ct_rate",
    "ut_rate",
    "cf_rate",
    "uf_rate",
    "rs_0.0",
    "rs_0.2",
    "rs_1.0",
    "ece",
    "mce",
    "elce",
    "euce",
    "ebce",
    "brier",
)


def compute_metrics(
    predictions: pd.DataFrame, *, n_bins: int = 20, alphas: Iterable[float] = DEFAULT_ALPHAS
) -> dict[str, float]:
    """All metrics of a predictions table as plain Python numbers, keyed by flat lower-case names.

    Win rate (eq. 4), confidence rates (eq. 5), ranking scores ``rs_<alpha>`` (eq. 6), ECE/MCE (eq. 7),
    ELCE/EUCE/EBCE (eq. 8), Brier, ``bound_width`` (mean upper - lower over the 2N responses),
    ``pref_bound_width`` (mean p_hi - p_lo), ``n_pairs`` (row count, int) and ``weight_sum``; plus ``truth/*``
    (see :func:`truth_metrics`) when the table has a ``true_margin`` column. Everything except ``n_pairs`` and
    ``weight_sum`` is a ``weight``-weighted average, so weight w equals repeating the pair w times.
    """
    n_bins = check_n_bins(n_bins)
    alphas = check_alphas(alphas)
    # Columns, not (N, 3) arrays: views of the table, validated in one pass each, and every quantity that several
    # metrics share (the probabilities, their bins, the symmetrised rows) computed once, in place where it can be.
    pairs = table_columns(predictions)
    w = pairs.weight
    out: dict[str, float] = {}
    out.update(pair_accuracy(pairs, alphas))
    out.update(_calibration(*pairs.probabilities(), None, w, n_bins))
    out["bound_width"] = pair_bound_width(pairs)
    out["pref_bound_width"] = out.pop("pref_bound_width")
    out["n_pairs"] = len(predictions)
    out["weight_sum"] = float(w.sum())
    if TRUTH_COLUMN in predictions.columns:
        out.update(_truth(pairs.margins(), w, true_margins(predictions), n_bins))
    return out
