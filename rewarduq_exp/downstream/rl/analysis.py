"""The RL study's tables, with the intervals of the one statistics module.

The design: the objectives of one trained run meet the same RL seeds and the same evaluation slots (slot j answers
topic j mod the topics; its completion is a fresh draw of the policy at that step). Values come as (seeds, slots) per
step, seeds and slots crossed, exactly the (runs, prompts) design of best-of-n, so every interval is
:func:`~rewarduq_exp.downstream.statistics.paired_interval` (the studentised bootstrap over seeds and slots, never
narrower than Student's t, the seeds' part at R - 1 degrees of freedom). A study with 3 RL seeds promises its level
(the coverage suite measured it at 3 runs); 2 seeds or fewer than 16 slots carry a note.

- ``curves.csv``: per run, objective, role, RL seed and step: the means over the slots (gold, its sd over samples,
  r, u, the objective's value, KL, d = sqrt(KL), words, fillers, share beyond the training range);
- ``summary.csv``: per run and objective (report seeds): d and gold at the end, the gold gained from the reference
  (paired per seed and slot), the largest drop of gold from any step to a later one with its simultaneous band
  (``largest_drop_interval``), and Gao et al.'s RL form gold(d) - gold(0) = d (alpha - beta log d) fitted to the mean
  curve (d per step: the mean over seeds of sqrt(KL)), its alpha and beta with intervals;
- ``summary.csv`` also holds each objective's difference from ``mean`` at the end and at matched KL;
- ``comparisons.csv``: gold of an objective minus a baseline's on the same seeds and slots, ``at`` the end of
  training (the same number of steps) and at matched KL (``matched_d``: the largest d both reach on every seed, each
  seed's curve interpolated there, linearly in d between the two measurements around it; d made non-decreasing
  along the steps first);
- ``over_worlds.csv``: each statistic's mean over worlds with the t-interval over the worlds' own estimates (worlds
  as a random effect), per method, strength and objective.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from rewarduq_exp.downstream.statistics import (
    Interval,
    gao_fit_interval,
    largest_drop_interval,
    over_worlds_interval,
    paired_interval,
)

RUN_KEYS = ["run", "method", "world", "filler_bias"]
MEASURED = ["gold", "reward", "u", "objective_value", "kl", "kl_log_ratio", "words", "filler", "beyond", "tokens"]
BASELINE_OBJECTIVES = ("conservative", "worst_case", "uncertainty_weighted", "knn", "filter")
UNCERTAINTY_OBJECTIVES = ("conservative", "worst_case", "uncertainty_weighted")


def with_labels(samples: pd.DataFrame) -> pd.DataFrame:
    out = samples.copy()
    out["coef"] = out.coef.astype(float)
    out["objective_label"] = [o if o in ("mean", "worst_case", "filter") else f"{o}@{c:g}"
                              for o, c in zip(out.objective, out.coef)]
    out["beyond"] = out.beyond.astype(float)
    return out


def curves_table(samples: pd.DataFrame) -> pd.DataFrame:
    keys = [*RUN_KEYS, "objective", "coef", "objective_label", "role", "rl_seed", "step"]
    grouped = samples.groupby(keys, as_index=False)
    out = grouped[MEASURED].mean()
    out["gold_sd"] = grouped.gold.std().gold.to_numpy()
    out["d"] = np.sqrt(out.kl.clip(lower=0))
    return out


def _grid(frame: pd.DataFrame, column: str = "gold") -> tuple[np.ndarray, list, list]:
    """(seeds, slots, steps) values of one run and objective, with its seeds and steps."""
    seeds, steps = sorted(frame.rl_seed.unique()), sorted(frame.step.unique())
    slots = sorted(frame.slot.unique())
    cube = (frame.set_index(["rl_seed", "slot", "step"])[column]
            .reindex(pd.MultiIndex.from_product([seeds, slots, steps])).to_numpy()
            .reshape(len(seeds), len(slots), len(steps)))
    return cube, seeds, steps


def _seed_d(frame: pd.DataFrame, seeds, steps) -> np.ndarray:
    """(seeds, steps): sqrt of the mean KL over the slots, non-decreasing along the steps."""
    kl = frame.groupby(["rl_seed", "step"]).kl.mean().reindex(pd.MultiIndex.from_product([seeds, steps]))
    d = np.sqrt(np.clip(kl.to_numpy().reshape(len(seeds), len(steps)), 0, None))
    return np.maximum.accumulate(d, axis=1)


def at_d(cube: np.ndarray, d: np.ndarray, target: float) -> np.ndarray:
    """(seeds, slots): each seed's values interpolated at d = ``target`` along its own d curve (seeds, steps)."""
    out = np.empty(cube.shape[:2])
    for s in range(cube.shape[0]):
        curve = d[s]
        i = int(np.searchsorted(curve, target, side="left"))
        if i == 0:
            out[s] = cube[s, :, 0]
        elif i >= curve.size:
            out[s] = cube[s, :, -1]
        else:
            span = curve[i] - curve[i - 1]
            w = 0.0 if span <= 0 else (target - curve[i - 1]) / span
            out[s] = (1 - w) * cube[s, :, i - 1] + w * cube[s, :, i]
    return out


