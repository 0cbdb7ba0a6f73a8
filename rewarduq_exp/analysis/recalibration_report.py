"""The before/after table of recalibration over run folders (``scripts/recalibration_table.py``): per method and
evaluated set, the raw and recalibrated ECE, EBCE, RS_0.2, CT and CF (means over the seeds, with their range), the
fitted temperature and scales, and the conformal scale's realised CF share against its alpha; for rated responses
(BoRP) the intervals' coverage and width before and after the conformal scale."""

from __future__ import annotations

import pandas as pd

from rewarduq_exp.runs.run_records import RunRecord

PAIR_METRICS = ("ece", "ebce", "rs_0.2", "ct_rate", "cf_rate")
POINTWISE_METRICS = ("probe/coverage", "probe/mean_width")


def recalibration_rows(records: list[RunRecord]) -> pd.DataFrame:
    """One row per completed run and evaluated set that has recalibrated metrics."""
    rows = []
    for r in records:
        if r.state != "completed":
            continue
        for name, block in r.metrics.items():
            if not isinstance(block, dict) or not any(str(k).startswith("recal/") for k in block):
                continue
            row = {"method": r.method, "model": r.model, "train": r.dataset, "dataset": name, "seed": r.seed,
                   "run": r.path.name, "path": str(r.path)}
            keys = PAIR_METRICS if "ece" in block else POINTWISE_METRICS
            for key in keys:
                row[f"{key} raw"] = block.get(key)
                row[f"{key} recal"] = block.get(f"recal/{key}")
            row.update({"win_rate": block.get("win_rate"), "T": block.get("recal/temperature"),
                        "s": block.get("recal/scale"), "s_conformal": block.get("recal/conformal/scale"),
                        "cf_share@s_conformal": block.get("recal/conformal/cf_share"),
                        "alpha": block.get("recal/conformal/alpha"), "map": block.get("recal/probability_map")})
            rows.append(row)
    return pd.DataFrame(rows)


def _cell(values: pd.Series) -> str:
    v = pd.to_numeric(values, errors="coerce").dropna()
    if v.empty:
        return "-"
    if round(v.min(), 3) == round(v.max(), 3):
        return f"{v.mean():.3f}"
    return f"{v.mean():.3f} ({v.min():.3f}-{v.max():.3f})"


def recalibration_table(rows: pd.DataFrame) -> str:
    """Markdown: per (method, training data, evaluated set) the means over seeds (range in brackets)."""
    if rows.empty:
        return "(no run with recalibrated metrics)"
    pairs = [c for c in ("ece", "ebce", "rs_0.2", "ct_rate", "cf_rate") if f"{c} raw" in rows.columns]
    points = [c for c in POINTWISE_METRICS if f"{c} raw" in rows.columns]
    header = ["method", "train", "eval set", "seeds", "win rate"]
    header += [f"{m.removeprefix('probe/')} raw → recal" for m in pairs + points]
    header += ["T", "s", "s conformal", "CF share at s conformal (alpha)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (method, train, dataset), group in rows.groupby(["method", "train", "dataset"], sort=True):
        cells = [method, train, dataset, str(len(group)), _cell(group.get("win_rate", pd.Series(dtype=float)))]
        for m in pairs + points:
            raw, recal = group.get(f"{m} raw"), group.get(f"{m} recal")
            cells.append("-" if raw is None or raw.isna().all() else f"{_cell(raw)} → {_cell(recal)}")
        alpha = pd.to_numeric(group["alpha"], errors="coerce").dropna()
        share = _cell(group["cf_share@s_conformal"]) if group["cf_share@s_conformal"].notna().any() else "-"
        cells += [_cell(group["T"]), _cell(group["s"]), _cell(group["s_conformal"]),
                  f"{share} ({alpha.iloc[0]:g})" if share != "-" and len(alpha) else share]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
