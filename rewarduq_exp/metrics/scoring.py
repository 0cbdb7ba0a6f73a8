"""Which scoring a predictions table gets, and the table its reliability diagrams draw.

One place decides, so the metrics, the run's diagrams and the paper's Figure 3 agree: a K-wise table is scored as
RewardBench 2 and drawn for its (correct, incorrect) pairs; a RewardBench table is scored per category with the
subset weights, and drawn with the same row weights.
"""

from __future__ import annotations

import pandas as pd

from rewarduq_exp.errors import UserError
from rewarduq_exp.metrics import compute_metrics
from rewarduq_exp.metrics.kwise import is_kwise, kwise_metrics, kwise_to_pairs
from rewarduq_exp.metrics.reward_bench import (
    check_scoring,
    is_reward_bench,
    reward_bench_metrics,
    reward_bench_row_weights,
)


def scoring_kind(predictions: pd.DataFrame, scoring: str = "auto") -> str:
    """How a predictions table is scored: ``kwise`` (RewardBench 2 style), ``reward_bench`` (per-category, with the
    RewardBench subset weights) or ``pairs``; ``scoring`` is ``metric.scoring`` (auto | pairs | reward_bench)."""
    if is_kwise(predictions):
        return "kwise"
    if scoring == "reward_bench" or (
            scoring == "auto" and "subset" in predictions.columns and is_reward_bench(predictions["subset"])):
        return "reward_bench"
    return "pairs"


def diagram_table(predictions: pd.DataFrame, scoring: str = "auto", weighting: str = "official"
                  ) -> tuple[pd.DataFrame, str]:
    """The pairwise table a reliability diagram draws, and a note on how it is weighted.

    K-wise tables are drawn for their (correct, incorrect) pairs; RewardBench rows are weighted as in its metrics
    (:func:`reward_bench_row_weights`: each category sums to 1), so a diagram shows the calibration its metrics
    report and not the raw row mix (math-prm alone would be 15% of the rows).
    """
    kind = scoring_kind(predictions, scoring)
    if kind == "kwise":
        return kwise_to_pairs(predictions), ""
    if kind == "reward_bench":
        table = predictions.assign(weight=reward_bench_row_weights(predictions, weighting))
        return table, f"RewardBench weighting ({weighting})"
    return predictions, ""


def score_predictions(predictions: pd.DataFrame, metric_cfg) -> dict:
    """Metrics of a predictions table; ``metric.scoring`` picks how (auto | pairs | reward_bench).

    K-wise tables (RewardBench 2) always get :func:`kwise_metrics` (``metric.kwise_tie_rule``: official | strict).
    ``auto`` uses RewardBench scoring when every subset is a RewardBench subset and plain :func:`compute_metrics`
    otherwise (:func:`~rewarduq_exp.metrics.scoring.scoring_kind`).
    """
    check_scoring(metric_cfg)
    scoring = metric_cfg.get("scoring", "auto")
    n_bins, alphas = int(metric_cfg.n_bins), tuple(metric_cfg.alphas)
    kind = scoring_kind(predictions, scoring)
    if kind == "kwise":
        if scoring == "reward_bench":
            raise UserError("metric.scoring=reward_bench needs a pairwise predictions table, got a K-wise one; "
                            "use metric.scoring=auto")
        return kwise_metrics(predictions, n_bins=n_bins, alphas=alphas,
                             tie_rule=metric_cfg.get("kwise_tie_rule", "official"))
    if kind == "reward_bench":
        return reward_bench_metrics(predictions, n_bins=n_bins, alphas=alphas,
                                    weighting=metric_cfg.get("reward_bench_weighting", "official"))
    return compute_metrics(predictions, n_bins=n_bins, alphas=alphas)
