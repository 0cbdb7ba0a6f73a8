"""How large must a calibration split be before recalibration's probability map stops making the probabilities of
new pairs worse? (``scripts/calibration_size_table.py``; the measurement in docs/recalibration.md.)

From each run's raw scores of a large calibration split and of an eval split, draw many calibration subsets of each
size (without replacement), fit the probability map on each exactly as a run does
(:func:`~rewarduq_exp.recalibration.fit.fit_probability_map`: temperature, its guards, isotonic where chosen), and
score the eval pairs: eval ECE after the map minus the raw eval ECE. Two versions of the map are compared on the
same subsets: ``before`` (plain maximum-likelihood T, no check, isotonic wherever its cross-fitted Brier score is
lower at all: the map before the guards existed) and ``after`` (the defaults of ``recalibrate``).

The statistics (:func:`size_summary`): a run's draws share its raw eval ECE and its calibration pool, so they are
paired against that ECE and are not independent replicates of the effect; they are averaged within the run first
(draw noise then is small next to the spread between runs). The run is the unit of replication (its training seed
gives another model), so the interval is the paired t-interval over the runs' mean differences, t with runs - 1
degrees of freedom (scipy's ``ttest_1samp(...).confidence_interval``: the interval of
:func:`rewarduq_exp.downstream.statistics.paired_t_interval`, which this layer may not import). A bootstrap over runs
would be too narrow with the handful of runs a table has (4 runs have 35 distinct resamples, and percentile
intervals of few runs under-cover); the t-interval is honest about few runs at the price of assuming the runs'
means roughly normal. What it does not cover: the eval pairs and the world are shared by the runs of a row (fixed),
so the interval is about models trained on this world, scored on these pairs. The share of draws made worse is
pooled over the draws of all the row's runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from scipy.special import expit
from scipy.stats import ttest_1samp

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics.calibration import bin_index
from rewarduq_exp.metrics.preference import check_n_bins, pairs_from_table
from rewarduq_exp.recalibration.fit import fit_probability_map, recalibrate_settings

SIZES = (20, 50, 100, 200, 500, 1000, 2000)
LEVEL = 0.95
# The map before the guards (maximum-likelihood T, no cross-fitted check, isotonic wherever its cross-fitted Brier
# score is lower at all) and with the defaults.
VARIANTS = {"before": {"temperature_prior_sd": None, "temperature_check": False, "isotonic_z": 0.0}, "after": {}}


def batched_ece(p: np.ndarray, weight=None, n_bins: int = 20) -> np.ndarray:
    """ECE (paper eq. 7, symmetrised, ``n_bins`` equal-width bins) of each row of probabilities ``p`` (D, N) that the
    first response is preferred (every label 1), as :func:`~rewarduq_exp.metrics.calibration.calibration_metrics`
    computes it for one row (tests/test_calibration_size.py), in one pass of bincounts over all D rows.

    With the flipped rows (1 - p, label 0) each bin's weighted |accuracy - confidence| times its share is
    |sum w y - sum w q| / total weight, so no division by bin weights is needed."""
    p = np.atleast_2d(np.asarray(p, dtype=float))
    n_bins = check_n_bins(n_bins)
    rows, n = p.shape
    w = np.ones(n) if weight is None else np.asarray(weight, dtype=float)
    q = np.concatenate([p, 1.0 - p], axis=1)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    b = bin_index(q.ravel(), edges).reshape(q.shape) + n_bins * np.arange(rows)[:, None]
    ww = np.broadcast_to(np.concatenate([w, w]), q.shape)
    swq = np.bincount(b.ravel(), weights=(ww * q).ravel(), minlength=rows * n_bins).reshape(rows, n_bins)
    swy = np.bincount(b.ravel(), weights=np.broadcast_to(np.concatenate([w, np.zeros(n)]), q.shape).ravel(),
                      minlength=rows * n_bins).reshape(rows, n_bins)
    return np.abs(swy - swq).sum(axis=1) / (2.0 * w.sum())


def margins(table: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(chosen minus rejected reward, weight) of a pairwise predictions table."""
    chosen, rejected, weight = pairs_from_table(table)
    return chosen[:, 0] - rejected[:, 0], weight


