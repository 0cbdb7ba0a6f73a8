"""``python downstream.py task=best_of_n run=<run or sweep>``: best-of-n curves of every run, their summary, how far
gold falls after its peak per shortcut strength, whether u rises on the candidates that exploit the shortcut, and
whether the paper's selection statistics (RS_0.2, ECE, EBCE) predict who loses least downstream.

Per run and split, ``task.prompts`` x ``task.n_max`` candidates are drawn from the run's own synthetic world and
scored in one batched call; the features go through the disk feature cache, so runs of a sweep that share a backbone
and probe (ENS-MLP, BAY-LIN) extract them once. Outputs in the task folder: ``curves.csv`` (gold vs n and KL for
every run, split, selection rule and k, with the run's world settings and seed), ``summary.csv``
(:func:`curve_summary` per run and split, the same settings and the run's own metrics), ``overoptimization.csv``
(per method and strength: the fall after the peak against the seed spread), ``shortcut.csv`` and
``shortcut_bins.csv`` (u and r against the candidates' shortcut features), ``correlation.csv`` (Spearman across runs
of the downstream scalars with the runs' own eval metrics, with p-values), and the figures ``best_of_n.png``,
``overoptimization.png``, ``shortcut.png``, ``selection_vs_loss.png``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pandas as pd

from rewarduq_exp.analysis.selection import DEFAULT_EBCE, DEFAULT_ECE, DEFAULT_RANK
from rewarduq_exp.analysis.text_tables import fmt_number, text_table
from rewarduq_exp.api import RewardModel
from rewarduq_exp.core.atomic_write import write_atomic
from rewarduq_exp.core.checks import check_positive
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.synthetic import SPLITS
from rewarduq_exp.downstream.best_of_n import best_of_n_curves, curve_summary, powers_of_two
from rewarduq_exp.downstream.figures import plot_best_of_n, plot_overoptimization, plot_selection_vs_loss, plot_shortcut
from rewarduq_exp.downstream.overoptimization import (
    overoptimization_lines,
    overoptimization_table,
    strength_axis,
    world_settings,
)
from rewarduq_exp.downstream.shortcut import shortcut_bins, shortcut_table, spearman_or_nan
from rewarduq_exp.downstream.world_runs import WorldRun, completed_world_runs, world_of
from rewarduq_exp.runner.trained_run import load_trained_method

log = logging.getLogger("rewarduq_exp")
# The runs' own statistics that the downstream scalars are correlated with (higher RS and lower ECE are "better").
RUN_METRICS = ("win_rate", DEFAULT_RANK, "ece", "ebce", "truth/ece")
# The downstream losses (and gains) they are correlated with; fall_after_peak is the one the figure shows.
DOWNSTREAM = ("fall_after_peak", "overopt_gap", "gold_nmax", "conservative_gain")
LOSS = "fall_after_peak"


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
    return ns, ks, splits


def score_candidates(model: RewardModel, candidates) -> tuple[np.ndarray, np.ndarray]:
    """(reward, u), each (P, N): all P x N candidates in one batched call."""
    n_prompts, n = candidates.gold.shape
    prompts = [p for p in candidates.prompts for _ in range(n)]
    texts = [t for group in candidates.texts for t in group]
    table = model.score(prompts, texts)
    return table.reward.to_numpy().reshape(n_prompts, n), table.uncertainty.to_numpy().reshape(n_prompts, n)


def run_curves(run: WorldRun, task, ns, ks, splits, *, device: str, progress: bool, cache_dir=None,
               trust_remote_code: bool = False) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The run's best-of-n curves, its shortcut table and the shortcut bins, on every split; each row carries the
    run, its method, the split and the run's world settings and seed."""
    trained = load_trained_method(run.path, device=device, progress=progress, batch_size=task.get("batch_size"),
                                  cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    model = RewardModel(trained.method, run.path, trained.config)
    world = world_of(run.config, run.path / ".hydra" / "config.yaml")
    train_max = world.training_feature_max()
    tags = {"run": run.label, "method": run.record.method, **world_settings(run.config)}
    parts, shortcuts, bins = [], [], []
    for split in splits:
        candidates = world.candidates(split, int(task.prompts), ns[-1], seed=int(task.seed))
        t0 = time.perf_counter()
        reward, u = score_candidates(model, candidates)
        seconds = time.perf_counter() - t0
        log.info("%s %s: %d candidates scored in %.1f s (%.0f candidates/s)", run.label, split, reward.size,
                 seconds, reward.size / max(seconds, 1e-9))
        curves = best_of_n_curves(reward, u, candidates.gold, ks, ns)
        parts.append(curves.assign(**tags, split=split, path=str(run.path)))
        shortcuts.append(shortcut_table(reward, u, candidates.gold, candidates.features, train_max)
                         .assign(**tags, split=split))
        bins.append(shortcut_bins(reward, u, candidates.gold, candidates.features).assign(**tags, split=split))
    return tuple(pd.concat(p, ignore_index=True) for p in (parts, shortcuts, bins))


def summarise(curves: pd.DataFrame, runs: list[WorldRun], k_compare: float) -> pd.DataFrame:
    rows = []
    for run in runs:
        for split, c in curves[curves.run == run.label].groupby("split", sort=False):
            eval_metrics = run.record.metrics.get(f"{run.config.dataset.name}_{split}", {})
            rows.append({"run": run.label, "method": run.record.method, "split": split,
                         **world_settings(run.config), **curve_summary(c, k_compare),
                         **{m: eval_metrics.get(m, np.nan) for m in RUN_METRICS}})
    return pd.DataFrame(rows)


def correlations(summary: pd.DataFrame) -> pd.DataFrame:
    """Spearman correlation across runs, per split, of each downstream scalar with each run metric, its p-value and
    the number of runs (``runs``) with both values (NaN with fewer than three: two points always correlate
    perfectly; NaN too where either side is constant, e.g. no run falls after its peak)."""
    rows = []
    for split, s in summary.groupby("split", sort=False):
        for d in DOWNSTREAM:
            for m in RUN_METRICS:
                x, y = s[d].to_numpy(float), s[m].to_numpy(float)
                ok = np.isfinite(x) & np.isfinite(y)
                rho, p = spearman_or_nan(x[ok], y[ok])
                rows.append({"split": split, "downstream": d, "run_metric": m, "spearman": float(rho),
                             "p_value": float(p), "runs": int(ok.sum())})
    return pd.DataFrame(rows)


def selection_check(summary: pd.DataFrame, split: str) -> str:
    """Which run the paper's selection rule (ECE <= 0.05, EBCE <= 0.01, then highest RS_0.2) picks on ``split``,
    and where it stands downstream (gold reward at n_max under mean selection)."""
    s = summary[summary.split == split]
    if s.empty:
        return ""
    passing = s[(s.ece <= DEFAULT_ECE) & (s.ebce <= DEFAULT_EBCE)]
    pool = passing if not passing.empty else s
    if pool[DEFAULT_RANK].isna().all():
        return f"{split}: the runs have no {DEFAULT_RANK} on this split; no selection to check"
    picked = pool.loc[pool[DEFAULT_RANK].idxmax()]
    ranked = s.sort_values("gold_nmax", ascending=False).run.tolist()
    note = "" if not passing.empty else f" (no run passes ECE <= {DEFAULT_ECE} and EBCE <= {DEFAULT_EBCE}: ranked all)"
    return (f"{split}: the selection rule picks {picked.run}{note}; downstream it ranks {ranked.index(picked.run) + 1} "
            f"of {len(ranked)} (best: {ranked[0]})")


def summary_text(summary: pd.DataFrame, axis: str) -> str:
    cols = ["gold_n1", "gold_best", "best_n", "trough_n", "fall_after_peak", "largest_drop", "gold_nmax",
            "conservative_gain", "conservative_gain_nmax", "optimistic_gain", "oracle_nmax", DEFAULT_RANK, "ece"]
    rows = [[r.run, f"{r[axis]:g}", r.split,
             *(str(r[c]) if c.endswith("_n") else fmt_number(r[c], 3) for c in cols)] for _, r in summary.iterrows()]
    return text_table(["run", axis, "split", *cols], rows)


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
    return [f"{r.run_metric} vs {LOSS} ({split}): Spearman rho {fmt_number(r.spearman, 3)}, p {fmt_p(r.p_value)}, "
            f"n = {r.runs} runs" for _, r in part.iterrows()]


def best_of_n(cfg, out_dir: Path) -> dict:
    ns, ks, splits = check_settings(cfg.task)
    runs = completed_world_runs(cfg.run)
    cache_dir = cfg.paths.get("cache_dir")
    parts = [run_curves(r, cfg.task, ns, ks, splits, device=str(cfg.device), progress=bool(cfg.progress),
                        cache_dir=cache_dir, trust_remote_code=cfg.get("trust_remote_code", False)) for r in runs]
    curves, shortcut, bins = (pd.concat(p, ignore_index=True) for p in zip(*parts))
    summary = summarise(curves, runs, float(cfg.task.k_compare))
    axis = strength_axis(summary)
    overopt = overoptimization_table(summary, axis)
    corr = correlations(summary)
    tables = {"curves": curves, "summary": summary, "overoptimization": overopt, "shortcut": shortcut,
              "shortcut_bins": bins, "correlation": corr}
    for name, table in tables.items():
        write_atomic(out_dir / f"{name}.csv", table.to_csv(index=False))
    k = float(cfg.task.k_compare)
    plot_best_of_n(curves, out_dir / "best_of_n.png", k=k, axis=axis)
    # A figure over the shortcut's strength needs runs at two strengths at least, and the scatter of the runs'
    # statistics needs a correlation to show; otherwise the figure would be an empty axis (the tables still say it).
    if summary[axis].nunique() > 1:
        plot_overoptimization(summary, overopt, axis, out_dir / "overoptimization.png")
    else:
        log.info("no overoptimization.png: the runs share one %s (train runs over several to sweep it)", axis)
    plot_shortcut(bins, shortcut, axis, out_dir / "shortcut.png")
    split = loss_split(splits)
    if np.isfinite(corr[corr.split == split].spearman).any():
        plot_selection_vs_loss(summary, corr, RUN_METRICS, LOSS, split, out_dir / "selection_vs_loss.png")
    else:
        log.info("no selection_vs_loss.png: no Spearman correlation is defined on %s (three runs with distinct "
                 "values are needed)", split)
    checks = [selection_check(summary, s) for s in splits]
    print(summary_text(summary, axis), flush=True)
    sections = (("overoptimization (fall after the peak vs the seed spread):", overoptimization_lines(overopt, axis)),
                ("shortcut (is u higher on candidates beyond the training range?):", shortcut_lines(shortcut, axis)),
                ("selection rule:", list(filter(None, checks))),
                ("selection statistics vs the loss, across runs:", selection_lines(corr, split)))
    for title, lines in sections:
        print(title, *lines, sep="\n", flush=True)
    print(f"tables and figures in {out_dir}", flush=True)
    return {"summary": summary, "curves": curves, "correlation": corr, "selection": checks,
            "overoptimization": overopt, "shortcut": shortcut}
