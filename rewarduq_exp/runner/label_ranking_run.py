"""A label-ranking run (``dataset=label_ranking/<name> method=<learner>``), the calibrated-label-ranking paper's
protocol: k-fold cross-validation (``dataset.folds``, default 5, rows shuffled with the run's seed), one learner
fitted per training fold (a fresh per-fold preprocessing fitted on that fold only), its predicted ranking
distributions scored on the held-out fold with every ``rank/...`` metric, then the mean and standard deviation
over folds.

The run folder is the usual one: ``metrics.json`` holds ``{<dataset>: {metric: mean, "<metric>_std": std}}``,
``metrics_per_fold.json`` the fold values, ``predictions/<dataset>.parquet`` one row per sample (fold, true and
modal ranks, top-1 probabilities), ``figures/<dataset>/`` the ECE-by-k and top-1 reliability plots, ``model/fold_<i>/``
the fitted learner of each fold (saved by the learner itself: method.json + safetensors, never a pickle).

Recalibration (``metric.ranking.recalibrate``, default true in the shipped metric config; off when the key is absent):
inside each training fold a seeded random ``metric.ranking.cal_fraction`` (default 0.2) of the rows is held out as a
calibration share (random, not the tail of the sorted indices: several CSVs are sorted by class), the learner fits
on the rest, and one temperature T of its predicted distribution (``RankingDistribution.temper``: PL and PL-RPC
log-weights / T, RankClassifier logits / T, Mallows theta / T, RPC pairwise logits / T) is fitted on the share by
maximum likelihood (:func:`~rewarduq_exp.methods.label_ranking.fit_distribution_temperature`). Every metric is then
computed on the test fold twice: ``rank/...`` for the learner as trained (raw) and ``recal/rank/...`` for the
tempered distribution, with ``recal/temperature`` and the calibration share's mean negative log-likelihood before and
after (``recal/cal_nll_raw``, ``recal/cal_nll``). Tempering never moves the modal ranking, so Kendall tau, footrule
and top-1 accuracy are the same in both. With recalibration on, the raw learner trains on 80 % of each training
fold; with it off the run is the protocol above, unchanged.
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
                   "kernel_h", "kernel_p", "max_subsets", "events", "kernel_max_samples", "restrict", "divergences")
# Keys of metric.ranking that set the per-fold recalibration of label-ranking runs.
RECALIBRATION_KEYS = ("recalibrate", "cal_fraction")
DEFAULT_CAL_FRACTION = 0.2


def ranking_options(metric_cfg) -> dict:
    ranking = metric_cfg.get("ranking") or {}
    return {k: ranking[k] for k in EVALUATION_KEYS if k in ranking}


def recalibration_options(metric_cfg) -> float | None:
    """The calibration share of each training fold, or None when recalibration is off (``metric.ranking.recalibrate``
    false or absent). One-line UserErrors for a non-boolean switch or a fraction outside (0, 1)."""
    ranking = metric_cfg.get("ranking") or {}
    enabled = ranking.get("recalibrate", False)
    if not isinstance(enabled, bool):
        raise UserError(f"metric.ranking.recalibrate={enabled!r} is invalid: true or false")
    fraction = ranking.get("cal_fraction", DEFAULT_CAL_FRACTION)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise UserError(f"metric.ranking.cal_fraction={fraction!r} is invalid: a fraction in (0, 1), e.g. 0.2")
    return float(fraction) if enabled else None


def calibration_split(train_idx: np.ndarray, fraction: float, seed: int, fold: int) -> tuple[np.ndarray, np.ndarray]:
    """(fit rows, calibration rows) of a training fold: a seeded random ``fraction`` of it (``default_rng((seed,
    fold, 1))``), both sorted; a one-line UserError when either part would have fewer than 2 rows."""
    train_idx = np.asarray(train_idx)
    n_cal = int(round(fraction * len(train_idx)))
    if n_cal < 2 or len(train_idx) - n_cal < 2:
        raise UserError(f"metric.ranking.cal_fraction={fraction} leaves {n_cal} calibration and "
                        f"{len(train_idx) - n_cal} training rows of a {len(train_idx)}-row training fold: each needs "
                        "at least 2 (use more data, another fraction, or metric.ranking.recalibrate=false)")
    perm = np.random.default_rng((seed, fold, 1)).permutation(len(train_idx))
    return np.sort(train_idx[perm[n_cal:]]), np.sort(train_idx[perm[:n_cal]])


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
    recalibration_options(metric_cfg)


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
    from rewarduq_exp.methods.label_ranking.temperature import fit_distribution_temperature

    data = source.load()
    folder.stage = "running"   # the settings and the data they name are good: from here a failure is the run's
    name = str(cfg.dataset.name)
    log.info("label ranking %s: %d rows, %d features, m=%d items, %d-fold cross-validation", name, data.n,
             data.X.shape[1], data.m, source.folds)
    options = ranking_options(cfg.metric)
    cal_fraction = recalibration_options(cfg.metric)
    seed = int(cfg.seed)
    folds = KFold(n_splits=source.folds, shuffle=True, random_state=seed)
    per_fold, frames, times, temperatures = [], [], [], []
    skipped_logged: set[str] = set()
    top1_pooled = []
    for i, (train_idx, test_idx) in enumerate(tqdm(list(folds.split(data.X)), desc=f"{name} folds", unit="fold",
                                                   disable=not show_progress, leave=False)):
        t0 = time.perf_counter()
        if cal_fraction is None:
            fit_idx, cal_idx = train_idx, train_idx[:0]
            x_train, x_test = data.fold(train_idx, test_idx)
        else:  # the preprocessing, like the learner, sees the fit rows only
            fit_idx, cal_idx = calibration_split(train_idx, cal_fraction, seed, i)
            x_train, x_rest = data.fold(fit_idx, np.concatenate([cal_idx, test_idx]))
            x_cal, x_test = x_rest[: len(cal_idx)], x_rest[len(cal_idx):]
        fold_learner = copy.deepcopy(learner).fit(x_train, data.ranks[fit_idx])
        t_fit = time.perf_counter() - t0
        dist = fold_learner.predict_distribution(x_test)
        evaluation = ranking_evaluation(dist, data.ranks[test_idx], seed=seed, **options)
        metrics = dict(evaluation.metrics)
        recal = None
        if cal_fraction is not None:
            fit = fit_distribution_temperature(fold_learner.predict_distribution(x_cal), data.ranks[cal_idx])
            recal = dist.temper(fit.temperature)
            recal_eval = ranking_evaluation(recal, data.ranks[test_idx], seed=seed, **options)
            metrics.update({f"recal/{key}": value for key, value in recal_eval.metrics.items()})
            metrics.update({"recal/temperature": fit.temperature, "recal/cal_nll_raw": fit.nll_before,
                            "recal/cal_nll": fit.nll_after})
            temperatures.append({"fold": i, "temperature": fit.temperature, "calibration_rows": int(len(cal_idx)),
                                 "cal_nll_raw": fit.nll_before, "cal_nll": fit.nll_after,
                                 "at_bound": fit.at_bound})
            if fit.at_bound:
                log.warning("fold %d: the temperature %.4g is at a bound of its search range; the likelihood may "
                            "want it further out", i + 1, fit.temperature)
        per_fold.append(metrics)
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
            **({"recal_top1_probabilities": list(recal.top_k(np.arange(data.m)[:, None]))}
               if top1 is not None and recal is not None else {}),
        }))
        if top1 is not None:
            top1_pooled.append((top1, data.ranks[test_idx] == 1))
        if folder.writer:
            fold_learner.save(folder.model_dir / f"fold_{i}")
        recal_note = "" if recal is None else (f"; T {metrics['recal/temperature']:.3f}, recalibrated sub-2 ECE "
                                               f"{metrics.get('recal/rank/sub_2/ece', float('nan')):.4f}")
        log.info("fold %d/%d: kendall tau %.4f, sub-2 ECE %.4f%s (%.1f s)", i + 1, source.folds,
                 metrics["rank/kendall_tau"], metrics.get("rank/sub_2/ece", float("nan")), recal_note, times[-1][1])
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
            if cal_fraction is not None:
                tempered = [{key[len("recal/"):]: v for key, v in fold.items() if key.startswith("recal/rank/")}
                            for fold in per_fold]
                pngs.append(plot_ece_by_k(tempered, figures / "ece_by_k_recalibrated.png",
                                          title=f"{name}: {learner.name}, temperature-scaled"))
            if top1_pooled:
                probs = np.concatenate([p for p, _ in top1_pooled]).ravel()
                labels = np.concatenate([y for _, y in top1_pooled]).ravel()
                pngs.append(plot_top1_reliability(probs, labels, figures / "top1_reliability.png",
                                                  n_bins=int(options.get("n_bins", 10)),
                                                  title=f"{name}: top-1 events, all folds pooled"))
    info = {"folds": source.folds, "seconds_fit_per_fold": [t[0] for t in times],
            "seconds_per_fold": [t[1] for t in times], "learner": learner.name}
    if cal_fraction is not None:
        info["recalibration"] = {"cal_fraction": cal_fraction, "folds": temperatures}
    return RunOutput({name: block}, info, figures={name: pngs})