def size_differences(cal_margin, cal_weight, eval_margin, eval_weight, sizes=SIZES, draws: int = 200,
                     seed: int = 0, variants: dict | None = None, n_bins: int = 20) -> pd.DataFrame:
    """One row per (variant, size, draw): ``diff`` = eval ECE after the map fitted on that draw's calibration
    subset minus the raw eval ECE, with the fitted ``temperature`` and whether the map is ``isotonic``. Every
    variant meets the same subsets (paired across variants too)."""
    variants = VARIANTS if variants is None else variants
    cal_margin, eval_margin = np.asarray(cal_margin, float), np.asarray(eval_margin, float)
    pool = len(cal_margin)
    too_large = [n for n in sizes if not 1 <= n <= pool]
    if too_large:
        raise UserError(f"calibration sizes {too_large} are not in 1..{pool} (the run's calibration pairs): pass "
                        "--sizes within that, or score a larger calibration split (dataset.n_cal)")
    settings = {name: recalibrate_settings(change) for name, change in variants.items()}
    rng = np.random.default_rng(seed)
    raw = batched_ece(expit(eval_margin)[None, :], eval_weight, n_bins)[0]
    out = []
    for n in sizes:
        # draws subsets without replacement at once: the first n of each row's random order
        subsets = np.argsort(rng.random((draws, pool)), axis=1)[:, :n]
        for name, chosen in settings.items():
            # one fit per subset: the map is fitted exactly as a run fits it (a scalar search and cross-fitting per
            # subset, which does not vectorise); the eval ECE of all subsets is one batched pass
            probs = np.empty((draws, len(eval_margin)))
            temps, iso = np.empty(draws), np.zeros(draws, bool)
            for d, rows in enumerate(subsets):
                t, isotonic, _ = fit_probability_map(cal_margin[rows], np.asarray(cal_weight, float)[rows], chosen)
                p = expit(eval_margin / t)
                probs[d] = isotonic(p) if isotonic is not None else p
                temps[d], iso[d] = t, isotonic is not None
            diff = batched_ece(probs, eval_weight, n_bins) - raw
            out.append(pd.DataFrame({"variant": name, "size": n, "draw": np.arange(draws), "diff": diff,
                                     "temperature": temps, "isotonic": iso, "raw_ece": raw}))
    return pd.concat(out, ignore_index=True)


def run_differences(run_dir: Path, cal: str, evaluated: str, **kwargs) -> pd.DataFrame:
    """:func:`size_differences` of one run folder from its raw ``predictions/<cal>.parquet`` and
    ``predictions/<evaluated>.parquet``."""
    tables = {}
    for name in (cal, evaluated):
        path = Path(run_dir) / "predictions" / f"{name}.parquet"
        if not path.is_file():
            raise UserError(f"{path} is missing: score the split first, e.g. python evaluate.py run={run_dir} "
                            f"'eval_datasets=[{name}]' recalibrated=false")
        tables[name] = pd.read_parquet(path)
    return size_differences(*margins(tables[cal]), *margins(tables[evaluated]), **kwargs)


def size_summary(per_draw: pd.DataFrame) -> pd.DataFrame:
    """Per (group, variant, size) over the group's runs: the mean difference with its paired t-interval over the
    runs' means (``low``, ``high``), the number of runs, the share of draws made worse (pooled) and the median T.
    ``per_draw`` needs the columns of :func:`size_differences` plus ``group`` and ``run``."""
    per_run = per_draw.groupby(["group", "variant", "size", "run"], sort=False)["diff"].mean().reset_index()
    rows = []
    for (group, variant, size), part in per_run.groupby(["group", "variant", "size"], sort=False):
        means = part["diff"].to_numpy()
        low = high = np.nan   # one run: no interval over runs
        if len(means) > 1:
            interval = ttest_1samp(means, 0.0).confidence_interval(LEVEL)
            low, high = float(interval.low), float(interval.high)
        draws = per_draw[(per_draw["group"] == group) & (per_draw["variant"] == variant) & (per_draw["size"] == size)]
        rows.append({"group": group, "variant": variant, "size": int(size), "runs": len(means),
                     "mean": float(means.mean()), "low": low, "high": high,
                     "worse": float((draws["diff"] > 0).mean()), "median_t": float(draws["temperature"].median()),
                     "isotonic": float(draws["isotonic"].mean()), "raw_ece": float(draws["raw_ece"].mean())})
    return pd.DataFrame(rows)


def size_table(summary: pd.DataFrame) -> str:
    """Markdown: per group and size, before and after side by side (mean [95 % interval], share of draws worse)."""
    if summary.empty:
        return "(no runs)"
    variants = list(dict.fromkeys(summary["variant"]))
    header = ["runs", "pairs", "raw ECE"]
    for v in variants:
        header += [f"ECE change {v} [95 %]", f"worse {v}", f"median T {v}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (group, size), part in summary.groupby(["group", "size"], sort=False):
        by = part.set_index("variant")
        first = by.iloc[0]
        cells = [f"{group} ({int(first['runs'])})", str(int(size)), f"{first['raw_ece']:.3f}"]
        for v in variants:
            r = by.loc[v]
            interval = f" [{r['low']:+.4f}, {r['high']:+.4f}]" if np.isfinite(r["low"]) else ""
            cells += [f"{r['mean']:+.4f}{interval}", f"{r['worse']:.2f}",
                      f"{r['median_t']:.2f}" + (f" ({r['isotonic']:.0%} iso)" if r["isotonic"] > 0 else "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
