"""The strength of a world's shortcut as a sweep axis: how far each method's best-of-n gold falls after its peak, per
strength, against the spread over its runs (the seeds of a sweep; in a hyperparameter sweep, its points).

The acceptance question of a world built to overoptimize is "a measured peak followed by a fall larger than its seed
spread". Here the fall is ``fall_after_peak`` (gold at the peak minus the lowest gold at any n from the peak on, mean
over the runs) and the seed spread is the range over the runs of that lowest gold (the trough): a fall within it could
be one run's luck.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from rewarduq_exp.analysis.text_tables import fmt_number

# The world's shortcut settings each run records (dataset.<key>), and its own seed.
WORLD_SETTINGS = ("filler_bias", "length_bias", "candidate_filler_share")
STRENGTHS = ("filler_bias", "length_bias")  # the settings that can be the strength axis, in order of preference


def world_settings(config) -> dict:
    """A run's shortcut settings (``dataset.<key>``, 0 when its world predates them) and its ``seed``."""
    out = {key: float(config.dataset.get(key) or 0.0) for key in WORLD_SETTINGS}
    out["seed"] = int(config.get("seed") or 0)
    return out


def strength_axis(summary: pd.DataFrame) -> str:
    """The bias setting the runs vary (the first of :data:`STRENGTHS` that takes more than one value; filler_bias
    when none does)."""
    return next((key for key in STRENGTHS if summary[key].nunique() > 1), STRENGTHS[0])


def overoptimization_table(summary: pd.DataFrame, axis: str) -> pd.DataFrame:
    """Per split, method and strength (``axis``): ``runs`` (and how many ``seeds`` among them), the mean
    ``gold_best``, ``best_n`` and ``trough_n`` per run (joined), the mean ``fall_after_peak`` and its smallest value,
    ``seed_spread`` (range over the runs of the trough gold) and ``exceeds`` (the mean fall is larger than the
    spread, with at least two runs)."""
    def join(values) -> str:
        return ",".join(str(int(v)) for v in values)

    grouped = summary.groupby(["split", "method", axis], sort=False)
    table = grouped.agg(runs=("seed", "size"), seeds=("seed", "nunique"), gold_best=("gold_best", "mean"),
                        best_n=("best_n", join),
                        trough_n=("trough_n", join), fall_after_peak=("fall_after_peak", "mean"),
                        fall_min=("fall_after_peak", "min"), seed_spread=("gold_trough", np.ptp)).reset_index()
    table["exceeds"] = (table.runs >= 2) & (table.fall_after_peak > table.seed_spread)
    return table.sort_values(["split", "method", axis], kind="stable", ignore_index=True)


def overoptimization_lines(table: pd.DataFrame, axis: str) -> list[str]:
    """One line per split, method and strength: the peak, the fall after it and whether it exceeds the spread over
    the runs."""
    lines = []
    for _, row in table.iterrows():
        if row.runs < 2:
            verdict = "one run: no spread to compare with"
        else:
            verdict = "the fall exceeds the spread" if row.exceeds else "the fall does NOT exceed the spread"
        lines.append(f"{row.split} {row.method} {axis}={row[axis]:g} ({row.runs} runs, {row.seeds} seeds): peak gold "
                     f"{fmt_number(row.gold_best, 3)} at n={row.best_n}, fall after it "
                     f"{fmt_number(row.fall_after_peak, 3)} (smallest {fmt_number(row.fall_min, 3)}) to the trough at "
                     f"n={row.trough_n}; spread (range of the trough gold over the runs) "
                     f"{fmt_number(row.seed_spread, 3)}: {verdict}")
    return lines
