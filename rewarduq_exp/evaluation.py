"""Scoring a method on one dataset and turning the scores into the predictions file, metrics and diagrams."""

from __future__ import annotations

import logging

import pandas as pd

from rewarduq_exp.metrics import compute_metrics
from rewarduq_exp.methods.base import Scores
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
    return compute_metrics(predictions, n_bins=int(metric_cfg.n_bins), alphas=tuple(metric_cfg.alphas))


def diagrams(predictions: pd.DataFrame, out_dir, metric_cfg, title: str) -> list:
    if not metric_cfg.get("diagrams", True):
        return []
    from rewarduq_exp.metrics.diagrams import plot_calibration_diagrams

    return plot_calibration_diagrams(predictions, out_dir, n_bins=int(metric_cfg.n_bins), title=title)


def evaluate_method(method, data: pd.DataFrame, name: str, folder: RunFolder, metric_cfg) -> tuple[dict, list]:
    """Score ``data`` with ``method``; write predictions and diagrams into ``folder``; return (metrics, figures)."""
    chosen, rejected = method.score_pairs(data) if hasattr(method, "score_pairs") else (
        method.score(data["prompt"], data["chosen"]), method.score(data["prompt"], data["rejected"]))
    predictions = predictions_frame(data, chosen, rejected)
    folder.write_predictions(name, predictions)
    metrics = score_predictions(predictions, metric_cfg)
    figures = diagrams(predictions, folder.figures_dir(name), metric_cfg, title=name)
    return metrics, figures
