"""Figures of the downstream tasks: best-of-n gold reward vs KL (Gao et al. 2023, figure 1 style) and active-learning
curves. Built on ``matplotlib.figure.Figure`` (Agg canvas, no pyplot) and saved atomically, like the run figures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure

from rewarduq_exp.metrics.diagrams import save_figure

STYLE = {"mean": "-", "conservative": "--", "optimistic": ":"}


def _colors(labels) -> dict:
    cmap = colormaps["tab10"]
    return {label: cmap(i % 10) for i, label in enumerate(labels)}


def plot_best_of_n(curves: pd.DataFrame, path: Path, k: float) -> None:
    """One panel per split: gold reward of the best-of-n pick vs KL(best-of-n), one colour per run, line style per
    selection rule (mean solid, conservative r - k u dashed, optimistic r + k u dotted), the oracle in grey."""
    splits = list(dict.fromkeys(curves.split))
    runs = list(dict.fromkeys(curves.run))
    colors = _colors(runs)
    fig = Figure(figsize=(5.2 * len(splits), 4.4))
    axes = fig.subplots(1, len(splits), squeeze=False)[0]
    for ax, split in zip(axes, splits):
        part = curves[curves.split == split]
        oracle = part[(part.selection == "oracle") & (part.run == runs[0])].sort_values("n")
        ax.plot(oracle.kl, oracle.gold, color="0.6", linewidth=1.0, label="oracle (true best of n)")
        for run in runs:
            for selection, style in STYLE.items():
                c = part[(part.run == run) & (part.selection == selection)
                         & np.isclose(part.k, 0.0 if selection == "mean" else k)].sort_values("n")
                if c.empty:
                    continue
                label = run if selection == "mean" else None
                ax.plot(c.kl, c.gold, style, color=colors[run], marker="o" if selection == "mean" else None,
                        markersize=3, label=label)
                if selection == "mean":
                    ax.fill_between(c.kl, c.gold - c.gold_se, c.gold + c.gold_se, color=colors[run], alpha=0.15,
                                    linewidth=0)
        ax.plot([], [], "k-", label="mean r")
        ax.plot([], [], "k--", label=f"conservative r - {k:g}u")
        ax.plot([], [], "k:", label=f"optimistic r + {k:g}u")
        top = int(part.n.max())
        ax.set_title(f"{split}: best-of-n, n = 1..{top}")
        ax.set_xlabel("KL(best-of-n) = log n - (n-1)/n  [nats]")
        ax.set_ylabel("gold (true) reward of the pick")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best", framealpha=0.9)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.12, top=0.9, wspace=0.25)
    save_figure(fig, Path(path))


def plot_active_learning(curves: pd.DataFrame, path: Path) -> None:
    """Rows: methods; columns: the metrics; one line per acquisition strategy (mean over repeats, band = standard
    error) against the number of labels acquired."""
    methods = list(dict.fromkeys(curves.run))
    metrics = [c for c in ("win_rate", "truth/ece") if c in curves.columns]
    strategies = list(dict.fromkeys(curves.strategy))
    colors = _colors(strategies)
    fig = Figure(figsize=(4.8 * len(metrics), 3.6 * len(methods)))
    axes = fig.subplots(len(methods), len(metrics), squeeze=False)
    for row, method in zip(axes, methods):
        part = curves[curves.run == method]
        for ax, metric in zip(row, metrics):
            for strategy in strategies:
                g = part[part.strategy == strategy].groupby("labels")[metric]
                mean, se = g.mean(), g.std(ddof=1) / np.sqrt(g.count())
                ax.plot(mean.index, mean.values, marker="o", markersize=3, color=colors[strategy], label=strategy)
                ax.fill_between(mean.index, mean - se.fillna(0), mean + se.fillna(0), color=colors[strategy],
                                alpha=0.15, linewidth=0)
            ax.set_title(f"{method}: {metric}")
            ax.set_xlabel("labelled pairs")
            ax.set_ylabel(metric)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.08, top=0.95, wspace=0.3, hspace=0.4)
    save_figure(fig, Path(path))
