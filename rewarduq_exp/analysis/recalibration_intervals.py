"""95 % intervals for what recalibration changes: recalibrated minus raw ECE, EBCE, RS_0.2, CT and CF, per method and
evaluated set, over run folders (``scripts/recalibration_table.py --intervals``).

The raw and the recalibrated metric of a run are computed on the same evaluated pairs, so their difference is paired:
a bootstrap draw resamples the pairs once and scores both on that resample. Runs of one row (seeds, or the points of
a sweep) that were evaluated on the same pairs (the same ids) share each draw's resample; runs evaluated on
different pairs get their own resamples. One run: the percentile interval of those draws. Several: Student's t on
the runs' spread plus the pairs' bootstrap variance (:func:`difference_intervals` says why). The interval covers the
sampling of the evaluated pairs and of the runs; the calibration split a run was fitted on is held fixed (it is
part of the run).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf
from scipy.stats import t as t_dist

from rewarduq_exp.analysis.recalibration_report import PAIR_METRICS
from rewarduq_exp.core.bootstrap import percentile_interval
from rewarduq_exp.metrics.scoring import score_predictions
from rewarduq_exp.recalibration import read_calibration
from rewarduq_exp.recalibration.calibration_file import INTERVALS
from rewarduq_exp.recalibration.fit import PREFIX, recalibrated_metrics

DRAWS = 1000


def _metric_cfg(run_dir: Path):
    """The run's own metric settings (its bins and alphas), else the defaults. The run folder may come from anyone:
    its config is read as data (no resolver runs)."""
    from rewarduq_exp.core.foreign_config import read_foreign_config

    config = run_dir / ".hydra" / "config.yaml"
    metric = read_foreign_config(config, "the run's config").get("metric") if config.is_file() else None
    return metric if metric is not None else OmegaConf.create({"n_bins": 20, "alphas": [0.0, 0.2, 1.0],
                                                               "scoring": "pairs"})


def _differences(table: pd.DataFrame, calibration, metric_cfg, rows: list[np.ndarray]) -> np.ndarray:
    """(len(rows), metrics): recalibrated minus raw of each metric on each resample of the table's rows."""
    out = np.empty((len(rows), len(PAIR_METRICS)))
    for i, idx in enumerate(rows):
        sample = table.iloc[idx]
        raw = score_predictions(sample, metric_cfg)
        recal = recalibrated_metrics(sample, calibration, metric_cfg)
        out[i] = [recal[f"{PREFIX}{m}"] - raw[m] for m in PAIR_METRICS]
    return out


