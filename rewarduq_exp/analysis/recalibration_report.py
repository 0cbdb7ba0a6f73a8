"""The before/after table of recalibration over run folders (``scripts/recalibration_table.py``): per method and
evaluated set, the raw and recalibrated ECE, EBCE, RS_0.2, CT and CF (means over the seeds, with their range), the
fitted temperature and scales, and the conformal scale's realised CF share against its alpha; for rated responses
(BoRP) the intervals' coverage and width before and after the conformal scale.

Each row says which interval scale its s is (``interval``: rule, conformal or none, from ``recal/interval``; ``-``
for a run from before that key): the run's own recalibration (``recal/``), and on rows of their own the other
interval choices evaluate.py added beside it (``recal@<interval>/``)."""

from __future__ import annotations

import pandas as pd

from rewarduq_exp.runs.run_records import RunRecord

PAIR_METRICS = ("ece", "ebce", "rs_0.2", "ct_rate", "cf_rate")
PREFIX, OTHER_PREFIX = "recal/", "recal@"
POINTWISE_METRICS = ("probe/coverage", "probe/mean_width")


def recalibration_rows(records: list[RunRecord]) -> pd.DataFrame:
    """One row per completed run, evaluated set and recalibration in its block: the run's own (``recal/``) and each
    other interval choice evaluate.py wrote beside it (``recal@<interval>/``)."""
    rows = []
    for r in records:
        if r.state != "completed":
            continue
        for name, block in r.metrics.items():
            if not isinstance(block, dict):
                continue
            for prefix in recalibration_prefixes(block):
                row = {"method": r.method, "model": r.model, "train": r.dataset, "dataset": name, "seed": r.seed,
                       "run": r.path.name, "path": str(r.path)}
                keys = PAIR_METRICS if "ece" in block else POINTWISE_METRICS
                for key in keys:
                    row[f"{key} raw"] = block.get(key)
                    row[f"{key} recal"] = block.get(f"{prefix}{key}")
                interval = block.get(f"{prefix}interval", prefix.removeprefix(OTHER_PREFIX).rstrip("/")
                                     if prefix.startswith(OTHER_PREFIX) else None)
                row.update({"win_rate": block.get("win_rate"), "T": block.get(f"{prefix}temperature"),
                            "interval": interval if isinstance(interval, str) else "-",
                            "s": block.get(f"{prefix}scale"), "s_conformal": block.get(f"{prefix}conformal/scale"),
                            "cf_share@s_conformal": block.get(f"{prefix}conformal/cf_share"),
                            "alpha": block.get(f"{prefix}conformal/alpha"),
                            "map": block.get(f"{prefix}probability_map")})
                rows.append(row)
    return pd.DataFrame(rows)


def recalibration_prefixes(block: dict) -> list[str]:
    """``recal/`` where the block has the run's own recalibrated metrics, then each ``recal@<interval>/``."""
    keys = [str(k) for k in block]
    own = [PREFIX] if any(k.startswith(PREFIX) for k in keys) else []
    return own + sorted({k.split("/", 1)[0] + "/" for k in keys if k.startswith(OTHER_PREFIX) and "/" in k})


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
    header += ["T", "interval", "s", "s conformal", "CF share at s conformal (alpha)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (method, train, dataset, interval), group in rows.groupby(["method", "train", "dataset", "interval"],
                                                                  sort=True):
        cells = [method, train, dataset, str(len(group)), _cell(group.get("win_rate", pd.Series(dtype=float)))]
        for m in pairs + points:
            raw, recal = group.get(f"{m} raw"), group.get(f"{m} recal")
            cells.append("-" if raw is None or raw.isna().all() else f"{_cell(raw)} → {_cell(recal)}")
        alpha = pd.to_numeric(group["alpha"], errors="coerce").dropna()
        share = _cell(group["cf_share@s_conformal"]) if group["cf_share@s_conformal"].notna().any() else "-"
        cells += [_cell(group["T"]), interval, _cell(group["s"]), _cell(group["s_conformal"]),
                  f"{share} ({alpha.iloc[0]:g})" if share != "-" and len(alpha) else share]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
