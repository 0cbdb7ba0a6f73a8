"""The figure of ``task=active_learning``, paired by repeat: within a repeat every strategy starts from the same
initial set and model seed, so each strategy is compared with random of the same repeat, not with random's spread
over repeats. Built on ``matplotlib.figure.Figure`` (no pyplot; imported when the figure is drawn) and saved
atomically, like :mod:`.figures`."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from rewarduq_exp.downstream.figures import _colors
from rewarduq_exp.downstream.statistics import paired_t_interval
from rewarduq_exp.metrics.diagrams import save_figure


def _calibration(part: pd.DataFrame) -> str:
    """ECE against the true preference probability where the world knows it, else against the labels."""
    return "truth/ece" if "truth/ece" in part.columns and bool(part["truth/ece"].notna().any()) else "ece"


def _by_round(mine: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Rounds x repeats of one strategy's ``metric``."""
    return mine.groupby(["round", "repeat"])[metric].mean().unstack("repeat")


def _draw_levels(ax, part: pd.DataFrame, metric: str, strategies: list, colors: dict, repeats: int) -> None:
    for strategy in strategies:
        g = part[part.strategy == strategy].groupby("labels")[metric]
        mean = g.mean()
        ax.plot(mean.index, mean.values, marker="o", markersize=3, color=colors[strategy], label=strategy)
        ax.fill_between(mean.index, g.min(), g.max(), color=colors[strategy], alpha=0.15, linewidth=0)
    ax.fill_between([], [], [], color="0.5", alpha=0.3, linewidth=0,
                    label=f"band: min..max over {repeats} repeats (within the metric's range)" if repeats > 1
                    else "one repeat: no band")
    ax.set_ylabel(metric)


def _draw_differences(ax, part: pd.DataFrame, metric: str, strategies: list, colors: dict) -> None:
    if "random" not in strategies:
        ax.text(0.5, 0.5, "no random strategy to pair with", ha="center", va="center", transform=ax.transAxes)
        return
    labels = part.groupby("round")["labels"].first()
    base = _by_round(part[part.strategy == "random"], metric)
    for strategy in strategies:
        if strategy == "random":
            continue
        mine, ref = _by_round(part[part.strategy == strategy], metric).align(base, join="outer")
        iv = paired_t_interval((mine - ref).to_numpy(), axis=1)  # per round: d_r over the repeats
        x = labels.reindex(mine.index).to_numpy()
        ax.plot(x, iv.mean, marker="o", markersize=3, color=colors[strategy], label=strategy)
        ax.fill_between(x, iv.lo, iv.hi, color=colors[strategy], alpha=0.15, linewidth=0)
    ax.axhline(0.0, color="0.3", linestyle="--", linewidth=0.9)
    ax.fill_between([], [], [], color="0.5", alpha=0.3, linewidth=0, label="95 % paired t-interval")
    ax.set_ylabel(f"{metric} - random")


def plot_active_learning(curves: pd.DataFrame, path: Path) -> None:
    """Columns: eval win rate and calibration (``truth/ece`` where the world knows the true preference probability,
    else ``ece`` against the labels); two rows per run, against the number of labelled pairs. Top: the level per
    acquisition strategy, the mean over repeats with the min..max over repeats as band (inside the metric's range).
    Bottom: strategy - random within each repeat, its mean over repeats with the 95 % paired t-interval as band
    (none with one repeat), and a dashed line at 0."""
    from matplotlib.figure import Figure

    runs = list(dict.fromkeys(curves.run))
    strategies = list(dict.fromkeys(curves.strategy))
    colors = _colors(strategies)
    repeats = int(curves.repeat.nunique()) if "repeat" in curves.columns else 1
    fig = Figure(figsize=(9.6, 6.4 * len(runs) + 0.5))
    axes = fig.subplots(2 * len(runs), 2, squeeze=False)
    for i, run in enumerate(runs):
        part = curves[curves.run == run]
        for col, metric in enumerate(("win_rate", _calibration(part))):
            top, bottom = axes[2 * i, col], axes[2 * i + 1, col]
            _draw_levels(top, part, metric, strategies, colors, repeats)
            top.set_title(f"{run}: {metric}", fontsize=10)
            _draw_differences(bottom, part, metric, strategies, colors)
            bottom.set_title(f"{run}: {metric}, strategy - random (same repeat)", fontsize=10)
            for ax in (top, bottom):
                ax.set_xlabel("labelled pairs")
                ax.grid(alpha=0.3)
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"active learning, paired by repeat ({repeats} repeats: within one, every strategy starts from the "
                 "same initial set and model seed)\ntop: mean over repeats, band = min..max over repeats; "
                 "bottom: strategy - random within each repeat, mean and 95 % paired t-interval", fontsize=9)
    height = fig.get_figheight()  # margins in inches, so one run keeps its titles and axis labels
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.55 / height, top=1 - 0.95 / height, wspace=0.3, hspace=0.5)
    save_figure(fig, Path(path))
