"""Which scoring a predictions table gets, and the table its reliability diagrams draw.

One place decides, so the metrics, the run's diagrams and the paper's Figure 3 agree: a K-wise table is scored as
RewardBench 2 and drawn for its (correct, incorrect) pairs; a RewardBench table is scored per category with the
subset weights, and drawn with the same row weights.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics.kwise import (
    TIES_SUBSET,
    chosen_only_ece,
    is_kwise,
    kwise_metrics,
    kwise_to_pairs,
    pairwise_calibration,
    top1_calibration,
)
from rewarduq_exp.metrics.reward_bench import (
    check_scoring,
    is_reward_bench,
    reward_bench_metrics,
    reward_bench_row_weights,
)
from rewarduq_exp.metrics.rewarduq import compute_metrics


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
        return kwise_to_pairs(with_point_bounds(predictions)), ""
    if kind == "reward_bench":
        table = predictions.assign(weight=reward_bench_row_weights(predictions, weighting))
        return table, f"RewardBench weighting ({weighting})"
    return predictions, ""


def with_point_bounds(predictions: pd.DataFrame) -> pd.DataFrame:
    """A K-wise table of rewards only (e.g. scores of another reward model: ``id``, ``rewards``, ``best``) gets
    zero-width bounds (lowers = uppers = rewards) and weight 1, so every metric applies; interval metrics then
    describe point predictions."""
    if "rewards" not in predictions.columns:
        return predictions
    fill = {c: predictions["rewards"] for c in ("lowers", "uppers") if c not in predictions.columns}
    if "weight" not in predictions.columns:
        fill["weight"] = 1.0
    return predictions.assign(**fill) if fill else predictions


def top1_rows(predictions: pd.DataFrame):
    """The K-wise rows that fit the top-1 formulation of the calibrated-label-ranking paper (appendix D): exactly one
    correct completion, outside the Ties subset (which the paper excludes); returns (rewards, best index)."""
    keep = pd.Series(True, index=predictions.index)
    if "num_correct" in predictions.columns:
        keep &= predictions["num_correct"].astype(float) == 1
    if "subset" in predictions.columns:
        keep &= predictions["subset"].astype(str).str.lower() != TIES_SUBSET
    rows = predictions[keep]
    return list(rows["rewards"].map(lambda r: [float(v) for v in r])), rows["best"].to_numpy(dtype=np.int64)


def kwise_ranking_metrics(predictions: pd.DataFrame, n_bins: int = 10) -> dict:
    """Ranking calibration of K-wise reward-model scores (calibrated-label-ranking paper, appendix D): the
    Plackett-Luce top-1 probabilities softmax(r) of every (context, position), pooled, in ``n_bins`` equal-width
    bins (``rank/top_1/ece``); the PL pairwise probabilities sigmoid(r_i - r_j) of the (correct, other) pairs
    (``rank/sub_2/ece``), the only sub-2 events observed when just the correct completion is known (top-k for
    k >= 2 is never observed in such data); and the reference code's number 1 - mean p_correct
    (``rank/top_1/chosen_only_ece``, for comparison with its figures only)."""
    rewards, best = top1_rows(predictions)
    if not rewards:
        return {}
    top1 = top1_calibration(rewards, best, n_bins=n_bins)
    return {"rank/top_1/ece": top1.ece, "rank/sub_2/ece": pairwise_calibration(rewards, best, n_bins=n_bins).ece,
            "rank/top_1/chosen_only_ece": chosen_only_ece(rewards, best), "rank/top_1/n_contexts": top1.n_contexts}


def ranking_bins(metric_cfg) -> int:
    return int((metric_cfg.get("ranking") or {}).get("n_bins", 10))


def score_predictions(predictions: pd.DataFrame, metric_cfg) -> dict:
    """Metrics of a predictions table; ``metric.scoring`` picks how (auto | pairs | reward_bench).

    K-wise tables (RewardBench 2) always get :func:`kwise_metrics` (``metric.kwise_tie_rule``: official | strict).
    ``auto`` uses RewardBench scoring when every subset is a RewardBench subset and plain :func:`compute_metrics`
    otherwise (:func:`~rewarduq_exp.metrics.scoring.scoring_kind`).
    """
    check_scoring(metric_cfg)
    predictions = with_point_bounds(predictions)
    scoring = metric_cfg.get("scoring", "auto")
    n_bins, alphas = int(metric_cfg.n_bins), tuple(metric_cfg.alphas)
    kind = scoring_kind(predictions, scoring)
    if kind == "kwise":
        if scoring == "reward_bench":
            raise UserError("metric.scoring=reward_bench needs a pairwise predictions table, got a K-wise one; "
                            "use metric.scoring=auto")
        out = kwise_metrics(predictions, n_bins=n_bins, alphas=alphas,
                            tie_rule=metric_cfg.get("kwise_tie_rule", "official"))
        out.update(kwise_ranking_metrics(predictions, ranking_bins(metric_cfg)))
        return out
    if kind == "reward_bench":
        return reward_bench_metrics(predictions, n_bins=n_bins, alphas=alphas,
                                    weighting=metric_cfg.get("reward_bench_weighting", "official"))
    return compute_metrics(predictions, n_bins=n_bins, alphas=alphas)
