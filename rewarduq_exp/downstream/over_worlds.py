"""The effect over worlds: what a finding says about the world generator, not one world.

A world (``dataset.seed``: its utilities, pairs and candidates) is a replicate of the whole study. Every per-world
cell of ``overoptimization.csv`` (one world, method and strength, its seeds pooled), every per-world row of
``selection.csv`` and every per-world Spearman correlation is an estimate of that world's effect; over the worlds
in the run list, the effect of the generator is their mean, with the t-interval over the worlds' estimates
(:func:`~.statistics.over_worlds_interval`: worlds, then runs within a world, then prompts, without estimating
the inner levels). A sentence about "the filler world" rests on these rows; a per-world row is a statement about
one world.

``over_worlds.csv`` (long form): ``table`` (overoptimization, selection, correlation), ``split``, ``method`` (or the
selection rule), the strength axis, ``statistic``, ``worlds`` (how many worlds have it), ``estimate``, ``lo``,
``hi``, ``note`` (why the interval cannot promise its level, if it cannot) and ``per_world``
(``world:value`` for each world). The largest drop over worlds is the largest fall of the mean of the worlds'
curves, with a simultaneous band from the worlds' own differences (:func:`~.statistics.largest_drop_over_worlds`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from rewarduq_exp.analysis.text_tables import fmt_number
from rewarduq_exp.downstream.statistics import largest_drop_over_worlds, over_worlds_interval

# The cells' statistics that are means of paired differences (or levels): their mean over worlds is the effect of
# the generator. The largest drop is a maximum and the Gao peak a ratio: the drop is handled apart, the peak not.
CELL_STATISTICS = (
    "gold_nmax", "gold_nmax_vs_control", "conservative_gain", "conservative_gain_nmax", "optimistic_gain",
    "model_vs_mean", "model_vs_mean_nmax", "knn_vs_mean", "knn_vs_mean_nmax", "filter_vs_mean",
    "filter_vs_mean_nmax", "model_vs_knn", "model_vs_knn_nmax", "model_vs_filter", "model_vs_filter_nmax",
    "conservative_raw_gain", "conservative_cal_gain", "conservative_cal_vs_raw", "conservative_cal_vs_raw_nmax",
    "conservative_conformal_gain", "conservative_conformal_vs_raw", "gao_alpha", "gao_beta")
SELECTION_STATISTICS = ("vs_mean", "vs_best")
COLUMNS = ("table", "split", "method", "strength", "statistic", "worlds", "estimate", "lo", "hi", "note",
           "per_world")


def _row(table: str, split: str, method: str, strength, statistic: str, worlds, values) -> dict:
    values = np.asarray(values, dtype=np.float64)
    found = over_worlds_interval(values)
    shown = ",".join(f"{w}:{fmt_number(v, 3)}" for w, v in zip(worlds, values) if np.isfinite(v))
    return {"table": table, "split": split, "method": method, "strength": strength, "statistic": statistic,
            "worlds": int(np.isfinite(values).sum()), "estimate": found.estimate, "lo": found.lo, "hi": found.hi,
            "note": found.note, "per_world": shown}


def cell_curves(summary: pd.DataFrame, per_prompt: dict, axis: str) -> dict:
    """Each cell's mean-selection curve (mean over its runs and prompts), keyed as the cell's row."""
    out = {}
    for key, part in summary.groupby(["split", "world", "method", axis], sort=True):
        picks = [per_prompt[(run, key[0])][("mean", 0.0)] for run in part.run]
        out[key] = np.mean([p.mean(0) for p in picks], axis=0)
    return out


def over_worlds_rows(overopt: pd.DataFrame, summary: pd.DataFrame, per_prompt: dict, axis: str,
                     selection: pd.DataFrame | None = None, correlation: pd.DataFrame | None = None) -> pd.DataFrame:
    """``over_worlds.csv``'s rows (the module's docstring) of the per-world tables."""
    rows = []
    curves = cell_curves(summary, per_prompt, axis)
    for (split, method, strength), part in overopt.groupby(["split", "method", axis], sort=True):
        part = part.sort_values("world")
        worlds = part.world.tolist()
        drop = largest_drop_over_worlds(np.stack([curves[(split, w, method, strength)] for w in worlds]))
        rows.append({"table": "overoptimization", "split": split, "method": method, "strength": strength,
                     "statistic": "largest_drop", "worlds": len(worlds), "estimate": drop["drop"], "lo": drop["lo"],
                     "hi": drop["hi"], "note": drop["note"],
                     "per_world": ",".join(f"{w}:{fmt_number(v, 3)}" for w, v in zip(worlds, part.largest_drop))})
        for statistic in CELL_STATISTICS:
            if statistic in part and part[statistic].notna().any():
                rows.append(_row("overoptimization", split, method, strength, statistic, worlds,
                                 part[statistic].to_numpy(float)))
    if selection is not None and not selection.empty:
        for (split, rule), part in selection.groupby(["split", "rule"], sort=True):
            part = part.sort_values("world")
            for statistic in SELECTION_STATISTICS:
                if statistic in part and pd.to_numeric(part[statistic], errors="coerce").notna().any():
                    rows.append(_row("selection", split, rule, np.nan, statistic, part.world.tolist(),
                                     pd.to_numeric(part[statistic], errors="coerce").to_numpy(float)))
    if correlation is not None and not correlation.empty:
        for (split, downstream, metric), part in correlation.groupby(["split", "downstream", "run_metric"],
                                                                     sort=True):
            part = part.sort_values("world")
            if part.spearman.notna().any():
                rows.append(_row("correlation", split, "all", np.nan, f"spearman({metric}, {downstream})",
                                 part.world.tolist(), part.spearman.to_numpy(float)))
    return pd.DataFrame(rows).reindex(columns=list(COLUMNS))


def worlds_per_cell(summary: pd.DataFrame, axis: str) -> pd.Series:
    """For every row of ``summary`` (or of a cell table): how many worlds of the study share its split, method and
    strength, the worlds its over-world effect pools."""
    return summary.groupby(["split", "method", axis], sort=False).world.transform("nunique").astype(int)


# The statistics the printed lines give, with their names in the text
PRINTED = (("gold_nmax_vs_control", "shortcut cost at n_max"), ("largest_drop", "largest drop"),
           ("model_vs_mean", "r - k u, fair k"), ("knn_vs_mean", "k-NN distance"), ("filter_vs_mean", "filter"),
           ("model_vs_knn", "r - k u vs k-NN"), ("gao_beta", "Gao beta"))


def _fmt(row) -> str:
    text = f"{fmt_number(row.estimate, 2)} [{fmt_number(row.lo, 2)}, {fmt_number(row.hi, 2)}]"
    return f"{text} (no level promised: {row.note})" if row.note else text


def over_worlds_lines(rows: pd.DataFrame, axis: str) -> list[str]:
    """Per split, method and strength: the effect over worlds of the printed statistics; per split and rule: the
    selection rule's pick against the mean run."""
    lines = []
    if rows.empty:
        return lines
    cells = rows[rows.table == "overoptimization"]
    for (split, method, strength), part in cells.groupby(["split", "method", "strength"], sort=True):
        found = {r.statistic: r for r in part.itertuples()}
        worlds = int(part.worlds.max())
        shown = [f"{label} {_fmt(found[name])}" for name, label in PRINTED if name in found]
        lines.append(f"{split} {method} {axis}={strength:g}, over {worlds} world{'s' if worlds != 1 else ''}: "
                     + "; ".join(shown))
    for r in rows[(rows.table == "selection") & (rows.statistic == "vs_mean")].itertuples():
        lines.append(f"{r.split} selection rule ({r.method}) over {r.worlds} worlds: its pick's gold at n_max minus "
                     f"the mean run's {_fmt(r)}")
    return lines
