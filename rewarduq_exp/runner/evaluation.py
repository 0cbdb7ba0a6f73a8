"""Scoring a method on one dataset and turning the scores into the predictions file, metrics and diagrams.

The diagrams of an evaluated dataset can be left for later (``later``): a run writes its metrics.json and prints its
summary first, and draws them after (matplotlib is imported then, not before).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from rewarduq_exp.core import distributed
from rewarduq_exp.data.contract import data_kind
from rewarduq_exp.methods.base import Scores
from rewarduq_exp.metrics.kwise import is_kwise
from rewarduq_exp.metrics.scoring import (  # noqa: F401 (score_predictions: API)
    diagram_table,
    ranking_bins,
    score_predictions,
    top1_rows,
)
from rewarduq_exp.runs.run_folder import RunFolder

log = logging.getLogger(__name__)

# Columns of the data that travel into the predictions file when present (truth of the synthetic world).
PASSTHROUGH_COLUMNS = ("true_margin", "true_prob")

# The figures of one evaluated dataset, drawn when called; it returns their files.
Drawing = Callable[[], list[Path]]


def drawn(draw: Drawing, later: list[Drawing] | None) -> list[Path]:
    """The files of ``draw`` drawn now, or none yet with ``draw`` appended to ``later``."""
    if later is None:
        return draw()
    later.append(draw)
    return []


def predictions_frame(data: pd.DataFrame, chosen: Scores, rejected: Scores) -> pd.DataFrame:
    """The predictions-file contract: one row per pair."""
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


def diagrams(predictions: pd.DataFrame, out_dir, metric_cfg, title: str, metrics: dict | None = None) -> list:
    """Reliability diagrams of a predictions table, weighted as its metrics are (RewardBench: subset weights); the
    headings print ``metrics`` (the dataset's metrics.json block) when given."""
    if not metric_cfg.get("diagrams", True):
        return []
    from rewarduq_exp.metrics.diagrams import plot_calibration_diagrams

    table, note = diagram_table(predictions, metric_cfg.get("scoring", "auto"),
                                metric_cfg.get("reward_bench_weighting", "official"))
    paths = plot_calibration_diagrams(table, out_dir, n_bins=int(metric_cfg.n_bins),
                                      title=f"{title}: {note}" if note else title, reported=metrics)
    if is_kwise(predictions):  # top-1 calibration of the K-wise scores (calibrated-label-ranking paper, appendix D)
        from rewarduq_exp.metrics.kwise import plackett_luce_top1
        from rewarduq_exp.metrics.ranking_diagrams import plot_top1_reliability

        rewards, best = top1_rows(predictions)
        if rewards:
            probs = plackett_luce_top1(rewards)
            labels = np.zeros_like(probs)
            labels[np.arange(len(best)), best] = 1.0
            valid = ~np.isnan(probs)
            paths.append(plot_top1_reliability(
                probs[valid], labels[valid], Path(out_dir) / "top1_reliability.png", n_bins=ranking_bins(metric_cfg),
                title=f"{title}: Plackett-Luce top-1 of the K rewards",
                ece=(metrics or {}).get("rank/top_1/ece")))
    return paths


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
        "num_correct": (data["num_correct"].astype(int).to_numpy() if "num_correct" in data.columns
                        else np.ones(len(data), dtype=int)),
    })


def score_method(method, data: pd.DataFrame) -> pd.DataFrame:
    """The predictions table of ``method`` on a pairwise or K-wise frame.

    Under torchrun / accelerate a method that runs its own model per row (ENS-LoRA, MCD-DPO) scores only this
    process's block of rows and the blocks are gathered, in order, on every process. Feature-head methods score
    every row on every process: their backbone work is already split inside the feature cache, and the heads take
    milliseconds.
    """
    if distributed.world_size() > 1 and not method.uses_feature_cache:
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
    chosen, rejected = method.score_pairs(data)
    return predictions_frame(data, chosen, rejected)


def calibration_predictions(method, data: pd.DataFrame) -> pd.DataFrame:
    """The table a recalibration is fitted on: the predictions table of a pairwise calibration split, or for rated
    responses their ratings (``score``) beside the method's ``prediction``, ``lower`` and ``upper``."""
    if data_kind(data) != "pointwise":
        return score_method(method, data)
    scores = method.score(list(data["prompt"]), list(data["response"]))
    return pd.DataFrame({"id": data["id"].astype(str).to_numpy(), "score": data["score"].to_numpy(dtype=float),
                         "prediction": scores.reward, "lower": scores.lower, "upper": scores.upper})


def completion_chars(completions) -> np.ndarray:
    """Characters of each completion's message contents (a completion is a list of messages)."""
    return np.array([sum(len(str(m["content"])) for m in c) for c in completions], dtype=float)


