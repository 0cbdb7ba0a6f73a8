"""Which run the paper's selection rule picks among the runs of one world, and where that run stands downstream: the
rule on the runs' raw metrics and on their recalibrated ones (``recal/<metric>``, fitted on each run's calibration
split), side by side, on the same runs, prompts and picks.

The rule (:class:`~rewarduq_exp.analysis.selection.Criteria`): keep the runs with ECE <= 0.05 and EBCE <= 0.01 on
the split's evaluation block of their ``metrics.json``, then take the highest RS_0.2 (no run kept: the highest of
all, said in the line). The recalibrated rule applies the same thresholds and ranking to ``recal/ece``,
``recal/ebce`` and ``recal/rs_0.2``; a run without them (trained before recalibration existed) never passes. A third
rule keeps the paper's filter on the raw metrics and ranks by ``recal/rs_0.2``: recalibration can let nearly every
run pass the thresholds, which then filter nothing, and this rule separates that from the change of ranking. Each
row counts the runs passing each threshold on the metrics it filters on (``passing_ece``, ``passing_ebce``;
``passing``: both, among those with the rank metric), so the raw and the recalibrated rows together say what each
filter kept.

Downstream, a run's standing is its gold at n_max under mean selection (which a recalibration never changes: T > 0
keeps the order of r), ranked among the runs of the world. With the runs' per-prompt picks, two paired differences
per prompt at n_max, each with its 95 % interval over prompts (:func:`~.statistics.paired_interval`; ``not_promised``
names the ones that cannot promise their level):
the pick minus the mean over the runs (``vs_mean``: does the rule beat a run taken at random?) and the pick minus
the best run (``vs_best``: 0 when the rule picks it). The best run is the one with the highest gold on these same
prompts, so ``vs_best`` leans against the pick (winner's curse): a measure of how far the pick falls short, not a
test.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from rewarduq_exp.analysis.selection import Criteria
from rewarduq_exp.downstream.statistics import DRAWS, paired_interval

RULES = (Criteria(), Criteria(filter_on="recalibrated", rank_on="recalibrated"),
         Criteria(filter_on="raw", rank_on="recalibrated"))
COLUMNS = ("split", "world", "rule", "filter_on", "rank_on", "criteria", "runs", "passing_ece", "passing_ebce",
           "passing", "picked", "rank", "best", "picked_gold_nmax", "best_gold_nmax", "vs_mean", "vs_mean_lo",
           "vs_mean_hi", "vs_best", "vs_best_lo", "vs_best_hi", "not_promised", "same_as_raw")
PAPER = Criteria()


def rule_name(criteria: Criteria) -> str:
    """``raw`` (the paper's rule), ``recalibrated`` (both on recal/), else ``<filter>-filter-<rank>-rank``."""
    if criteria.filter_on == criteria.rank_on:
        return criteria.filter_on
    return f"{criteria.filter_on}-filter-{criteria.rank_on}-rank"


def _rule_words(row) -> str:
    """What follows the split in a printed line: nothing for the paper's rule."""
    if row["filter_on"] == row["rank_on"]:
        return "" if row["filter_on"] == "raw" else f", {row['filter_on']} metrics"
    return f", {row['filter_on']} filter, {row['rank_on']} rank"


def selection_row(summary: pd.DataFrame, split: str, criteria: Criteria, per_prompt: dict | None = None,
                  draws: int = DRAWS, seed: int = 0) -> dict | None:
    """The pick of ``criteria`` among the runs of ``summary`` (one world's) on ``split`` and its standing (see the
    module's docstring); None when no run was measured on the split, ``picked`` None when none has the rank
    metric."""
    s = summary[summary.split == split]
    if s.empty:
        return None
    ece, ebce, rank = (criteria.key(m) for m in ("ece", "ebce", criteria.rank))
    values = {key: s[key] if key in s else pd.Series(np.nan, index=s.index) for key in (ece, ebce, rank)}
    row = {"split": split, "rule": rule_name(criteria), "filter_on": criteria.filter_on, "rank_on": criteria.rank_on,
           "runs": len(s), "picked": None,
           "criteria": f"{ece} <= {criteria.ece:g}, {ebce} <= {criteria.ebce:g}, best {rank}"}
    if values[rank].isna().all():
        return row
    ranked_ok = values[rank].notna()
    # NaN compares False: a run without the filter's metrics passes neither threshold.
    pass_ece, pass_ebce = values[ece] <= criteria.ece, values[ebce] <= criteria.ebce
    passing = s[pass_ece & pass_ebce & ranked_ok]
    pool = passing if not passing.empty else s[ranked_ok]
    picked = pool.loc[values[rank][pool.index].idxmax()]
    ranked = s.sort_values("gold_nmax", ascending=False, kind="stable").run.tolist()
    best = s[s.run == ranked[0]].iloc[0]
    row.update(passing_ece=int(pass_ece.sum()), passing_ebce=int(pass_ebce.sum()), passing=len(passing),
               picked=picked.run, rank=ranked.index(picked.run) + 1, best=best.run,
               picked_gold_nmax=float(picked.gold_nmax), best_gold_nmax=float(best.gold_nmax))
    if per_prompt is not None and len(s) > 1:
        at_nmax = {run: per_prompt[(run, split)][("mean", 0.0)][:, -1] for run in s.run}
        mine = at_nmax[picked.run]
        for name, other in (("vs_mean", np.mean(list(at_nmax.values()), axis=0)), ("vs_best", at_nmax[best.run])):
            estimate, lo, hi, note = paired_interval(mine - other, draws, seed)
            if note:
                row["not_promised"] = "; ".join(filter(None, [row.get("not_promised", ""), f"{name}: {note}"]))
            row.update({name: estimate, f"{name}_lo": lo, f"{name}_hi": hi})
    return row


def selection_rows(summary: pd.DataFrame, splits, per_prompt: dict | None = None, draws: int = DRAWS,
                   seed: int = 0) -> pd.DataFrame:
    """:func:`selection_row` of each of :data:`RULES`, per split and world (runs of different worlds meet different
    candidates and oracles, so their gold is not ranked together): selection.csv's rows, with ``same_as_raw`` on
    the rules other than the paper's."""
    rows = []
    for split in splits:
        for world, part in summary[summary.split == split].groupby("world", sort=True):
            raw = None
            for criteria in RULES:
                row = selection_row(part, split, criteria, per_prompt, draws, seed)
                if row is None:
                    continue
                row["world"] = world
                if criteria == PAPER:
                    raw = row
                else:
                    row["same_as_raw"] = (raw is not None and row["picked"] is not None
                                          and row["picked"] == raw["picked"])
                rows.append(row)
    return pd.DataFrame(rows).reindex(columns=list(COLUMNS))


def _interval(row, name: str) -> str:
    return f"{row[name]:+.3f} [{row[f'{name}_lo']:+.3f}, {row[f'{name}_hi']:+.3f}]"


def selection_line(row, several_worlds: bool = False) -> str:
    """One printed line of a :func:`selection_rows` row."""
    where = f" world={row['world']}" if several_worlds else ""
    head = f"{row['split']}{where}{_rule_words(row)}"
    paper = row["rule"] == rule_name(PAPER)
    if row["picked"] is None or pd.isna(row["picked"]):
        what = row["criteria"].rsplit("best ", 1)[-1]
        recal = "recalibrated" in (row["filter_on"], row["rank_on"])
        return (f"{head}: the runs have no {what} on this split; no selection to check"
                + (" (trained before recalibration existed, or with recalibrate.enabled=false)" if recal else ""))
    note = "" if row["passing"] > 0 else f" (no run passes {row['criteria'].rsplit(', best', 1)[0]}: ranked all)"
    line = f"{head}: the selection rule picks {row['picked']}{note}; {_passing_words(row)}"
    line += f"; downstream it ranks {int(row['rank'])} of {int(row['runs'])} (best: {row['best']})"
    if pd.notna(row.get("vs_mean", np.nan)):
        line += (f"; its gold at n_max minus the mean over the {int(row['runs'])} runs: {_interval(row, 'vs_mean')}, "
                 f"minus the best run's: {_interval(row, 'vs_best')} (95 %, prompts resampled)")
    if not paper:
        line += "; the same run as the raw rule's" if row["same_as_raw"] else "; not the raw rule's pick"
    return line


def _passing_words(row) -> str:
    """How many runs each threshold kept, on the metrics the rule filters on, and whether the filter decided."""
    ece, ebce = row["criteria"].split(", ")[:2]  # "ece <= 0.05", "ebce <= 0.01" (or recal/ece ...)
    runs = int(row["runs"])
    words = (f"passing {ece}: {int(row['passing_ece'])} of {runs}, {ebce}: {int(row['passing_ebce'])} of {runs}, "
             f"both: {int(row['passing'])}")
    if row["filter_on"] == "raw":
        words += " (filtered on raw metrics, as the paper does)"
    else:
        words += f" (filtered on {row['filter_on']} metrics)"
    if runs > 1 and int(row["passing"]) == runs:
        words += "; every run passes, so the thresholds filter nothing and the pick is the ranking's alone"
    return words


def selection_check_lines(table: pd.DataFrame) -> list[str]:
    several = table.world.nunique() > 1 if not table.empty else False
    return [selection_line(row, several) for _, row in table.iterrows()]