def _interval_columns(prefix: str, found: Interval) -> dict:
    return {prefix: found.estimate, f"{prefix}_lo": found.lo, f"{prefix}_hi": found.hi,
            f"{prefix}_note": found.note}


def summary_table(report: pd.DataFrame, draws: int, seed: int) -> pd.DataFrame:
    rows = []
    for keys, frame in report.groupby([*RUN_KEYS, "objective", "coef", "objective_label"]):
        cube, seeds, steps = _grid(frame)
        d = _seed_d(frame, seeds, steps)
        row = dict(zip([*RUN_KEYS, "objective", "coef", "objective_label"], keys))
        last = frame[frame.step == steps[-1]]
        row |= {"seeds": len(seeds), "slots": cube.shape[1], "steps": steps[-1], "d_final": float(d[:, -1].mean()),
                "gold_start": float(cube[:, :, 0].mean()), "gold_final": float(cube[:, :, -1].mean()),
                "reward_final": float(last.reward.mean()), "filler_start": float(frame[frame.step == 0].filler.mean()),
                "filler_final": float(last.filler.mean()), "words_final": float(last.words.mean()),
                "beyond_final": float(last.beyond.mean())}
        row |= _interval_columns("gain_final", paired_interval(cube[:, :, -1] - cube[:, :, 0], draws, seed))
        drop = largest_drop_interval(cube, draws, seed)
        row |= {"largest_drop": drop["drop"], "largest_drop_lo": drop["lo"], "largest_drop_hi": drop["hi"],
                "drop_from_step": steps[drop["from_index"]], "drop_to_step": steps[drop["to_index"]],
                "largest_drop_note": drop["note"]}
        mean_d = d.mean(0)
        if np.ptp(mean_d) > 0 and len(steps) >= 3:
            fit = gao_fit_interval(mean_d, cube, draws, seed, form="rl")
            row |= {f"gao_{k}": v for k, v in fit.items()}
        rows.append(row)
    return pd.DataFrame(rows)


def comparison_pairs(labels: list[str], objectives: dict[str, str]) -> list[tuple[str, str]]:
    """(objective, baseline) label pairs: every objective against ``mean``; the uncertainty objectives, the k-NN
    distance and the oracle filter against every KL penalty; the uncertainty objectives against the k-NN distance."""
    kl = [lab for lab in labels if objectives[lab] == "kl"]
    knn = [lab for lab in labels if objectives[lab] == "knn"]
    pairs = [(lab, "mean") for lab in labels if lab != "mean" and "mean" in labels]
    pairs += [(lab, base) for lab in labels if objectives[lab] in BASELINE_OBJECTIVES for base in kl]
    pairs += [(lab, base) for lab in labels if objectives[lab] in UNCERTAINTY_OBJECTIVES for base in knn]
    return pairs