def longer_wins_metrics(data: pd.DataFrame, predictions: pd.DataFrame, metric_cfg) -> dict:
    """``baseline/longer_wins/win_rate`` of a pairwise eval set (:func:`~rewarduq_exp.metrics.preference.
    longer_wins_rate`, ties 0.5), weighted as the model's ``win_rate`` is: the pairs' ``weight``, or under RewardBench
    scoring its row weights (each category sums to 1, so the weighted mean is the mean over categories, as the
    official win rate). Nothing for K-wise data."""
    from rewarduq_exp.metrics.preference import longer_wins_rate
    from rewarduq_exp.metrics.scoring import scoring_kind

    if data_kind(data) != "pairs" or not {"chosen", "rejected"} <= set(data.columns):
        return {}
    weight = data["weight"].to_numpy(dtype=float)
    if scoring_kind(predictions, metric_cfg.get("scoring", "auto")) == "reward_bench":
        from rewarduq_exp.metrics.reward_bench import reward_bench_row_weights

        weight = reward_bench_row_weights(predictions, metric_cfg.get("reward_bench_weighting", "official"))
    rate = longer_wins_rate(completion_chars(data["chosen"]), completion_chars(data["rejected"]), weight)
    return {"baseline/longer_wins/win_rate": rate}


def evaluate_method(method, data: pd.DataFrame, name: str, folder: RunFolder, metric_cfg,
                    calibration=None, *, later: list[Drawing] | None = None, also=None) -> tuple[dict, list]:
    """Score ``data`` with ``method``; write predictions and diagrams into ``folder``; return (metrics, figures).
    Pairwise sets also get the win rate of "the longer completion wins" (:func:`longer_wins_metrics`). With the run's
    ``calibration`` (:class:`~rewarduq_exp.recalibration.Calibration`) every metric is also reported after it as
    ``recal/<metric>``, and the diagrams are drawn again in ``figures/<name>/recalibrated/``; the predictions file
    keeps the raw scores. ``also``: the same calibration with another interval scale (evaluate.py's
    ``recalibrate_interval``), whose metrics go beside the run's own as ``recal@<interval>/<metric>``. With
    ``later`` (a list) the diagrams are not drawn here: their :data:`Drawing` is appended to it, and the figures
    returned are none."""
    predictions = score_method(method, data)
    folder.write_predictions(name, predictions)
    metrics = score_predictions(predictions, metric_cfg)
    metrics.update(longer_wins_metrics(data, predictions, metric_cfg))
    if calibration is not None:
        from rewarduq_exp.recalibration import recalibrated_metrics
        from rewarduq_exp.recalibration.fit import interval_prefix

        metrics.update(recalibrated_metrics(predictions, calibration, metric_cfg))
        if also is not None:
            metrics.update(recalibrated_metrics(predictions, also, metric_cfg, interval_prefix(also.interval)))
    # Diagrams are files of the run folder: only its writer (rank 0 under torchrun) draws them.
    if not getattr(folder, "writer", True):
        return metrics, []
    return metrics, drawn(functools.partial(method_diagrams, predictions, name, folder, metric_cfg, calibration,
                                            metrics), later)


def method_diagrams(predictions: pd.DataFrame, name: str, folder: RunFolder, metric_cfg, calibration,
                    metrics: dict) -> list[Path]:
    """The diagrams of :func:`evaluate_method`: the raw predictions', and with ``calibration`` the recalibrated
    ones' in ``figures/<name>/recalibrated/``; their files."""
    figures = diagrams(predictions, folder.figures_dir(name), metric_cfg, title=name, metrics=metrics)
    if calibration is not None and figures:
        after = {k.removeprefix("recal/"): v for k, v in metrics.items() if k.startswith("recal/")}
        figures += diagrams(calibration.apply_predictions(predictions), folder.figures_dir(name) / "recalibrated",
                            metric_cfg, title=f"{name}, recalibrated (T={calibration.temperature:.3g}, "
                            f"s={calibration.scale:.3g})", metrics=after)
    return figures


# The column of pointwise data with the standard deviation of the human ratings behind each score, where known.
RATER_STD = "rater_std"
# Agreement metrics of a baseline that are undefined when it answers one value for every text (a judge that always
# says "3"): a correlation with a constant does not exist. They are left out of that baseline's metrics and
# ``probe/baseline/<name>/constant`` (true) says why; it is false for a baseline whose answers vary.
UNDEFINED_FOR_CONSTANT = ("alpha_interval", "alpha_ordinal", "pearson", "spearman")


