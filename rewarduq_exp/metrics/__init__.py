"""Evaluation metrics of the RewardUQ paper (eqs. 4-8) computed from a predictions table.

``compute_metrics`` (module ``rewarduq``) is the entry point; the other submodules hold the pieces: ``preference``
(win rate, confidence rates, ranking scores), ``calibration`` (ECE, ELCE/EUCE/EBCE, Brier), ``truth`` (against the
synthetic true margin), ``diagrams`` (reliability diagrams; matplotlib is imported only when one is drawn), ``kwise``
(K-wise sets: RewardBench 2 and the top-1 calibration of appendix D), ``ranking`` (calibration of ranking
distributions) and ``probe`` (BoRP's regression metrics). Submodules import each other, never this file.
"""

from __future__ import annotations

from rewarduq_exp.metrics.calibration import CalibrationCurve, calibration_curves, calibration_metrics
from rewarduq_exp.metrics.diagrams import plot_calibration_diagrams
from rewarduq_exp.metrics.preference import (
    REQUIRED_COLUMNS,
    accuracy_metrics,
    check_alphas,
    check_n_bins,
    pairs_from_table,
    preference_probabilities,
    ranking_score,
)
from rewarduq_exp.metrics.rewarduq import METRIC_NAMES, compute_metrics
from rewarduq_exp.metrics.truth import truth_metrics

__all__ = [
    "check_alphas",
    "check_n_bins",
    "METRIC_NAMES",
    "REQUIRED_COLUMNS",
    "CalibrationCurve",
    "accuracy_metrics",
    "calibration_curves",
    "calibration_metrics",
    "compute_metrics",
    "pairs_from_table",
    "plot_calibration_diagrams",
    "preference_probabilities",
    "ranking_score",
    "truth_metrics",
]
