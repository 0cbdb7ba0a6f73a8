"""Scoring a method on one dataset and turning the scores into the predictions file, metrics and diagrams."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from rewarduq_exp import distributed
from rewarduq_exp.data.contract import data_kind
from rewarduq_exp.errors import UserError
from rewarduq_exp.methods.base import FeatureHeadMethod, Scores
from rewarduq_exp.metrics import compute_metrics
from rewarduq_exp.metrics.kwise import is_kwise, kwise_metrics, kwise_to_pairs
from rewarduq_exp.metrics.reward_bench import check_scoring, is_reward_bench, reward_bench_metrics
from rewarduq_exp.run_folder import RunFolder

log = logging.getLogger(__name__)

# Columns of the data that travel into the predictions file when present (truth of the synthetic world).
PASSTHROUGH_COLUMNS = ("true_margin", "true_prob")


def predictions_frame(data: pd.DataFrame, chosen: Scores, rejected: Scores) -> pd.DataFrame:
    """The predictions-file contract: one row per pair (DESIGN section 3)."""
    frame = pd.DataFrame({
        "id": data["id"].astype(str).to_numpy(),
        "subset": data["subset"].astype(str).to_numpy(),
        "weight": data["weight"].astype(float).to_numpy(),
        "chosen_reward": chosen.reward, "chosen_lower": chosen.lower, "chosen_upper": chosen.upper,
        "rejected_reward": rejected.reward, "rejected_lower": rejected.lower, "rejected_upper": rejected.upper,
    })
    for col in PASSTHROUGH_COLUMNS:
        if col in data.columns:
            frame[col] = data[col].to_numpy()
    return frame


def score_predictions(predictions: pd.DataFrame, metric_cfg) -> dict:
    """Metrics of a predictions table; ``metric.scoring`` picks how (auto | pairs | reward_bench).

    K-wise tables (RewardBench 2) always get :func:`kwise_metrics`. ``auto`` uses RewardBench scoring when every
    subset is a RewardBench subset and plain :func:`compute_metrics` otherwise.
    """
    check_scoring(metric_cfg)
    scoring = metric_cfg.get("scoring", "auto")
    n_bins, alphas = int(metric_cfg.n_bins), tuple(metric_cfg.alphas)
    if is_kwise(predictions):
        if scoring == "reward_bench":
            raise UserError("metric.scoring=reward_bench needs a pairwise predictions table, got a K-wise one; "
                            "use metric.scoring=auto")
        return kwise_metrics(predictions, n_bins=n_bins, alphas=alphas)
    if scoring == "reward_bench" or (
            scoring == "auto" and "subset" in predictions.columns and is_reward_bench(predictions["subset"])):
        return reward_bench_metrics(predictions, n_bins=n_bins, alphas=alphas,
                                    weighting=metric_cfg.get("reward_bench_weighting", "official"))
    return compute_metrics(predictions, n_bins=n_bins, alphas=alphas)


def diagrams(predictions: pd.DataFrame, out_dir, metric_cfg, title: str) -> list:
    if not metric_cfg.get("diagrams", True):
        return []
    from rewarduq_exp.metrics.diagrams import plot_calibration_diagrams

    if is_kwise(predictions):  # the diagrams are pairwise: draw them for the best-vs-other pairs
        predictions = kwise_to_pairs(predictions)
    return plot_calibration_diagrams(predictions, out_dir, n_bins=int(metric_cfg.n_bins), title=title)


def kwise_predictions_frame(data: pd.DataFrame, scores: Scores) -> pd.DataFrame:
    """The K-wise predictions contract: one row per prompt with list columns (``scores`` holds all completions,
    prompt by prompt, in order)."""
    k = data["completions"].map(len).to_numpy()
    cut = np.cumsum(k)[:-1]
    return pd.DataFrame({
        "id": data["id"].astype(str).to_numpy(),
        "subset": data["subset"].astype(str).to_numpy(),
        "weight": data["weight"].astype(float).to_numpy(),
        "rewards": [list(v) for v in np.split(scores.reward, cut)],
        "lowers": [list(v) for v in np.split(scores.lower, cut)],
        "uppers": [list(v) for v in np.split(scores.upper, cut)],
        "best": data["best"].astype(int).to_numpy(),
    })


def score_method(method, data: pd.DataFrame) -> pd.DataFrame:
    """The predictions table of ``method`` on a pairwise or K-wise frame.

    Under torchrun / accelerate a method that runs its own model per row (ENS-LoRA, MCD-DPO) scores only this
    process's block of rows and the blocks are gathered, in order, on every process. Feature-head methods score
    every row on every process: their backbone work is already split inside the feature cache, and the heads take
    milliseconds.
    """
    if distributed.world_size() > 1 and not isinstance(method, FeatureHeadMethod):
        rows = distributed.shard_rows(len(data))
        block = _score_rows(method, data.iloc[rows]) if len(rows) else None  # fewer rows than processes
        return pd.concat([b for b in distributed.gather_to_all(block) if b is not None], ignore_index=True)
    return _score_rows(method, data)


def _score_rows(method, data: pd.DataFrame) -> pd.DataFrame:
    if data_kind(data) == "kwise":
        k = data["completions"].map(len).to_numpy()
        prompts = np.repeat(data["prompt"].to_numpy(), k)  # all K completions of all prompts in one scoring call
        completions = [c for cs in data["completions"] for c in cs]
        return kwise_predictions_frame(data, method.score(list(prompts), completions))
    chosen, rejected = method.score_pairs(data) if hasattr(method, "score_pairs") else (
        method.score(data["prompt"], data["chosen"]), method.score(data["prompt"], data["rejected"]))
    return predictions_frame(data, chosen, rejected)


def evaluate_method(method, data: pd.DataFrame, name: str, folder: RunFolder, metric_cfg) -> tuple[dict, list]:
    """Score ``data`` with ``method``; write predictions and diagrams into ``folder``; return (metrics, figures)."""
    predictions = score_method(method, data)
    folder.write_predictions(name, predictions)
    metrics = score_predictions(predictions, metric_cfg)
    # Diagrams are files of the run folder: only its writer (rank 0 under torchrun) draws them.
    figures = diagrams(predictions, folder.figures_dir(name), metric_cfg, title=name) if getattr(folder, "writer", True) else []
    return metrics, figures