def difference_intervals(runs: list[tuple[Path, str]], draws: int = DRAWS, seed: int = 0,
                         interval: str | None = None) -> dict[str, tuple]:
    """``{metric: (mean difference, low, high)}`` over the runs ``(run folder, evaluated set)`` of one table row;
    ``interval``: the row's interval scale where it is not the runs' own (a ``recal@<interval>/`` row)."""
    rng = np.random.default_rng(seed)
    tables, calibrations, configs = [], [], []
    for run_dir, dataset in runs:
        tables.append(pd.read_parquet(run_dir / "predictions" / f"{dataset}.parquet"))
        calibration = read_calibration(run_dir, say_missing=False)
        if interval in INTERVALS and calibration is not None and calibration.interval != interval:
            calibration = calibration.with_interval(interval)
        calibrations.append(calibration)
        configs.append(_metric_cfg(run_dir))
    first_ids = tables[0]["id"].to_numpy() if "id" in tables[0].columns else None
    shared_rows: dict[int, list[np.ndarray]] = {}   # resamples by table size, for runs on the same pairs
    point = np.empty((len(runs), len(PAIR_METRICS)))
    boot = np.empty((len(runs), draws, len(PAIR_METRICS)))
    for r, (table, calibration, cfg) in enumerate(zip(tables, calibrations, configs)):
        n = len(table)
        same_pairs = first_ids is not None and "id" in table.columns and len(table) == len(first_ids)
        if same_pairs:   # the first run's order, so that one resample of indices is one resample of pairs
            order = pd.Series(np.arange(n), index=table["id"].to_numpy())
            same_pairs = order.index.is_unique and set(order.index) == set(first_ids)
            if same_pairs:
                table = table.iloc[order.loc[first_ids].to_numpy()]
        if same_pairs and n in shared_rows:
            rows = shared_rows[n]
        else:
            rows = list(rng.integers(0, n, size=(draws, n)))
            if same_pairs:
                shared_rows[n] = rows
        point[r] = _differences(table, calibration, cfg, [np.arange(n)])[0]
        boot[r] = _differences(table, calibration, cfg, rows)
    mean = point.mean(0)
    if len(runs) == 1:   # the pairs alone: a thousand of them, whose percentile interval is what they say
        low, high = percentile_interval(boot[0])
        return {m: (float(mean[j]), float(low[j]), float(high[j])) for j, m in enumerate(PAIR_METRICS)}
    # Several runs: a resampled mean over 3-5 runs under-covers (its percentile interval uses the normal's quantiles
    # and a run variance shrunk by (R - 1) / R: 0.80 coverage at 3 runs in downstream/interval_coverage.py). So the
    # interval is Student's t on the two parts of the variance: the runs' spread of their own differences (R - 1
    # degrees of freedom) and the pairs' (the bootstrap of the mean over runs, the runs held fixed: many pairs, its
    # degrees of freedom taken as infinite), Satterthwaite's degrees of freedom for the sum. The run-by-pair
    # interaction enters both parts, a little conservative.
    runs_part = point.var(0, ddof=1) / len(runs)
    pairs_part = boot.mean(0).var(0, ddof=1)
    total = runs_part + pairs_part
    with np.errstate(divide="ignore", invalid="ignore"):
        df = np.where(runs_part > 0, total ** 2 * (len(runs) - 1) / runs_part ** 2, np.inf)
    # never narrower than the runs' part alone at R - 1 degrees of freedom (downstream/statistics.py: the pooled
    # degrees of freedom are largest exactly when the runs' spread came out small by chance)
    half = np.maximum(t_dist.ppf(0.975, np.clip(df, 1, None)) * np.sqrt(total),
                      t_dist.ppf(0.975, len(runs) - 1) * np.sqrt(runs_part))
    return {m: (float(mean[j]), float(mean[j] - half[j]), float(mean[j] + half[j])) for j, m in enumerate(PAIR_METRICS)}


def interval_rows(rows: pd.DataFrame, draws: int = DRAWS, seed: int = 0) -> pd.DataFrame:
    """Per (method, training data, evaluated set) of :func:`recalibration_rows`' pairwise rows: the differences
    ``d <metric>`` with ``d <metric> low`` / ``high``."""
    out = []
    pairwise = rows[rows["ece raw"].notna()] if "ece raw" in rows.columns else rows.iloc[:0]
    for (method, train, dataset, interval), group in pairwise.groupby(["method", "train", "dataset", "interval"],
                                                                      sort=True):
        found = difference_intervals([(Path(p), dataset) for p in group["path"]], draws, seed, interval)
        row = {"method": method, "train": train, "dataset": dataset, "interval": interval, "runs": len(group)}
        for m, (d, lo, hi) in found.items():
            row.update({f"d {m}": d, f"d {m} low": lo, f"d {m} high": hi})
        out.append(row)
    return pd.DataFrame(out)


def interval_table(rows: pd.DataFrame) -> str:
    """Markdown: recalibrated minus raw, mean over the row's runs [95 % interval]."""
    if rows.empty:
        return "(no pairwise run with recalibrated metrics and predictions)"
    header = ["method", "train", "eval set", "interval", "runs"] + [f"{m} recal − raw" for m in PAIR_METRICS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, r in rows.iterrows():
        cells = [r["method"], r["train"], r["dataset"], r["interval"], str(r["runs"])]
        cells += [f"{r[f'd {m}']:+.3f} [{r[f'd {m} low']:+.3f}, {r[f'd {m} high']:+.3f}]" for m in PAIR_METRICS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
