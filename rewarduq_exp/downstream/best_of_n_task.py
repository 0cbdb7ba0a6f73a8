"""``python downstream.py task=best_of_n run=<run or sweep>``: best-of-n curves of every run, their summary, how far
gold falls after its peak per shortcut strength, whether u rises on the candidates that exploit the shortcut, and
whether the paper's selection statistics (RS_0.2, ECE, EBCE) predict who loses least downstream.

Scores go through each run's recalibration (``calibration.json``) unless ``task.recalibrated=false``: reward / T and
u scaled by s / T (:mod:`.calibrated_scale`). The mean pick, the oracle, the fair use of u and the selection checks
do not depend on it; the conservative and optimistic curves do (``task.ks`` are in units of the recalibrated u, and
of the raw u with ``task.recalibrated=false`` or for a run without ``calibration.json``, which one log line names).
Beside them, from the same candidates: r - k s u (the calibrated scale s, and the conformal one) against r - k u
and against the mean pick, with paired intervals (``conservative_cal_*`` columns). The paper's selection rule is
checked on the raw and on the recalibrated metrics side by side (:mod:`.selection_check`).

Runs trained on the synthetic world (``dataset=synthetic``) or on VADER (``dataset=vader_pairs``, BoRP's
``vader_ratings``) are accepted (:func:`~rewarduq_exp.downstream.world_runs.world_of`). Per run and split,
``task.prompts`` x ``task.n_max`` candidates are drawn from the run's own world (synthetic: its generator, with
its shortcut features; VADER: held-out sentences, the held-out splits eval and ood only, with their length in words
as the feature) and scored in one batched call; the features go through the disk feature cache, so runs of a sweep
that share a backbone and probe (ENS-MLP, BAY-LIN) extract them once.

Outputs in the task folder: ``curves.csv`` (gold vs n and KL for every run, split, selection rule and k, with the
run's world settings and seed; ``conservative_raw`` / ``_cal`` / ``_conformal`` at k = ``task.k_compare`` where the
run was recalibrated), ``summary.csv`` (:func:`curve_summary` per run and split, the same settings, the run's own
metrics, raw and ``recal/``, its recalibration and the calibrated-scale comparisons, ``worlds``: how many worlds
share its split, method and strength, and ``not_promised``: the intervals that cannot promise their level and why),
``over_worlds.csv`` (the effect over worlds of every per-world statistic, :mod:`.over_worlds`), ``selection.csv`` (the
selection rule's pick on raw and recalibrated metrics, per split and world, and its standing downstream),
``overoptimization.csv`` (per method and strength: the fall after the peak against the seed spread), ``shortcut.csv``
and ``shortcut_bins.csv`` (u and r against the candidates' features), ``correlation.csv`` (Spearman across runs of
the downstream scalars with the runs' own eval metrics, raw and recalibrated, with p-values),
``per_prompt.csv.gz`` (the per-prompt picks every interval was computed from), and the figures ``best_of_n.png``,
``uncertainty_use.png``, ``shortcut.png``, ``overoptimization.png`` (when the runs span two strengths or more) and
``selection_vs_loss.png`` / ``selection_vs_gold.png`` (when a correlation across runs is defined).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import time
from pathlib import Path

import numpy as np
import pandas as pd

from rewarduq_exp.analysis.selection import DEFAULT_RANK
from rewarduq_exp.analysis.text_tables import fmt_number, text_table
from rewarduq_exp.api import RewardModel
from rewarduq_exp.core.atomic_write import write_atomic
from rewarduq_exp.core.checks import check_positive
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.synthetic import SPLITS
from rewarduq_exp.downstream.best_of_n import (
    curve_summary,
    curves_frame,
    kl_best_of_n,
    picked_per_prompt,
    powers_of_two,
)
from rewarduq_exp.downstream.calibrated_scale import (
    META,
    calibrated_lines,
    calibrated_picks,
    calibration_columns,
    calibration_info,
    recalibrated_scores,
)
from rewarduq_exp.downstream.figures import (
    plot_best_of_n,
    plot_overoptimization,
    plot_selection_vs_loss,
    plot_shortcut,
    plot_uncertainty_use,
)
from rewarduq_exp.downstream.over_worlds import over_worlds_lines, over_worlds_rows, worlds_per_cell
from rewarduq_exp.downstream.overoptimization import (
    format_interval,
    overoptimization_lines,
    overoptimization_table,
    paired_statistics,
    strength_axis,
    world_settings,
)
from rewarduq_exp.downstream.selection_check import selection_check_lines, selection_rows
from rewarduq_exp.downstream.shortcut import shortcut_bins, shortcut_table, spearman_or_nan
from rewarduq_exp.downstream.uncertainty_use import knn_distance, use_curves
from rewarduq_exp.downstream.world_runs import WorldRun, completed_world_runs, world_of
from rewarduq_exp.methods.base import FeatureHeadMethod
from rewarduq_exp.recalibration import read_calibration
from rewarduq_exp.runner.trained_run import load_trained_method

log = logging.getLogger("rewarduq_exp")
# The runs' own statistics that the downstream scalars are correlated with (higher RS and lower ECE are "better").
RUN_METRICS = ("win_rate", DEFAULT_RANK, "ece", "ebce", "truth/ece")
# The same after the run's recalibration (metrics.json's recal/<metric>): the recalibrated selection rule reads them.
RECAL_METRICS = tuple(f"recal/{m}" for m in RUN_METRICS if m != "win_rate")  # T > 0: the win rate never changes
# The downstream losses (and gains) they are correlated with; largest_drop is the one the figure shows.
DOWNSTREAM = ("largest_drop", "overopt_gap", "gold_nmax", "conservative_gain")
LOSS = "largest_drop"


def check_settings(task) -> tuple[list[int], list[float], list[str]]:
    check_positive(task.prompts, "task.prompts", integer=True, minimum=1, inclusive=True)
    ns = powers_of_two(task.n_max)
    ks = [float(k) for k in task.ks]
    if not ks or any(not np.isfinite(k) or k <= 0 for k in ks):
        raise UserError(f"task.ks={list(task.ks)} is invalid: must be a non-empty list of numbers > 0 (units of u)")
    if float(task.k_compare) not in ks:
        raise UserError(f"task.k_compare={task.k_compare} is invalid: must be one of task.ks ({ks})")
    splits = [str(s) for s in task.splits]
    bad = [s for s in splits if s not in SPLITS]
    if bad or not splits:
        raise UserError(f"task.splits={splits} is invalid; allowed: {', '.join(SPLITS)}")
    grid = [float(k) for k in task.k_grid]
    if not grid or any(not np.isfinite(k) or k < 0 for k in grid):
        raise UserError(f"task.k_grid={list(task.k_grid)} is invalid: must be a non-empty list of numbers >= 0 "
                        "(units of the reward's spread; 0 = do not use u)")
    share = float(task.select_share)
    if not 0 < share < 1:
        raise UserError(f"task.select_share={task.select_share} is invalid: must be a number in (0, 1)")
    if int(task.prompts) < 2:
        raise UserError(f"task.prompts={task.prompts} is invalid: must be >= 2 (k is chosen on some prompts and "
                        "reported on the others)")
    check_positive(task.knn, "task.knn", integer=True, minimum=1, inclusive=True)
    check_positive(task.draws, "task.draws", integer=True, minimum=100, inclusive=True)
    if not isinstance(task.get("recalibrated", True), bool):
        raise UserError(f"task.recalibrated={task.get('recalibrated')!r} is invalid: must be true (score through each "
                        "run's calibration.json where it has one) or false (raw scores)")
    return ns, ks, splits


def score_candidates(model: RewardModel, candidates, raw: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(reward, u), each (P, N): all P x N candidates in one batched call (recalibrated where ``model`` holds a
    calibration, unless ``raw``)."""
    table = _score_table(model, candidates, raw)
    shape = candidates.gold.shape
    return table.reward.to_numpy().reshape(shape), table.uncertainty.to_numpy().reshape(shape)


