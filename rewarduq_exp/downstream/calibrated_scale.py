"""Best-of-n with a run's recalibration (``calibration.json``, :mod:`rewarduq_exp.recalibration`): the scores the
curves use, and does the conservative pick with the calibrated interval scale do better than with the raw one?

A run's recalibration maps each candidate's score as ``r' = r / T`` and ``u' = s u / T`` (T: temperature, s: the
interval scale of its bounds). T > 0 keeps every ordering of r, so the mean pick, the oracle and the fair use of u
(which rescales u to the reward's spread, :mod:`.uncertainty_use`) pick the same candidates either way; only
``r' - k u'`` changes meaning: it ranks as ``r - k s u``, so with ``task.recalibrated=true`` the ``task.ks`` of the
conservative and optimistic curves are in units of the recalibrated u (k = 1: the calibrated interval), with
``false`` in units of the raw u.

Whatever the units of the curves, the comparison here is made from the raw ``r`` and ``u`` of the same candidates
(scored once), with k = ``task.k_compare`` (default 1), so every rule meets the same candidates and the differences
are paired per prompt:

- ``conservative_raw``: ``r - k u`` (the paper's k = 1 on the model's own u);
- ``conservative_cal``: ``r - k s u``, s the scale the run's bounds use (``calibration.scale``: the paper's
  selection rule applied to s by default, ``recalibrate.interval`` at training);
- ``conservative_conformal``: ``r - k s_c u``, s_c the conformal scale (``calibration.scales['conformal']``: a
  finite-sample guarantee on CF / N), where the run has one and it is feasible.

:func:`calibrated_statistics` gives, per run and pooled over the runs of a cell, each of the last two against the
mean pick (``<rule>_gain``: mean gold gained over the KL range; ``_nmax``: at the largest n) and against
``conservative_raw`` (``<rule>_vs_raw``), and ``conservative_raw_gain``, each with its 95 % paired bootstrap
interval over prompts (and runs: :mod:`.statistics`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from rewarduq_exp.analysis.text_tables import fmt_number
from rewarduq_exp.core.checks import check_positive
from rewarduq_exp.downstream.best_of_n import area_weights, expected_best_of_n
from rewarduq_exp.downstream.statistics import paired_interval

RAW, CAL, CONFORMAL = "conservative_raw", "conservative_cal", "conservative_conformal"
RULES = (RAW, CAL, CONFORMAL)
# (column, rule, baseline): every difference the summary reports, rule - baseline per prompt
COMPARED = (("conservative_raw_gain", RAW, "mean"), ("conservative_cal_gain", CAL, "mean"),
            ("conservative_cal_vs_raw", CAL, RAW), ("conservative_conformal_gain", CONFORMAL, "mean"),
            ("conservative_conformal_vs_raw", CONFORMAL, RAW))
META = "calibration"   # the per-prompt dict's key of the run's T and scales (the picks are (rule, k) tuples)


def recalibrated_scores(table: pd.DataFrame, calibration, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """(reward, u) of a raw score table (``RewardModel.score(..., raw=True)``: its ``reward`` and ``uncertainty``)
    after ``calibration``, computed as ``RewardModel.score`` computes them (:meth:`Calibration.apply`: reward / T,
    u s / T)."""
    from rewarduq_exp.methods.base import Scores

    scores = calibration.apply(Scores(table.reward.to_numpy(), table.uncertainty.to_numpy(),
                                      check_positive(beta, "method.beta")))
    return scores.reward, scores.u


def calibration_info(calibration) -> dict:
    """The run's T and scales as the per-prompt dict keeps them (None: the run was scored raw). ``scale_conformal``
    is None where the run has no conformal scale or an infeasible one (no scale met its guarantee on the calibration
    split: it guarantees nothing, so ``conservative_conformal`` is not drawn from it)."""
    if calibration is None:
        return {}
    conformal = calibration.conformal_scale
    return {"temperature": float(calibration.temperature), "interval": str(calibration.interval),
            "scale": float(calibration.scale), "scale_conformal": conformal}


def calibrated_picks(reward: np.ndarray, u: np.ndarray, gold: np.ndarray, info: dict, k: float, ns,
                     proxy_reward: np.ndarray | None = None) -> dict:
    """The per-prompt picks of :data:`RULES` from the RAW ``reward`` and ``u`` (P, M): ``{(rule, k): (gold (P, J),
    reward (P, J))}`` as :func:`~.best_of_n.picked_per_prompt` returns them (the pick's mean ``proxy_reward``, by
    default ``reward``: the units the run's curves report); empty without a calibration (``info`` empty)."""
    if not info:
        return {}
    reward, u = np.asarray(reward, np.float64), np.asarray(u, np.float64)
    shown = reward if proxy_reward is None else proxy_reward
    scales = {RAW: 1.0, CAL: info["scale"], CONFORMAL: info.get("scale_conformal")}
    return {(rule, float(k)): (expected_best_of_n(reward - k * s * u, gold, ns),
                               expected_best_of_n(reward - k * s * u, shown, ns))
            for rule, s in scales.items() if s is not None}


def calibrated_statistics(picked: list[dict], kl: np.ndarray, k: float, draws: int, seed: int,
                          notes: dict | None = None) -> dict:
    """:data:`COMPARED` for the runs ``picked`` (one per-prompt dict per run, R runs sharing P prompts), each as
    ``<name>`` (area over KL), ``<name>_nmax`` and their ``_lo`` / ``_hi``; a comparison is left out unless every run
    has both rules (a run scored raw has none; BoRP's has no rule scale)."""
    weights, out = area_weights(kl), {}
    for name, rule, base in COMPARED:
        keys = [(rule, float(k)), (base, 0.0 if base == "mean" else float(k))]
        if not all(key in p for p in picked for key in keys):
            continue
        diff = np.stack([p[keys[0]] - p[keys[1]] for p in picked])     # (R, P, J)
        for suffix, values in (("", diff @ weights), ("_nmax", diff[..., -1])):
            estimate, lo, hi, note = paired_interval(values, draws, seed)
            out.update({f"{name}{suffix}": estimate, f"{name}{suffix}_lo": lo, f"{name}{suffix}_hi": hi})
            if note and notes is not None:   # why this interval cannot promise its level (not_promised)
                notes[f"{name}{suffix}"] = note
    return out


def calibration_columns(picked: list[dict], joined: bool = False) -> dict:
    """The runs' recalibration for a table row: ``recalibrated`` (every run's scores were), ``cal_temperature``,
    ``cal_interval``, ``cal_scale`` and ``cal_scale_conformal``: one run's values, or with ``joined`` every run's,
    joined by commas as ``k_model`` is (overoptimization.csv's cells)."""
    infos = [p.get(META) or {} for p in picked]
    if not all(infos):
        return {"recalibrated": False}
    if not joined and len(infos) == 1:
        (info,) = infos
        return {"recalibrated": True, "cal_temperature": info["temperature"], "cal_interval": info["interval"],
                "cal_scale": info["scale"],
                "cal_scale_conformal": np.nan if info["scale_conformal"] is None else info["scale_conformal"]}

    def joined(key):
        return ",".join("-" if i[key] is None else (f"{i[key]:.4g}" if isinstance(i[key], float) else i[key])
                        for i in infos)

    return {"recalibrated": True, **{f"cal_{key}": joined(key)
                                     for key in ("temperature", "interval", "scale", "scale_conformal")}}


def _interval(row, name: str) -> str:
    if name not in row or pd.isna(row[name]):
        return "-"
    return f"{fmt_number(row[name], 3)} [{fmt_number(row[f'{name}_lo'], 3)}, {fmt_number(row[f'{name}_hi'], 3)}]"


def calibrated_lines(table: pd.DataFrame, axis: str, k: float) -> list[str]:
    """One line per cell of ``table`` (overoptimization.csv's rows: a world, method and strength, its runs pooled)
    whose runs were all recalibrated: the scales, then r - k s u against the mean pick and against r - k u, and the
    conformal scale's, each the mean gold gained over the KL range with its 95 % interval."""
    lines = []
    swept = table[axis].nunique() > 1 or bool((table[axis] != 0).any())  # as overoptimization_lines names a cell
    for _, row in table.iterrows():
        flag = row.get("recalibrated", False)
        if not (isinstance(flag, (bool, np.bool_)) and flag) or pd.isna(row.get("conservative_cal_vs_raw", np.nan)):
            continue
        strength = f" {axis}={row[axis]:g}" if swept else ""
        line = (f"{row.split} world={row.world} {row.method}{strength} ({row.runs} runs; s = "
                f"{_fmt(row.cal_scale)} by {row.cal_interval}, T = {_fmt(row.cal_temperature)}): r - {k:g} s u vs "
                f"mean {_interval(row, 'conservative_cal_gain')}, vs r - {k:g} u "
                f"{_interval(row, 'conservative_cal_vs_raw')} (at n_max "
                f"{_interval(row, 'conservative_cal_vs_raw_nmax')})")
        if pd.notna(row.get("conservative_conformal_vs_raw", np.nan)):
            line += (f"; conformal s = {_fmt(row.cal_scale_conformal)}: vs mean "
                     f"{_interval(row, 'conservative_conformal_gain')}, vs r - {k:g} u "
                     f"{_interval(row, 'conservative_conformal_vs_raw')}")
        lines.append(line)
    return lines


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, (float, np.floating)) else str(value)
