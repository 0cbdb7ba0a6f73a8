"""Figures of ranking calibration: ECE by k (rank-wise and full-rank, sub-k and top-k, mean +- std over folds) and
the reliability diagram of pooled top-1 events (label ranking; the K-wise top-1 calibration of reward models,
calibrated-label-ranking paper appendix D). matplotlib is imported by the functions that draw, not on import."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from rewarduq_exp.core.inside_folder import make_folders
from rewarduq_exp.metrics.calibration import CalibrationCurve
from rewarduq_exp.metrics.diagrams import draw_reliability, save_figure

_KEY = re.compile(r"^rank/(full/)?(sub|top)_(\d+)/ece$")


def binary_curve(probs: np.ndarray, labels: np.ndarray, n_bins: int) -> CalibrationCurve:
    """Equal-width reliability statistics of binary events (left-closed bins, 1.0 in the last)."""
    probs, labels = np.asarray(probs, dtype=float).ravel(), np.asarray(labels, dtype=float).ravel()
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    index = np.clip(np.searchsorted(edges, probs, side="right") - 1, 0, n_bins - 1)
    count = np.bincount(index, minlength=n_bins).astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        confidence = np.bincount(index, weights=probs, minlength=n_bins) / count
        accuracy = np.bincount(index, weights=labels, minlength=n_bins) / count
    return CalibrationCurve(edges=edges, confidence=confidence, accuracy=accuracy, weight=count)


def plot_top1_reliability(probs, labels, path: Path, *, n_bins: int = 10, title: str = "",
                          ece: float | None = None) -> Path:
    """Reliability diagram of top-1 events pooled over (sample, item): P(item ranked first) against how often it
    was; ``ece`` (when given) is printed as reported in the metrics, else the curve's own."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curve = binary_curve(probs, labels, n_bins)
    path = Path(path)
    make_folders(path.parent)  # never through a link made at figures/ during the run
    fig = Figure(figsize=(5.6, 4.8))
    FigureCanvasAgg(fig)
    try:
        shown = ece if ece is not None else curve.ece()
        draw_reliability(fig, fig.add_subplot(), curve, heading=f"top-1: ECE = {shown:.4f}",
                         xlabel="predicted top-1 probability", marker_label="mean predicted probability",
                         ylabel="empirical top-1 frequency")
        if title:
            fig.suptitle(title)
        save_figure(fig, path)
    finally:
        fig.clear()
    return path


def ece_by_k(per_fold: list[dict]) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """{(rank-wise | full-rank, sub | top): (k, mean, std over folds)} from per-fold metric dicts."""
    series: dict[tuple[str, str], dict[int, list[float]]] = {}
    for fold in per_fold:
        for key, value in fold.items():
            match = _KEY.match(key)
            if match:
                kind = ("full-rank" if match.group(1) else "rank-wise", match.group(2))
                series.setdefault(kind, {}).setdefault(int(match.group(3)), []).append(float(value))
    out = {}
    for kind, by_k in series.items():
        ks = np.array(sorted(by_k))
        values = [np.array(by_k[k]) for k in ks]
        out[kind] = (ks, np.array([v.mean() for v in values]),
                     np.array([v.std(ddof=1) if len(v) > 1 else 0.0 for v in values]))
    return out


def plot_ece_by_k(per_fold: list[dict], path: Path, *, title: str = "") -> Path:
    """Two panels (rank-wise ECE, full-rank kernel ECE), each with sub-k and top-k curves over k."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    series = ece_by_k(per_fold)
    path = Path(path)
    make_folders(path.parent)  # never through a link made at figures/ during the run
    fig = Figure(figsize=(10.0, 4.2))
    FigureCanvasAgg(fig)
    try:
        axes = fig.subplots(1, 2)
        for ax, level in zip(axes, ("rank-wise", "full-rank")):
            for kind, style in (("sub", "o-"), ("top", "s--")):
                if (level, kind) not in series:
                    continue
                ks, mean, std = series[(level, kind)]
                ax.errorbar(ks, mean, yerr=std, fmt=style, capsize=3, label=f"{kind}-k")
            ax.set_xlabel("k")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel("ECE" if level == "rank-wise" else "full-rank calibration error")
            ax.set_title(f"{level} calibration")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        save_figure(fig, path)
    finally:
        fig.clear()
    return path
