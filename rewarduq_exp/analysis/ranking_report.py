"""The calibrated-label-ranking paper's comparison from run folders: Kendall tau, rank-wise and full-rank ECE per k
(sub-k and top-k) for every (dataset, learner), as Markdown/CSV tables and one ECE-by-k figure per dataset.

Values are the runs' fold means (``metrics.json``), with the fold standard deviation where it exists; several seeds
of one (dataset, learner) are averaged and their fold means' spread is not shown. A learner without a metric (RPC
has no top-k) shows a dash, never a sentinel value.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from rewarduq_exp.analysis.text_tables import DASH, fmt_number, markdown_table
from rewarduq_exp.core.atomic_write import write_atomic
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.runs.run_records import RunRecord

LEARNER_ORDER = ("plackett_luce", "mallows", "rank_classifier", "rpc", "pl_rpc")
ABBREVIATIONS = {"plackett_luce": "PL", "mallows": "MM", "rank_classifier": "RC", "rpc": "RPC", "pl_rpc": "PL-RPC"}
_ECE_KEY = re.compile(r"^rank/(full/)?(sub|top)_(\d+)/ece$")


def ranking_frame(records: list[RunRecord]) -> pd.DataFrame:
    """One row per (dataset, learner, metric) of the completed label-ranking runs: mean and std over folds
    (averaged over seeds when several runs share dataset and learner)."""
    rows = []
    for rec in records:
        if rec.state != "completed":
            continue
        for dataset, block in rec.metrics.items():
            if "n_folds" not in block:
                continue  # not a label-ranking block
            for key, value in block.items():
                if key.startswith("rank/") and not key.endswith("_std") and isinstance(value, (int, float)):
                    rows.append({"dataset": dataset, "learner": rec.method, "metric": key, "mean": float(value),
                                 "std": float(block.get(f"{key}_std", np.nan)), "seed": rec.seed})
    if not rows:
        raise UserError("no completed label-ranking runs found (train some with dataset=label_ranking/<name>)")
    frame = pd.DataFrame(rows)
    return frame.groupby(["dataset", "learner", "metric"], as_index=False).agg(
        mean=("mean", "mean"), std=("std", "mean"), runs=("seed", "size"))


def _learners(frame: pd.DataFrame) -> list[str]:
    present = set(frame["learner"])
    return [m for m in LEARNER_ORDER if m in present] + sorted(present - set(LEARNER_ORDER))


def metric_table(frame: pd.DataFrame, metric: str, digits: int = 3) -> tuple[list[str], list[list[str]]]:
    """Rows = datasets, columns = learners, cells = ``mean ± std`` of ``metric``."""
    learners = _learners(frame)
    header = ["dataset"] + [ABBREVIATIONS.get(m, m) for m in learners]
    rows = []
    for dataset in sorted(set(frame["dataset"])):
        row = [dataset]
        for learner in learners:
            hit = frame[(frame.dataset == dataset) & (frame.learner == learner) & (frame.metric == metric)]
            if hit.empty:
                row.append(DASH)
            else:
                mean, std = hit["mean"].iloc[0], hit["std"].iloc[0]
                cell = fmt_number(mean, digits)
                row.append(cell if np.isnan(std) else f"{cell} ± {fmt_number(std, digits)}")
        rows.append(row)
    return header, rows


def ece_metrics(frame: pd.DataFrame) -> list[str]:
    """The ECE metrics present, ordered: rank-wise sub-k, top-k, then full-rank sub-k, top-k, each by k."""
    found = [(bool(m.group(1)), m.group(2), int(m.group(3)), key)
             for key in set(frame["metric"]) if (m := _ECE_KEY.match(key))]
    return [key for *_, key in sorted(found)]


def write_report(frame: pd.DataFrame, out: Path) -> str:
    """Write ``ranking_tables.md``, ``ranking_metrics.csv`` and ``figures/ece_by_k_<dataset>.png`` into ``out``;
    return the Markdown."""
    out = Path(out)
    sections = ["# Label ranking: accuracy and calibration (fold mean ± std)\n"]
    for title, metric in (("Kendall tau of the modal ranking", "rank/kendall_tau"),
                          ("Top-1 accuracy", "rank/top1_accuracy")):
        sections.append(f"## {title}\n\n{markdown_table(*metric_table(frame, metric))}\n")
    for metric in ece_metrics(frame):
        level = "full-rank" if "/full/" in metric else "rank-wise"
        kind, k = re.match(r".*(sub|top)_(\d+)/ece$", metric).groups()
        sections.append(f"## {level} {kind}-{k} ECE (`{metric}`)\n\n{markdown_table(*metric_table(frame, metric))}\n")
    markdown = "\n".join(sections)
    write_atomic(out / "ranking_tables.md", markdown)
    write_atomic(out / "ranking_metrics.csv", frame.to_csv(index=False))
    for dataset in sorted(set(frame["dataset"])):
        plot_dataset(frame[frame.dataset == dataset], out / "figures" / f"ece_by_k_{dataset}.png", dataset)
    return markdown


def plot_dataset(frame: pd.DataFrame, path: Path, dataset: str) -> Path:
    """2 x 2 panels (rank-wise / full-rank x sub-k / top-k): ECE against k, one line per learner."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from rewarduq_exp.metrics.diagrams import save_figure

    fig = Figure(figsize=(10.0, 7.5))
    FigureCanvasAgg(fig)
    try:
        axes = fig.subplots(2, 2)
        for r, full in enumerate((False, True)):
            for c, kind in enumerate(("sub", "top")):
                ax = axes[r, c]
                for color, learner in enumerate(_learners(frame)):  # one colour per learner in every panel
                    pts = []
                    for key in ece_metrics(frame):
                        m = _ECE_KEY.match(key)
                        if bool(m.group(1)) == full and m.group(2) == kind:
                            hit = frame[(frame.learner == learner) & (frame.metric == key)]
                            if not hit.empty:
                                pts.append((int(m.group(3)), hit["mean"].iloc[0], hit["std"].iloc[0]))
                    if pts:
                        ks, mean, std = map(np.array, zip(*sorted(pts)))
                        ax.errorbar(ks, mean, yerr=np.nan_to_num(std), fmt="o-", capsize=3, color=f"C{color}",
                                    label=ABBREVIATIONS.get(learner, learner))
                ax.set_title(f"{'full-rank' if full else 'rank-wise'} {kind}-k")
                ax.set_xlabel("k")
                ax.set_ylabel("full-rank calibration error" if full else "ECE")
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.grid(alpha=0.3)
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=8)
        fig.suptitle(dataset)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        save_figure(fig, path)
    finally:
        fig.clear()
    return path