def _score_table(model: RewardModel, candidates, raw: bool) -> pd.DataFrame:
    n = candidates.gold.shape[1]
    prompts = [p for p in candidates.prompts for _ in range(n)]
    texts = [t for group in candidates.texts for t in group]
    return model.score(prompts, texts, raw=raw)


def score_both(model: RewardModel, candidates) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """((reward, u) as the curves use them, (reward, u) raw), each (P, N), from one scoring: the model's own scores,
    and where ``model`` holds a calibration the same recalibrated as :meth:`RewardModel.score` would."""
    if model.calibration is None:
        scores = score_candidates(model, candidates)
        return scores, scores
    table = _score_table(model, candidates, raw=True)
    shape = candidates.gold.shape
    raw = table.reward.to_numpy().reshape(shape), table.uncertainty.to_numpy().reshape(shape)
    reward, u = recalibrated_scores(table, model.calibration, model.beta)
    return (reward.reshape(shape), u.reshape(shape)), raw


def knn_uncertainty(model: RewardModel, world, candidates, k: int, memo: dict) -> np.ndarray | None:
    """The k-NN distance of every candidate to the run's training completions in its frozen feature space, (P, N);
    None for methods that are no head on the encoder's frozen features (``FeatureHeadMethod``): the fine-tuned
    ones, which have no feature space apart from their adapted model, and BoRP, whose probe reads the layers of its
    own rating template. ``memo`` keeps the distances of a backbone, probe, training set and candidates: the seeds
    and label strengths of one world share them (their texts are the same), so a sweep computes them once."""
    encoder = getattr(model.method, "encoder", None)
    if not isinstance(model.method, FeatureHeadMethod) or encoder is None:
        return None
    train = world.load(world.data.train_split if hasattr(world, "data") else world.train_split)
    key = hashlib.sha256(json.dumps([encoder.backbone.identity(), encoder.probe_identity(), int(k),
                                     sorted(map(str, zip(train.prompt, train.chosen, train.rejected))),
                                     candidates.prompts, candidates.texts], sort_keys=True, default=str).encode()
                         ).hexdigest()
    if key not in memo:
        train_chosen, train_rejected = encoder.encode_pairs(train, desc="features (train)")  # cached by the run
        n_prompts, n = candidates.gold.shape
        prompts = [p for p in candidates.prompts for _ in range(n)]
        completions = [[{"role": "assistant", "content": t}] for group in candidates.texts for t in group]
        feats = encoder.encode(prompts, completions, desc="features (candidates)")  # cached by the scoring
        reference = np.concatenate([train_chosen.numpy(), train_rejected.numpy()]).astype(np.float64)
        memo[key] = knn_distance(reference, feats.numpy().astype(np.float64), k).reshape(n_prompts, n)
    return memo[key]


