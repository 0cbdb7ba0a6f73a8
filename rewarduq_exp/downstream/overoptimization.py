"""Does best-of-n overoptimize, and does uncertainty help: per run and per cell of runs, with paired intervals.

A cell is the runs of one world (``dataset.seed``), method and shortcut strength: its training seeds. Runs of
different worlds are never pooled (their candidates and oracles differ); a world is a replicate of the whole
study, and the lines printed say in how many worlds a finding holds.

Per run (over its prompts) and per cell (runs and prompts crossed: :mod:`.statistics`), each interval with a
``not_promised`` column naming the intervals of the row that cannot promise their level and why:
- ``largest_drop`` [``_lo``, ``_hi``]: the largest fall of the mean-selection curve from any n to a later one;
  ``overoptimizes`` when the interval's lower end is above 0 (a fall the prompts and seeds cannot explain);
- ``conservative_gain`` / ``optimistic_gain`` (mean gold gained over the KL range by r -+ k u, k = task.k_compare
  in the run's own unit) and ``conservative_gain_nmax`` (at the largest n), each a paired difference;
- Gao et al.'s form gold(d) - gold(0) = d (alpha - beta d), d = sqrt(KL): ``gao_alpha``, ``gao_beta``, the fitted
  peak ``gao_kl_peak`` (KL = d*^2; inf: the fit never turns down) and ``gao_gold_peak`` (gold at n = 1 plus the peak
  gain), with intervals, and ``gao_r2``;
- the fair use of u (:mod:`.uncertainty_use`), on the report prompts only: ``<rule>_vs_<baseline>`` (area) and
  ``..._nmax`` for rule in model (r - k u_std, k chosen on the selection prompts), knn, filter, with intervals, and
  the chosen ``k_model`` / ``k_knn`` per run;
- where every run was scored through its recalibration, the calibrated interval scale in best-of-n
  (:mod:`.calibrated_scale`): ``conservative_cal_gain`` (r - k s u vs mean), ``conservative_cal_vs_raw`` (vs
  r - k u), the conformal scale's ``conservative_conformal_gain`` / ``_vs_raw``, ``conservative_raw_gain``, each
  also ``_nmax``, with intervals; and the runs' ``cal_temperature``, ``cal_interval``, ``cal_scale``,
  ``cal_scale_conformal`` (joined per run in a cell, as ``k_model``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from rewarduq_exp.analysis.text_tables import fmt_number
from rewarduq_exp.downstream.best_of_n import area_weights
from rewarduq_exp.downstream.calibrated_scale import calibrated_statistics, calibration_columns
from rewarduq_exp.downstream.statistics import (
    Interval,
    cell_difference_interval,
    gao_fit_interval,
    largest_drop_interval,
    paired_interval,
)
from rewarduq_exp.downstream.uncertainty_use import COMPARISONS

# The world's shortcut settings each run records (dataset.<key>), its world (dataset.seed) and its own seed.
WORLD_SETTINGS = ("filler_bias", "length_bias", "candidate_filler_share")
STRENGTHS = ("filler_bias", "length_bias")  # the settings that can be the strength axis, in order of preference
CELL = ("split", "world", "method")          # plus the strength axis


def world_settings(config) -> dict:
    """A run's shortcut settings (``dataset.<key>``, 0 when its world predates them), its ``world`` (the dataset's
    seed: which utilities, candidates and pairs) and its ``seed`` (the model's initialisation)."""
    out = {key: float(config.dataset.get(key) or 0.0) for key in WORLD_SETTINGS}
    out["world"] = int(config.dataset.get("seed") or 0)
    out["seed"] = int(config.get("seed") or 0)
    return out


def strength_axis(summary: pd.DataFrame) -> str:
    """The bias setting the runs vary (the first of :data:`STRENGTHS` that takes more than one value; filler_bias
    when none does)."""
    return next((key for key in STRENGTHS if summary[key].nunique() > 1), STRENGTHS[0])


def _interval(prefix: str, found: Interval, notes: dict) -> dict:
    """The columns ``prefix``, ``_lo``, ``_hi`` of an interval; its note (why it cannot promise its level), if any,
    goes into ``notes`` under ``prefix``."""
    if found.note:
        notes[prefix] = found.note
    return {prefix: found.estimate, f"{prefix}_lo": found.lo, f"{prefix}_hi": found.hi}


def notes_column(notes: dict) -> str:
    """``not_promised``: the statistics of a row whose interval cannot promise its level, each with why
    (``name: why; name: why``); empty when every interval can."""
    return "; ".join(f"{name}: {why}" for name, why in notes.items())


def paired_statistics(picked: list[dict], kl: np.ndarray, ns, k_compare: float, draws: int, seed: int) -> dict:
    """The statistics of the module docstring for the runs ``picked`` (one dict per run: ``{(selection, k): gold of
    the pick (P, J)}`` plus ``"use"``: :func:`~.uncertainty_use.use_curves`' dict), pooled: R runs sharing P
    prompts."""
    def stack(key) -> np.ndarray:
        return np.stack([p[key] for p in picked])                  # (R, P, J)

    weights, notes = area_weights(kl), {}
    mean = stack(("mean", 0.0))
    drop = largest_drop_interval(mean, draws, seed)
    out = {**_interval("largest_drop", Interval(drop["drop"], drop["lo"], drop["hi"], drop["note"]), notes),
           "overoptimizes": bool(drop["lo"] > 0), "drop_from_n": int(ns[drop["from_index"]]),
           "drop_to_n": int(ns[drop["to_index"]])}
    for name in ("conservative", "optimistic"):
        diff = stack((name, float(k_compare))) - mean
        out.update(_interval(f"{name}_gain", paired_interval(diff @ weights, draws, seed), notes))
        if name == "conservative":
            out.update(_interval(f"{name}_gain_nmax", paired_interval(diff[..., -1], draws, seed), notes))
    out.update(calibrated_statistics(picked, kl, k_compare, draws, seed, notes))
    fit = gao_fit_interval(np.sqrt(kl), mean, draws, seed)
    if fit["note"]:
        notes["gao_beta"] = fit["note"]
    gold_n1 = float(mean[..., 0].mean())
    out.update({"gao_alpha": fit["alpha"], "gao_alpha_lo": fit["alpha_lo"], "gao_alpha_hi": fit["alpha_hi"],
                "gao_beta": fit["beta"], "gao_beta_lo": fit["beta_lo"], "gao_beta_hi": fit["beta_hi"],
                "gao_kl_peak": fit["d_peak"] ** 2, "gao_kl_peak_lo": fit["d_peak_lo"] ** 2,
                "gao_kl_peak_hi": fit["d_peak_hi"] ** 2, "gao_gold_peak": gold_n1 + fit["gain_peak"],
                "gao_gold_peak_lo": gold_n1 + fit["gain_peak_lo"], "gao_gold_peak_hi": gold_n1 + fit["gain_peak_hi"],
                "gao_r2": fit["r2"]})
    uses = [p["use"] for p in picked if p.get("use")]
    if len(uses) == len(picked) and uses:
        for key in ("k_model", "k_knn"):
            if all(key in use for use in uses):
                out[key] = ",".join(f"{use[key]:g}" for use in uses)
        for rule, base in COMPARISONS:
            if all(rule in use and base in use for use in uses):
                diff = np.stack([use[rule] - use[base] for use in uses])   # (R, P_report, J)
                name = f"{rule}_vs_{base}"
                out.update(_interval(name, paired_interval(diff @ weights, draws, seed), notes))
                out.update(_interval(f"{name}_nmax", paired_interval(diff[..., -1], draws, seed), notes))
        out["report_prompts"] = int(len(uses[0]["report_prompts"]))
    out["not_promised"] = notes_column(notes)
    return out


def overoptimization_table(summary: pd.DataFrame, per_prompt: dict, axis: str, kl: np.ndarray, ns,
                           k_compare: float, draws: int, seed: int) -> pd.DataFrame:
    """One row per split, world, method and strength (``axis``): ``runs``, ``seeds``, the mean ``gold_best`` /
    ``gold_nmax``, the runs' ``best_n`` (joined), :func:`paired_statistics` over the cell's runs, and where the world
    has a control (the same method at strength 0) ``gold_nmax_vs_control`` [``_lo``, ``_hi``]: what the shortcut
    costs at n_max (:func:`~.statistics.cell_difference_interval`: the prompts are shared, the runs are not).
    ``per_prompt[(run, split)]`` holds each run's per-prompt picks."""
    rows, at_nmax = [], {}
    for key, part in summary.groupby([*CELL, axis], sort=True):
        picked = [per_prompt[(run, key[0])] for run in part.run]
        at_nmax[key] = np.stack([p[("mean", 0.0)][:, -1] for p in picked])   # (runs, prompts)
        rows.append({**dict(zip([*CELL, axis], key)), "runs": len(part), "seeds": int(part.seed.nunique()),
                     "gold_best": float(part.gold_best.mean()), "gold_nmax": float(part.gold_nmax.mean()),
                     "best_n": ",".join(str(int(v)) for v in part.best_n),
                     **paired_statistics(picked, kl, ns, k_compare, draws, seed),
                     **calibration_columns(picked, joined=True)})
    for row, key in zip(rows, at_nmax):
        control = (*key[:3], 0.0)
        if key[3] != 0 and control in at_nmax:
            notes = {}
            row.update(_interval("gold_nmax_vs_control",
                                 cell_difference_interval(at_nmax[key], at_nmax[control], draws, seed), notes))
            row["not_promised"] = "; ".join(filter(None, [row["not_promised"], notes_column(notes)]))
    return pd.DataFrame(rows)


def format_interval(row, name: str, digits: int = 2) -> str:
    """``row[name] [row[name_lo], row[name_hi]]``; "-" where the row has no such value."""
    if name not in row or not np.isfinite(row[name]):
        return "-"
    return (f"{fmt_number(row[name], digits)} [{fmt_number(row[f'{name}_lo'], digits)}, "
            f"{fmt_number(row[f'{name}_hi'], digits)}]")


def overoptimization_lines(table: pd.DataFrame, axis: str) -> list[str]:
    """One line per cell (its largest drop and gains with 95 % intervals), then per split, method and strength: in
    how many worlds the cell overoptimizes."""
    lines = []
    swept = table[axis].nunique() > 1 or bool((table[axis] != 0).any())  # a world without the shortcut: no axis

    def strength(value) -> str:
        return f" {axis}={value:g}" if swept else ""

    for _, row in table.iterrows():
        verdict = "overoptimizes" if row.overoptimizes else "no fall the data can show"
        where = (f" from n={row.drop_from_n} to n={row.drop_to_n}" if row.largest_drop > 0
                 else " (the mean curve never falls)")
        line = (f"{row.split} world={row.world} {row.method}{strength(row[axis])} ({row.runs} runs): largest drop "
                f"{format_interval(row, 'largest_drop')}{where}: {verdict}; r - k u gain "
                f"{format_interval(row, 'conservative_gain')}")
        if "model_vs_mean" in row and np.isfinite(row.model_vs_mean):
            line += f"; fair k (chosen {row.get('k_model', '')}): {format_interval(row, 'model_vs_mean')}"
        for rival in ("knn", "filter"):
            if f"{rival}_vs_mean" in row and np.isfinite(row[f"{rival}_vs_mean"]):
                line += f"; {rival} {format_interval(row, f'{rival}_vs_mean')}"
        if isinstance(row.get("not_promised"), str) and row.not_promised:
            line += f" (no level promised for {row.not_promised})"
        lines.append(line)
    for key, part in table.groupby(["split", "method", axis], sort=True):
        lines.append(f"{key[0]} {key[1]}{strength(key[2])}: overoptimizes in {int(part.overoptimizes.sum())} of "
                     f"{len(part)} worlds")
    return lines