def baseline_metrics(name: str, baseline: str, y: np.ndarray, values, score_range: tuple) -> dict:
    """``probe/baseline/<baseline>/...`` metrics of one baseline's predictions ``values`` against the ratings ``y``
    on dataset ``name``, with ``constant`` (bool): when every prediction is the same value, the agreement metrics of
    :data:`UNDEFINED_FOR_CONSTANT` are absent (not NaN) and one log line says so."""
    from rewarduq_exp.metrics.probe import probe_metrics

    values = np.asarray(values, dtype=float)
    found = probe_metrics(y, values, score_range=score_range)  # checks shapes and finiteness first
    constant = bool(np.ptp(values) == 0)
    if constant:
        for key in UNDEFINED_FOR_CONSTANT:
            found.pop(f"probe/{key}", None)
        log.warning("%s: the %s baseline answered %g for all %d texts (constant): its %s are undefined and not "
                    "reported; probe/baseline/%s/constant is true", name, baseline, float(values[0]), len(values),
                    ", ".join(UNDEFINED_FOR_CONSTANT), baseline)
    found["probe/constant"] = constant
    return {f"probe/baseline/{baseline}/{k.removeprefix('probe/')}": v for k, v in found.items()}


def evaluate_pointwise(method, data: pd.DataFrame, name: str, folder: RunFolder, metric_cfg,
                       calibration=None, *, later: list[Drawing] | None = None, also=None) -> tuple[dict, list]:
    """A pointwise eval set (rated responses) for a pointwise method (BoRP): its scores against the ratings
    (``probe/...``: Krippendorff's alpha, Pearson, Spearman, RMSE, RMSE by uncertainty bins; for a method that
    counts response lengths also ``probe/partial_pearson_given_length`` and ``probe/pearson_with_log_length``), the
    baselines the method offers on the same rows (``probe/baseline/<name>/...``, e.g. ``length_ridge``; see
    :func:`baseline_metrics` for a baseline that answers one value throughout) and whether each matches or beats
    the probe (:mod:`rewarduq_exp.metrics.probe_rivals`; a log line names those that do), the predictions file
    (one row per response: ``score``, ``prediction``, ``lower``, ``upper``, ``u``, the lengths ``n_chars``,
    ``n_words``, ``n_tokens`` and each baseline's prediction) and the diagnostic figure (with the probe and the
    baselines' alpha, Pearson and RMSE side by side, and the probe's partial correlation given length); ``later``
    and ``also`` as in :func:`evaluate_method`."""
    from rewarduq_exp.metrics.probe import (
        LENGTH_COLUMNS,
        comparison,
        length_metrics,
        plot_probe_diagnostics,
        probe_metrics,
        spearman,
    )
    from rewarduq_exp.metrics.probe_rivals import rival_flags, rival_line

    y = data["score"].to_numpy(dtype=float)
    scores = method.score(list(data["prompt"]), list(data["response"]))
    u = scores.u
    score_range = tuple(method.settings.score_range)
    metrics = probe_metrics(y, scores.reward, u, score_range=score_range)
    predictions = pd.DataFrame({"id": data["id"].astype(str).to_numpy(), "subset": data["subset"].to_numpy(),
                                "score": y, "prediction": scores.reward, "lower": scores.lower,
                                "upper": scores.upper, "u": u})
    if calibration is not None:   # the intervals' coverage of the ratings before and after the conformal scale
        from rewarduq_exp.recalibration import recalibrated_pointwise_metrics

        metrics.update(recalibrated_pointwise_metrics(y, scores.reward, scores.lower, scores.upper, calibration))
        if also is not None:
            from rewarduq_exp.recalibration.fit import interval_prefix

            other = recalibrated_pointwise_metrics(y, scores.reward, scores.lower, scores.upper, also,
                                                   interval_prefix(also.interval))
            metrics.update({k: v for k, v in other.items() if not k.startswith("probe/")})   # raw ones: once
    if RATER_STD in data.columns:  # human disagreement per response (e.g. vader_ratings): does u track it?
        predictions[RATER_STD] = data[RATER_STD].to_numpy(dtype=float)
        metrics["probe/u_rater_std_spearman"] = spearman(u, predictions[RATER_STD].to_numpy())
    # What the probe knows beyond length: the pointwise method's response lengths (tokenizer only, no backbone pass).
    lengths = method.response_lengths(data["response"])
    for i, col in enumerate(LENGTH_COLUMNS):
        predictions[col] = lengths[:, i]
    metrics.update(length_metrics(y, scores.reward, lengths))
    baselines = method.baselines(data)
    for baseline, values in baselines.items():
        predictions[f"prediction_{baseline}"] = values
        metrics.update(baseline_metrics(name, baseline, y, values, score_range))
    if "score_judge" in baselines:  # the flag a reader looks for first: did the judge say anything at all?
        metrics["probe/judge_constant"] = metrics["probe/baseline/score_judge/constant"]
    if baselines:  # a probe that a cheap baseline matches says little: one line says so (metrics/probe_rivals.py)
        metrics.update(rival_flags(metrics))
        line = rival_line(name, metrics)
        if line:
            log.warning("%s", line)
    folder.write_predictions(name, predictions)
    if not (getattr(folder, "writer", True) and metric_cfg.get("diagrams", True)):
        return metrics, []
    draw = functools.partial(plot_probe_diagnostics, y, scores.reward, u, folder.figures_dir(name) / "probe.png",
                             title=name, score_range=score_range, compare=comparison(metrics))
    return metrics, drawn(lambda: [draw()], later)
