"""The methods side by side over worlds: each method's intrinsic metrics (the paper's and the truth-based ones) with a
95 % interval over the worlds, and each method's paired difference from a baseline method, from finished runs.

    python scripts/uq_methods_table.py outputs/multirun/uq56_default [more sweep folders] [--baseline ens_mlp]
        [--metrics win_rate ece ebce rs_0.2 cf_rate truth/margin_coverage] [--csv out.csv]

A world (``dataset.seed``: its utilities and pairs) is the replicate: each method's runs in a world (its training
seeds) are averaged into that world's estimate, and the interval is the t-interval over the worlds' estimates
(:func:`rewarduq_exp.downstream.statistics.over_worlds_interval`, the same rule as ``over_worlds.csv`` of
``downstream.py``). A difference from the baseline is paired by world: every method of a world is scored on the same
evaluation pairs, so the per-world difference of the seed means is the estimate and its t-interval over the worlds
the interval. With 3 worlds the t-quantile is 4.30: only large differences exclude 0. Runs are grouped by
``dataset.filler_bias`` too when the sweep varies it (a strength of the shortcut is a different world generator).
Prints markdown tables (bold: the interval excludes 0); ``--csv`` writes the long form.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from rewarduq_exp.downstream.statistics import over_worlds_interval
from rewarduq_exp.methods.registry import method_name_of_target

DEFAULT_METRICS = ("win_rate", "ece", "ebce", "rs_0.2", "cf_rate", "truth/margin_coverage", "recal/rs_0.2")


def read_runs(folders: list[Path], metrics: tuple[str, ...]) -> pd.DataFrame:
    """One row per (run, split, metric): method, world, seed, strength, value."""
    rows = []
    for folder in folders:
        for found in sorted(folder.rglob("metrics.json")):
            run = found.parent
            config = run / ".hydra" / "config.yaml"
            if not config.is_file():
                continue
            cfg = OmegaConf.load(config)
            method = method_name_of_target(cfg.method.get("_target_")) or str(cfg.method.get("_target_"))
            strength = cfg.dataset.get("filler_bias", None)
            for split, values in json.loads(found.read_text()).items():
                for metric in metrics:
                    value = values.get(metric)
                    rows.append({"run": str(run), "method": method, "world": int(cfg.dataset.get("seed", 0)),
                                 "seed": int(cfg.seed), "strength": strength, "split": split, "metric": metric,
                                 "value": np.nan if value is None else float(value)})
    if not rows:
        raise SystemExit(f"no finished runs (metrics.json) under {', '.join(map(str, folders))}")
    return pd.DataFrame(rows)


def world_means(runs: pd.DataFrame) -> pd.DataFrame:
    """Each method's seed mean per world (and strength, split, metric)."""
    keys = ["strength", "split", "metric", "method", "world"]
    return (runs.assign(strength=runs.strength.fillna(-1))
            .groupby(keys, sort=True).agg(value=("value", "mean"), seeds=("seed", "nunique")).reset_index())


def over_worlds(means: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Per (strength, split, metric, method): the level over worlds and the paired difference from ``baseline``."""
    rows = []
    for (strength, split, metric), part in means.groupby(["strength", "split", "metric"], sort=True):
        wide = part.pivot(index="world", columns="method", values="value")
        seeds = part.groupby("method").seeds.min()
        for method in wide.columns:
            level = over_worlds_interval(wide[method].to_numpy())
            row = {"strength": strength, "split": split, "metric": metric, "method": method,
                   "worlds": int(wide[method].notna().sum()), "seeds": int(seeds[method]),
                   "level": level.estimate, "level_lo": level.lo, "level_hi": level.hi}
            if baseline in wide.columns and method != baseline:
                diff = over_worlds_interval((wide[method] - wide[baseline]).to_numpy())
                row |= {"vs_baseline": diff.estimate, "vs_lo": diff.lo, "vs_hi": diff.hi}
            rows.append(row)
    return pd.DataFrame(rows)


def _cell(estimate, lo, hi, bold_if_excludes_zero: bool) -> str:
    if not np.isfinite(estimate):
        return "–"
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return f"{estimate:+.3f}" if bold_if_excludes_zero else f"{estimate:.3f}"
    if bold_if_excludes_zero:
        text = f"{estimate:+.3f} [{lo:+.3f}, {hi:+.3f}]"
        return f"**{text}**" if lo > 0 or hi < 0 else text
    return f"{estimate:.3f} [{lo:.3f}, {hi:.3f}]"


def markdown(table: pd.DataFrame, baseline: str, metrics: tuple[str, ...]) -> str:
    out = []
    for (strength, split), part in table.groupby(["strength", "split"], sort=True):
        where = f"{split}" + (f", filler_bias={strength:g}" if strength != -1 else "")
        worlds, seeds = part.worlds.max(), part.seeds.min()
        out.append(f"\n{where} ({worlds} worlds x {seeds}+ seeds; level [95 % t-interval over worlds]):\n")
        out.append("| method | " + " | ".join(metrics) + " |")
        out.append("|---" * (len(metrics) + 1) + "|")
        for method, rows in part.groupby("method", sort=True):
            by = rows.set_index("metric")
            out.append(f"| {method} | " + " | ".join(
                _cell(by.level.get(m, np.nan), by.level_lo.get(m, np.nan), by.level_hi.get(m, np.nan), False)
                for m in metrics) + " |")
        if "vs_baseline" in part:
            out.append(f"\n{where}, paired difference from {baseline} (bold: excludes 0):\n")
            out.append("| method | " + " | ".join(metrics) + " |")
            out.append("|---" * (len(metrics) + 1) + "|")
            for method, rows in part[part.method != baseline].groupby("method", sort=True):
                by = rows.set_index("metric")
                out.append(f"| {method} − {baseline} | " + " | ".join(
                    _cell(by.vs_baseline.get(m, np.nan), by.vs_lo.get(m, np.nan), by.vs_hi.get(m, np.nan), True)
                    for m in metrics) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="sweep folders (outputs/multirun/<name>) or run folders")
    parser.add_argument("--baseline", default="ens_mlp", help="the method every other is compared with (paired)")
    parser.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS), help="keys of metrics.json's splits")
    parser.add_argument("--csv", type=Path, default=None, help="write the long table here")
    args = parser.parse_args(argv)
    metrics = tuple(args.metrics)
    table = over_worlds(world_means(read_runs(args.folders, metrics)), args.baseline)
    if args.csv is not None:
        table.to_csv(args.csv, index=False)
    print(markdown(table, args.baseline, metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