def comparisons_table(report: pd.DataFrame, draws: int, seed: int) -> pd.DataFrame:
    rows = []
    for keys, frame in report.groupby(RUN_KEYS):
        by_label = {lab: f for lab, f in frame.groupby("objective_label")}
        objectives = {lab: f.objective.iloc[0] for lab, f in by_label.items()}
        grids = {}
        for lab, f in by_label.items():
            cube, seeds, steps = _grid(f)
            grids[lab] = (cube, _seed_d(f, seeds, steps), seeds)
        for a, b in comparison_pairs(sorted(by_label), objectives):
            (ca, da, sa), (cb, db, sb) = grids[a], grids[b]
            if sa != sb or ca.shape[1] != cb.shape[1]:
                continue   # not on the same seeds and slots: no paired difference
            base = dict(zip(RUN_KEYS, keys)) | {"objective": a, "baseline": b}
            final = paired_interval(ca[:, :, -1] - cb[:, :, -1], draws, seed)
            rows.append(base | {"at": "final", "d_a": float(da[:, -1].mean()), "d_b": float(db[:, -1].mean())}
                        | _interval_columns("diff", final))
            target = float(min(da[:, -1].min(), db[:, -1].min()))
            matched = paired_interval(at_d(ca, da, target) - at_d(cb, db, target), draws, seed)
            rows.append(base | {"at": "matched_d", "d_a": target, "d_b": target} | _interval_columns("diff", matched))
    return pd.DataFrame(rows)


CHOSEN_PATTERN = r"^(conservative|knn|uncertainty_weighted)@.*$"


def objective_key(labels: pd.Series) -> pd.Series:
    """What stays the same across worlds: the objective, its coefficient dropped where it was chosen per run (the
    chosen k may differ between worlds); the KL penalty keeps its coefficient (every one is reported)."""
    return labels.str.replace(CHOSEN_PATTERN, r"\1", regex=True)


def over_worlds_table(summary: pd.DataFrame, comparisons: pd.DataFrame) -> pd.DataFrame:
    rows = []
    cell = ["method", "filler_bias"]
    summary = summary.assign(objective=objective_key(summary.objective_label))
    for statistic in ("gain_final", "largest_drop", "d_final", "filler_final", "gold_final"):
        for keys, group in summary.groupby([*cell, "objective"]):
            # the chosen coefficient may differ between worlds: the objective (not its label) is the unit
            found = over_worlds_interval(group[statistic].to_numpy())
            rows.append(dict(zip([*cell, "objective"], keys)) | {
                "table": "summary", "statistic": statistic, "baseline": "", "at": "", "worlds": group.world.nunique(),
                "mean": found.estimate, "lo": found.lo, "hi": found.hi, "note": found.note,
                "per_world": ";".join(f"{v:.4g}" for v in group.sort_values("world")[statistic])})
    if not comparisons.empty:
        comp = comparisons.assign(objective=objective_key(comparisons.objective),
                                  baseline=objective_key(comparisons.baseline))
        for keys, group in comp.groupby([*cell, "objective", "baseline", "at"]):
            found = over_worlds_interval(group["diff"].to_numpy())
            rows.append(dict(zip([*cell, "objective", "baseline", "at"], keys)) | {
                "table": "comparisons", "statistic": "diff", "worlds": group.world.nunique(),
                "mean": found.estimate, "lo": found.lo, "hi": found.hi, "note": found.note,
                "per_world": ";".join(f"{v:.4g}" for v in group.sort_values("world")["diff"])})
    return pd.DataFrame(rows)


def with_versus_mean(summary: pd.DataFrame, comparisons: pd.DataFrame) -> pd.DataFrame:
    """``summary`` with each objective's paired difference against ``mean`` (same seeds and slots) at the end
    (``vs_mean_final*``) and at matched KL (``vs_mean_matched*``, at ``vs_mean_matched_d``); the full set of pairs
    is ``comparisons.csv``."""
    if comparisons.empty:
        return summary
    versus = comparisons[comparisons.baseline == "mean"]
    out = summary
    for at, prefix in (("final", "vs_mean_final"), ("matched_d", "vs_mean_matched")):
        part = versus[versus["at"] == at].rename(columns={"objective": "objective_label", "diff": prefix,
                                                          "diff_lo": f"{prefix}_lo", "diff_hi": f"{prefix}_hi",
                                                          "diff_note": f"{prefix}_note"})
        keep = [*RUN_KEYS, "objective_label", prefix, f"{prefix}_lo", f"{prefix}_hi", f"{prefix}_note"]
        if at == "matched_d":
            part = part.rename(columns={"d_a": "vs_mean_matched_d"})
            keep.append("vs_mean_matched_d")
        out = out.merge(part[keep], on=[*RUN_KEYS, "objective_label"], how="left")
    return out


