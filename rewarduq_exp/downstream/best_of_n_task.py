"""``python downstream.py task=best_of_n run=<run or sweep>``: best-of-n curves of every run, their summary, and
whether the paper's selection statistics (RS_0.2, ECE) predict who is best downstream.

Per run and split, ``task.prompts`` x ``task.n_max`` candidates are drawn from the run's own synthetic world and
scored in one batched call; the features go through the disk feature cache, so runs of a sweep that share a backbone
and probe (ENS-MLP, BAY-LIN) extract them once. Outputs in the task folder: ``curves.csv`` (gold vs n and KL for
every run, split, selection rule and k), ``summary.csv`` (:func:`curve_summary` per run and split),
``correlation.csv`` (Spearman across runs of the downstream scalars with the runs' own eval metrics),
``best_of_n.png``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.stats import spearmanr

from rewarduq_exp.analysis.selection import DEFAULT_EBCE, DEFAULT_ECE, DEFAULT_RANK
from rewarduq_exp.analysis.text_tables import fmt_number, text_table
from rewarduq_exp.api import RewardModel
from rewarduq_exp.core.atomic_write import write_atomic
from rewarduq_exp.core.checks import check_positive
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.synthetic import SPLITS
from rewarduq_exp.downstream.best_of_n import best_of_n_curves, curve_summary, powers_of_two
from rewarduq_exp.downstream.figures import plot_best_of_n
from rewarduq_exp.downstream.world_runs import WorldRun, completed_world_runs, world_of
from rewarduq_exp.runner.trained_run import load_trained_method

log = logging.getLogger("rewarduq_exp")
# The runs' own statistics that the downstream scalars are correlated with (higher RS and lower ECE are "better").
RUN_METRICS = ("win_rate", DEFAULT_RANK, "ece", "ebce", "truth/ece")
DOWNSTREAM = ("gold_nmax", "overopt_gap", "conservative_gain")


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
               trust_remote_code: bool = False) -> pd.DataFrame:
    trained = load_trained_method(run.path, device=device, progress=progress, batch_size=task.get("batch_size"),
                                  cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    model = RewardModel(trained.method, run.path, trained.config)
    world = world_of(run.config, run.path / ".hydra" / "config.yaml")
    parts = []
    for split in splits:
        candidates = world.candidates(split, int(task.prompts), ns[-1], seed=int(task.seed))
        t0 = time.perf_counter()
        reward, u = score_candidates(model, candidates)
        seconds = time.perf_counter() - t0
        log.info("%s %s: %d candidates scored in %.1f s (%.0f candidates/s)", run.label, split, reward.size,
                 seconds, reward.size / max(seconds, 1e-9))
        curves = best_of_n_curves(reward, u, candidates.gold, ks, ns)
        parts.append(curves.assign(run=run.label, method=run.record.method, split=split, path=str(run.path)))
    return pd.concat(parts, ignore_index=True)


def summarise(curves: pd.DataFrame, runs: list[WorldRun], k_compare: float) -> pd.DataFrame:
    rows = []
    for run in runs:
        for split, c in curves[curves.run == run.label].groupby("split", sort=False):
            eval_metrics = run.record.metrics.get(f"{run.config.dataset.name}_{split}", {})
            rows.append({"run": run.label, "method": run.record.method, "split": split,
                         **curve_summary(c, k_compare),
                         **{m: eval_metrics.get(m, np.nan) for m in RUN_METRICS}})
    return pd.DataFrame(rows)


def correlations(summary: pd.DataFrame) -> pd.DataFrame:
    """Spearman correlation across runs, per split, of each downstream scalar with each run metric (NaN with
    fewer than three runs: two points always correlate perfectly)."""
    rows = []
    for split, s in summary.groupby("split", sort=False):
        for d in DOWNSTREAM:
            for m in RUN_METRICS:
                x, y = s[d].to_numpy(float), s[m].to_numpy(float)
                ok = np.isfinite(x) & np.isfinite(y)
                rho = spearmanr(x[ok], y[ok]).statistic if ok.sum() >= 3 else np.nan
                rows.append({"split": split, "downstream": d, "run_metric": m, "spearman": float(rho),
                             "runs": int(ok.sum())})
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


def summary_text(summary: pd.DataFrame) -> str:
    cols = ["gold_n1", "gold_best", "best_n", "gold_nmax", "overopt_gap", "conservative_gain",
            "conservative_gain_nmax", "optimistic_gain", "oracle_nmax", DEFAULT_RANK, "ece"]
    rows = [[r.run, r.split, *(fmt_number(r[c], 3) if c != "best_n" else str(r[c]) for c in cols)]
            for _, r in summary.iterrows()]
    return text_table(["run", "split", *cols], rows)


def best_of_n(cfg, out_dir: Path) -> dict:
    ns, ks, splits = check_settings(cfg.task)
    runs = completed_world_runs(cfg.run)
    cache_dir = cfg.paths.get("cache_dir")
    curves = pd.concat([run_curves(r, cfg.task, ns, ks, splits, device=str(cfg.device), progress=bool(cfg.progress),
                                   cache_dir=cache_dir, trust_remote_code=cfg.get("trust_remote_code", False))
                        for r in runs], ignore_index=True)
    summary = summarise(curves, runs, float(cfg.task.k_compare))
    corr = correlations(summary)
    for name, table in (("curves", curves), ("summary", summary), ("correlation", corr)):
        write_atomic(out_dir / f"{name}.csv", table.to_csv(index=False))
    plot_best_of_n(curves, out_dir / "best_of_n.png", k=float(cfg.task.k_compare))
    checks = [selection_check(summary, s) for s in splits]
    print(summary_text(summary), flush=True)
    for line in filter(None, checks):
        print(line, flush=True)
    print(f"curves, summary and figure in {out_dir}", flush=True)
    return {"summary": summary, "curves": curves, "correlation": corr, "selection": checks}
