"""A label-ranking run (``dataset=label_ranking/<name> method=<learner>``), the calibrated-label-ranking paper's
protocol: k-fold cross-validation (``dataset.folds``, default 5, rows shuffled with the run's seed), one learner
fitted per training fold (a fresh per-fold preprocessing fitted on that fold only), its predicted ranking
distributions scored on the held-out fold with every ``rank/...`` metric, then the mean and standard deviation
over folds.

The run folder is the usual one: ``metrics.json`` holds ``{<dataset>: {metric: mean, "<metric>_std": std}}``,
``metrics_per_fold.json`` the fold values, ``predictions/<dataset>.parquet`` one row per sample (fold, true and
modal ranks, top-1 probabilities), ``figures/<dataset>/`` the ECE-by-k and top-1 reliability plots, ``model/fold_<i>/``
the fitted learner of each fold (saved by the learner itself: method.json + safetensors, never a pickle).
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.model_selection import KFold
from tqdm.auto import tqdm

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.registry import build
from rewarduq_exp.metrics.ranking import ranking_evaluation
from rewarduq_exp.runner.run_output import RunOutput
from rewarduq_exp.runs.run_folder import RunFolder, write_json

log = logging.getLogger("rewarduq_exp")

# Keys of metric.ranking that are arguments of ranking_evaluation (the rest are for K-wise data).
EVALUATION_KEYS = ("n_bins", "discrepancy", "spacing", "aggregate", "max_k", "full_rank", "full_rank_estimator",
                   "kernel_h", "kernel_p", "max_subsets", "events", "kernel_max_samples", "restrict")


def ranking_options(metric_cfg) -> dict:
    ranking = metric_cfg.get("ranking") or {}
    return {k: ranking[k] for k in EVALUATION_KEYS if k in ranking}


def validate_ranking_options(metric_cfg) -> None:
    """Checks that need no data: a tiny well-formed case through the same code, so a bad option fails at once."""
    from rewarduq_exp.ranking.distribution import ExplicitDistribution
    from rewarduq_exp.ranking.permutations import all_orderings, orderings_to_ranks

    orderings = all_orderings(3)
    dist = ExplicitDistribution(orderings, np.full((6, 6), 1 / 6))
    try:
        ranking_evaluation(dist, orderings_to_ranks(orderings), **ranking_options(metric_cfg))
    except UserError as err:
        raise UserError(f"metric.ranking: {err}") from None


def mean_and_std(per_fold: list[dict]) -> dict:
    """Mean over folds of every metric, and its standard deviation (ddof=1) as ``<metric>_std``."""
    keys = list(dict.fromkeys(k for fold in per_fold for k in fold))
    out: dict = {}
    for key in keys:
        values = np.array([fold.get(key, np.nan) for fold in per_fold], dtype=float)
        out[key] = float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")
        if not key.endswith(("n_events", "n_subsets", "n_classes", "n_rankings", "n_samples")):
            out[f"{key}_std"] = float(np.nanstd(values, ddof=1)) if np.isfinite(values).sum() > 1 else float("nan")
    out["n_folds"] = len(per_fold)
    return out


class LabelRankingTask:
    """``dataset=label_ranking/<name> method=<learner>``: preparing it checks the ranking metric options, constructs
    the learner once (its settings) and the data source; :meth:`run` cross-validates a fresh copy of that unfitted
    learner per fold."""

    def __init__(self, cfg, out: Path, folder: RunFolder):
        self.cfg, self.out, self.folder = cfg, out, folder
        validate_ranking_options(cfg.metric)
        self.learner = build(cfg.method, "method")
        self.source = build(cfg.dataset, "dataset")

    def run(self) -> RunOutput:
        return run_label_ranking(self.cfg, self.out, self.folder, self.learner, self.source,
                                 show_progress=bool(self.cfg.progress))


def run_label_ranking(cfg, out: Path, folder: RunFolder, learner, source, show_progress: bool) -> RunOutput:
    """Cross-validate the unfitted ``learner`` on ``source``'s data: metrics, predictions, figures, fold models."""
    data = source.load()
    name = str(cfg.dataset.name)
    log.info("label ranking %s: %d rows, %d features, m=%d items, %d-fold cross-validation", name, data.n,
             data.X.shape[1], data.m, source.folds)
    options = ranking_options(cfg.metric)
    seed = int(cfg.seed)
    folds = KFold(n_splits=source.folds, shuffle=True, random_state=seed)
    per_fold, frames, times = [], [], []
    skipped_logged: set[str] = set()
    top1_pooled = []
    for i, (train_idx, test_idx) in enumerate(tqdm(list(folds.split(data.X)), desc=f"{name} folds", unit="fold",
                                                   disable=not show_progress, leave=False)):
        t0 = time.perf_counter()
        x_train, x_test = data.fold(train_idx, test_idx)
        fold_learner = copy.deepcopy(learner).fit(x_train, data.ranks[train_idx])
        t_fit = time.perf_counter() - t0
        dist = fold_learner.predict_distribution(x_test)
        evaluation = ranking_evaluation(dist, data.ranks[test_idx], seed=seed, **options)
        per_fold.append(evaluation.metrics)
        for key, reason in evaluation.skipped.items():  # each left-out metric once per run, with its reason
            if key not in skipped_logged:
                skipped_logged.add(key)
                log.info("%s: %s not computed: %s", name, key, reason)
        times.append((round(t_fit, 3), round(time.perf_counter() - t0, 3)))
        top1 = dist.top_k(np.arange(data.m)[:, None]) if dist.max_top_k >= 1 else None
        frames.append(pd.DataFrame({
            "fold": i, "row": test_idx,
            "true_ranks": list(data.ranks[test_idx]),
            "predicted_ranks": list(dist.mode_ranks()),
            **({"top1_probabilities": list(top1)} if top1 is not None else {}),
        }))
        if top1 is not None:
            top1_pooled.append((top1, data.ranks[test_idx] == 1))
        if folder.writer:
            fold_learner.save(folder.model_dir / f"fold_{i}")
        log.info("fold %d/%d: kendall tau %.4f, sub-2 ECE %.4f (%.1f s)", i + 1, source.folds,
                 evaluation.metrics["rank/kendall_tau"], evaluation.metrics.get("rank/sub_2/ece", float("nan")),
                 times[-1][1])
    block = mean_and_std(per_fold)
    block["n_samples"] = data.n
    block["n_items"] = data.m
    pngs = []
    if folder.writer:
        write_json(out / "metrics_per_fold.json", per_fold)
        folder.write_predictions(name, pd.concat(frames, ignore_index=True))
        if cfg.metric.get("diagrams", True):
            from rewarduq_exp.metrics.ranking_diagrams import plot_ece_by_k, plot_top1_reliability

            figures = folder.figures_dir(name)
            pngs.append(plot_ece_by_k(per_fold, figures / "ece_by_k.png", title=f"{name}: {learner.name}"))
            if top1_pooled:
                probs = np.concatenate([p for p, _ in top1_pooled]).ravel()
                labels = np.concatenate([y for _, y in top1_pooled]).ravel()
                pngs.append(plot_top1_reliability(probs, labels, figures / "top1_reliability.png",
                                                  n_bins=int(options.get("n_bins", 10)),
                                                  title=f"{name}: top-1 events, all folds pooled"))
    info = {"folds": source.folds, "seconds_fit_per_fold": [t[0] for t in times],
            "seconds_per_fold": [t[1] for t in times], "learner": learner.name}
    return RunOutput({name: block}, info, figures={name: pngs})