def analyse(samples: pd.DataFrame, choices: pd.DataFrame, draws: int, seed: int) -> dict[str, pd.DataFrame]:
    samples = with_labels(samples)
    report = samples[samples.role == "report"]
    summary = summary_table(report, draws, seed)
    comparisons = comparisons_table(report, draws, seed)
    summary = with_versus_mean(summary, comparisons)
    return {"curves": curves_table(samples), "summary": summary, "comparisons": comparisons,
            "over_worlds": over_worlds_table(summary, comparisons), "choices": choices}


def _iv(mean, lo, hi, digits: int = 2) -> str:
    if not np.isfinite(lo):
        return f"{mean:+.{digits}f}"
    return f"{mean:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def summary_lines(tables: dict, check: pd.DataFrame) -> list[str]:
    """What the study prints: the reference against the generator, then per method, strength and objective the
    effect over worlds (one run per world: its own interval where there is one world) of the gold gained by the end
    and the gold against ``mean`` at the end and at matched KL."""
    lines = ["reference policy against the generator (means; two-sample KS statistic and p-value):"]
    for (reference, world), block in check.groupby(["reference", "world"], sort=False):
        parts = [f"{r.statistic} {r.reference_mean:.2f} vs {r.generator_mean:.2f} (KS {r.ks:.3f}, p {r.ks_p:.2g})"
                 for r in block.itertuples()]
        lines.append(f"  world {world}: " + "; ".join(parts))
    over = tables["over_worlds"]
    summary = tables["summary"]
    single = summary.world.nunique() < 2
    lines.append("RL per objective (report seeds; d = sqrt(KL) at the end; gold gained from the reference and gold - "
                 "mean's at the end / at matched KL, 95 % intervals " + ("over seeds and slots):" if single else
                                                                         "over worlds):"))
    lines.append(f"  {'method':8s} {'bias':>4s} {'objective':22s} {'d':>5s} {'fillers':>7s}  {'gain':26s} "
                 f"{'vs mean, end':26s} {'vs mean, matched KL':26s}")
    summary = summary.assign(objective=objective_key(summary.objective_label))
    for (method, bias, objective), group in summary.groupby(["method", "filler_bias", "objective"]):
        if single:
            r = group.iloc[0]
            gain = _iv(r.gain_final, r.gain_final_lo, r.gain_final_hi)
        else:
            g = over[(over.table == "summary") & (over.statistic == "gain_final") & (over.method == method)
                     & (over.filler_bias == bias) & (over.objective == objective)].iloc[0]
            gain = _iv(g["mean"], g.lo, g.hi)
        versus = []
        for at in ("final", "matched_d"):
            found = _versus_mean(tables, over, method, bias, objective, at, single)
            versus.append(found)
        lines.append(f"  {method:8s} {bias:4g} {objective:22s} {group.d_final.mean():5.2f} "
                     f"{group.filler_final.mean():7.2f}  {gain:26s} {versus[0]:26s} {versus[1]:26s}")
    return lines


def _versus_mean(tables: dict, over: pd.DataFrame, method, bias, objective, at: str, single: bool) -> str:
    if objective == "mean":
        return "-"
    if single:
        comp = tables["comparisons"]
        found = comp[(comp.method == method) & (comp.filler_bias == bias) & (comp.baseline == "mean")
                     & (comp["at"] == at) & (objective_key(comp.objective) == objective)]
        return _iv(found["diff"].iloc[0], found.diff_lo.iloc[0], found.diff_hi.iloc[0]) if len(found) else "-"
    found = over[(over.table == "comparisons") & (over.method == method) & (over.filler_bias == bias)
                 & (over.objective == objective) & (over.baseline == "mean") & (over["at"] == at)]
    return _iv(found["mean"].iloc[0], found.lo.iloc[0], found.hi.iloc[0]) if len(found) else "-"