def run_curves(run: WorldRun, task, ns, ks, splits, *, device: str, progress: bool, cache_dir=None,
               trust_remote_code: bool = False, memo: dict | None = None):
    """The run's best-of-n curves, its shortcut table and the shortcut bins on every split (each row carries the
    run, its method, the split and the run's world settings and seed), and per split its per-prompt picks:
    ``{split: {(selection, k): gold (P, J), "use": use_curves(...), META: the run's T and scales}}``.

    With ``task.recalibrated`` (default) and a ``calibration.json`` in the run, every score is recalibrated (the
    ``ks`` are then in units of the recalibrated u) and the calibrated-scale picks of :mod:`.calibrated_scale` are
    added from the raw scores of the same candidates; otherwise everything is raw, as before recalibration existed."""
    trained = load_trained_method(run.path, device=device, progress=progress, batch_size=task.get("batch_size"),
                                  cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    calibration = read_calibration(run.path) if task.get("recalibrated", True) else None
    model = RewardModel(trained.method, run.path, trained.config, calibration=calibration)
    info = calibration_info(calibration)
    if info:
        log.info("%s: scored through its recalibration (T = %.4g, s = %.4g by %s%s)", run.label, info["temperature"],
                 info["scale"], info["interval"], "" if info["scale_conformal"] is None else
                 f"; conformal s = {info['scale_conformal']:.4g}")
    world = world_of(run.config, run.path / ".hydra" / "config.yaml")
    train_max = world.training_feature_max()
    tags = {"run": run.label, "method": run.record.method, **world_settings(run.config)}
    parts, shortcuts, bins, per_prompt = [], [], [], {}
    kl = kl_best_of_n(ns)
    for split in splits:
        candidates = world.candidates(split, int(task.prompts), ns[-1], seed=int(task.seed))
        t0 = time.perf_counter()
        (reward, u), (raw_reward, raw_u) = score_both(model, candidates)
        seconds = time.perf_counter() - t0
        log.info("%s %s: %d candidates scored in %.1f s (%.0f candidates/s)", run.label, split, reward.size,
                 seconds, reward.size / max(seconds, 1e-9))
        picked = picked_per_prompt(reward, u, candidates.gold, ks, ns)
        picked |= calibrated_picks(raw_reward, raw_u, candidates.gold, info, float(task.k_compare), ns,
                                   proxy_reward=reward)
        parts.append(curves_frame(picked, ns).assign(**tags, split=split, path=str(run.path)))
        beyond = np.zeros(reward.shape, dtype=bool)
        for name, values in candidates.features.items():
            beyond |= values > train_max.get(name, np.inf)
        use = use_curves(reward, u, candidates.gold, beyond, ns, kl, [float(k) for k in task.k_grid],
                         float(task.select_share), int(task.seed),
                         knn_u=knn_uncertainty(model, world, candidates, int(task.knn), {} if memo is None else memo))
        per_prompt[split] = {key: gold for key, (gold, _) in picked.items()} | {"use": use, META: info}
        shortcuts.append(shortcut_table(reward, u, candidates.gold, candidates.features, train_max)
                         .assign(**tags, split=split))
        bins.append(shortcut_bins(reward, u, candidates.gold, candidates.features).assign(**tags, split=split))
    return (*(pd.concat(p, ignore_index=True) for p in (parts, shortcuts, bins)), per_prompt)


def per_prompt_frame(per_prompt: dict, ns) -> pd.DataFrame:
    """The per-prompt picks in long form (run, split, rule, k, prompt, n, gold): what every interval was computed
    from. The fair-use rules (model, knn, filter, and mean / oracle again as their baselines) cover the report
    prompts only, marked ``part=report``; the other rows cover every prompt (``part=all``). The calibrated-scale
    rules (``conservative_raw`` / ``_cal`` / ``_conformal``) carry k = task.k_compare: r - k u, r - k s u and
    r - k s_conformal u on the raw u."""
    frames = []
    for (run, split), picks in per_prompt.items():
        for key, gold in picks.items():
            if not isinstance(key, tuple):   # "use" and the run's calibration
                continue
            frames.append(_long(gold, ns, np.arange(len(gold)), run=run, split=split, rule=key[0], k=key[1],
                                part="all"))
        use = picks["use"]
        for rule in ("mean", "model", "knn", "filter", "oracle"):
            if rule in use:
                frames.append(_long(use[rule], ns, use["report_prompts"], run=run, split=split, rule=rule,
                                    k=float(use.get(f"k_{rule}", 0.0)), part="report"))
    return pd.concat(frames, ignore_index=True)


def _long(gold: np.ndarray, ns, prompts: np.ndarray, **tags) -> pd.DataFrame:
    return pd.DataFrame({**tags, "prompt": np.repeat(prompts, len(ns)), "n": np.tile(np.asarray(ns), len(gold)),
                         "gold": gold.ravel()})


def summarise(curves: pd.DataFrame, runs: list[WorldRun], per_prompt: dict, task, ns) -> pd.DataFrame:
    """Per run and split: :func:`curve_summary`'s point values, then the same with intervals over the run's prompts
    (:func:`~.overoptimization.paired_statistics`, which overwrites the point values it shares; with the
    calibrated-scale comparisons of :mod:`.calibrated_scale`), the world settings, the run's recalibration
    (:func:`~.calibrated_scale.calibration_columns`) and the run's own eval metrics, raw and recalibrated."""
    rows = []
    k_compare, kl = float(task.k_compare), kl_best_of_n(ns)
    for run in runs:
        for split, c in curves[curves.run == run.label].groupby("split", sort=False):
            eval_metrics = run.record.metrics.get(f"{run.config.dataset.name}_{split}", {})
            stats = paired_statistics([per_prompt[(run.label, split)]], kl, ns, k_compare, int(task.draws),
                                      int(task.seed))
            rows.append({"run": run.label, "method": run.record.method, "split": split,
                         **world_settings(run.config), **curve_summary(c, k_compare), **stats,
                         **calibration_columns([per_prompt[(run.label, split)]]),
                         **{m: eval_metrics.get(m, np.nan) for m in (*RUN_METRICS, *RECAL_METRICS)},
                         "path": str(run.path)})
    return pd.DataFrame(rows)


def correlations(summary: pd.DataFrame) -> pd.DataFrame:
    """Spearman correlation across the runs of one world, per split, of each downstream scalar with each run metric,
    its p-value and the number of runs (``runs``) with both values (NaN with fewer than three: two points always
    correlate perfectly; NaN too where either side is constant, e.g. no run falls). The recalibrated metrics
    (``recal/...``) are correlated too where the summary has them. Worlds are not pooled: their oracles and
    candidates differ."""
    rows = []
    metrics = [*RUN_METRICS, *(m for m in RECAL_METRICS if m in summary.columns)]
    for (split, world), s in summary.groupby(["split", "world"], sort=False):
        for d in DOWNSTREAM:
            for m in metrics:
                x, y = s[d].to_numpy(float), s[m].to_numpy(float)
                ok = np.isfinite(x) & np.isfinite(y)
                rho, p = spearman_or_nan(x[ok], y[ok])
                rows.append({"split": split, "world": world, "downstream": d, "run_metric": m, "spearman": float(rho),
                             "p_value": float(p), "runs": int(ok.sum())})
    return pd.DataFrame(rows)


def summary_text(summary: pd.DataFrame, axis: str) -> str:
    """Per run: the level values, then each difference with its 95 % interval over the run's prompts
    (``conservative_cal_vs_raw``: r - k s u minus r - k u, "-" for a run scored raw)."""
    cols = ["gold_n1", "gold_best", "best_n", "gold_nmax", "oracle_nmax", DEFAULT_RANK, "ece"]
    intervals = ["largest_drop", "conservative_gain", "conservative_cal_vs_raw", "model_vs_mean", "knn_vs_mean",
                 "filter_vs_mean"]
    rows = [[r.run, str(r.world), f"{r[axis]:g}", r.split,
             *(str(r[c]) if c.endswith("_n") else fmt_number(r[c], 3) for c in cols),
             *(format_interval(r, c) for c in intervals)] for _, r in summary.iterrows()]
    return text_table(["run", "world", axis, "split", *cols, *intervals], rows)


def shortcut_lines(shortcut: pd.DataFrame, axis: str) -> list[str]:
    """Per split, method, strength and feature (means over the runs): how many candidates lie beyond the training
    maximum, how much larger their u is (over the median u), how much more the proxy rewards them, and Spearman of
    u and r with the feature (the largest p-value over the runs)."""
    grouped = shortcut.groupby(["split", "method", axis, "feature"], sort=False)
    table = grouped.agg(runs=("seed", "size"), train_max=("train_max", "max"), beyond=("beyond", "mean"),
                        candidates=("candidates", "mean"), u_ratio=("u_ratio", "mean"), r_inside=("r_inside", "mean"),
                        r_beyond=("r_beyond", "mean"), rho_u=("rho_u", "mean"), p_u=("p_u", "max"),
                        rho_r=("rho_r", "mean"), p_r=("p_r", "max")).reset_index()
    return [f"{r.split} {r.method} {axis}={r[axis]:g} {r.feature} ({r.runs} runs): {r.beyond:.0f} of "
            f"{r.candidates:.0f} candidates beyond the training max {r.train_max:g}; u beyond / inside "
            f"{fmt_number(r.u_ratio, 3)}, r inside {fmt_number(r.r_inside, 3)} beyond {fmt_number(r.r_beyond, 3)}; "
            f"Spearman with the feature: u {fmt_number(r.rho_u, 3)} (p <= {fmt_p(r.p_u)}), r "
            f"{fmt_number(r.rho_r, 3)} (p <= {fmt_p(r.p_r)})" for _, r in table.iterrows()]


def fmt_p(p: float) -> str:
    """A p-value in two significant digits; one that underflows a float64 says so instead of printing 0."""
    return "< 1e-300" if p == 0 else f"{p:.2g}"


def loss_split(splits: list[str]) -> str:
    """The split whose losses the selection statistics are checked against: eval when it was measured."""
    return "eval" if "eval" in splits else splits[0]


def selection_lines(corr: pd.DataFrame, split: str) -> list[str]:
    part = corr[(corr.split == split) & (corr.downstream == LOSS)]
    return [f"{r.run_metric} vs {LOSS} ({split}, world={r.world}): Spearman rho {fmt_number(r.spearman, 3)}, p "
            f"{fmt_p(r.p_value)}, n = {r.runs} runs" for _, r in part.iterrows()]


def best_of_n(cfg, out_dir: Path) -> dict:
    ns, ks, splits = check_settings(cfg.task)
    runs = completed_world_runs(cfg.run)
    for r in runs:   # task.prompts x task.n_max candidates of each world against the host's memory, before any model
        world = world_of(r.config, r.path / ".hydra" / "config.yaml")
        if hasattr(world, "check_candidates_memory"):
            world.check_candidates_memory(int(cfg.task.prompts), ns[-1])
    cache_dir, memo = cfg.paths.get("cache_dir"), {}
    parts = [run_curves(r, cfg.task, ns, ks, splits, device=str(cfg.device), progress=bool(cfg.progress),
                        cache_dir=cache_dir, trust_remote_code=cfg.get("trust_remote_code", False), memo=memo)
             for r in runs]
    curves, shortcut, bins = (pd.concat([p[i] for p in parts], ignore_index=True) for i in range(3))
    per_prompt = {(r.label, split): picks for r, p in zip(runs, parts) for split, picks in p[3].items()}
    summary = summarise(curves, runs, per_prompt, cfg.task, ns)
    axis = strength_axis(summary)
    overopt = overoptimization_table(summary, per_prompt, axis, kl_best_of_n(ns), ns, float(cfg.task.k_compare),
                                     int(cfg.task.draws), int(cfg.task.seed))
    corr = correlations(summary)
    selection = selection_rows(summary, splits, per_prompt, int(cfg.task.draws), int(cfg.task.seed))
    summary["worlds"], overopt["worlds"] = worlds_per_cell(summary, axis), worlds_per_cell(overopt, axis)
    over = over_worlds_rows(overopt, summary, per_prompt, axis, selection, corr)
    tables = {"curves": curves, "summary": summary, "overoptimization": overopt, "over_worlds": over,
              "shortcut": shortcut, "shortcut_bins": bins, "correlation": corr, "selection": selection}
    for name, table in tables.items():
        write_atomic(out_dir / f"{name}.csv", table.to_csv(index=False))
    # what every interval was computed from, for a reader who wants to recompute one (gzip: ~10^5 rows a sweep)
    write_atomic(out_dir / "per_prompt.csv.gz",
                 gzip.compress(per_prompt_frame(per_prompt, ns).to_csv(index=False).encode(), mtime=0))
    k = float(cfg.task.k_compare)
    plot_best_of_n(curves, out_dir / "best_of_n.png", k=k, axis=axis)
    # A figure over the shortcut's strength needs runs at two strengths at least, and the scatter of the runs'
    # statistics needs a correlation to show; otherwise the figure would be an empty axis (the tables still say it).
    plot_uncertainty_use(overopt, axis, out_dir / "uncertainty_use.png", over)
    if summary[axis].nunique() > 1:
        plot_overoptimization(overopt, axis, out_dir / "overoptimization.png")
    else:
        log.info("no overoptimization.png: the runs share one %s (train runs over several to sweep it)", axis)
    plot_shortcut(bins, shortcut, axis, out_dir / "shortcut.png")
    split = loss_split(splits)
    if np.isfinite(corr[corr.split == split].spearman).any():
        plot_selection_vs_loss(summary, corr, RUN_METRICS, LOSS, split, out_dir / "selection_vs_loss.png")
        # the level the pick reaches, beside its drop: where no run falls, this is what the statistics can predict
        plot_selection_vs_loss(summary, corr, RUN_METRICS, "gold_nmax", split, out_dir / "selection_vs_gold.png")
    else:
        log.info("no selection_vs_loss.png: no Spearman correlation is defined on %s (three runs with distinct "
                 "values are needed)", split)
    checks = selection_check_lines(selection)
    print(summary_text(summary, axis), flush=True)
    sections = (("overoptimization per world (largest drop, gains; 95 % paired intervals over runs and prompts):",
                 overoptimization_lines(overopt, axis)),
                ("over worlds (the effect of the world generator: mean over the worlds, 95 % t-interval over their "
                 "estimates):", over_worlds_lines(over, axis) or ["none: the runs come from one world"]),
                (f"calibrated scale (recalibrated runs; k = {k:g}, gold gained over the KL range, 95 % paired "
                 "intervals over runs and prompts):", calibrated_lines(overopt, axis, k)
                 or ["none: every run was scored raw (task.recalibrated=false, or no calibration.json)"]),
                ("shortcut (is u higher on candidates beyond the training range?):", shortcut_lines(shortcut, axis)),
                ("selection rule, filtered and ranked on the raw or the recalibrated metrics:", checks),
                ("selection statistics vs the loss, across runs:", selection_lines(corr, split)))
    for title, lines in sections:
        print(title, *lines, sep="\n", flush=True)
    print(f"tables and figures in {out_dir}", flush=True)
    return {"summary": summary, "curves": curves, "correlation": corr, "selection": checks,
            "selection_table": selection, "overoptimization": overopt, "over_worlds": over, "shortcut": shortcut}
