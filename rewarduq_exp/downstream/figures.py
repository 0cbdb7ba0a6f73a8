"""Figures of the best-of-n task: gold reward vs KL (Gao et al. 2023, figure 1 style), overoptimization, shortcut and
selection vs loss (active learning's figure is :mod:`.active_learning_figure`, reusing :func:`_colors`). Built on
``matplotlib.figure.Figure`` (Agg canvas, no pyplot) and saved atomically, like the run figures. matplotlib is
imported by the functions that draw, not with this module (downstream.py imports it only once it draws)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from rewarduq_exp.metrics.diagrams import save_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STYLE = {"mean": "-", "conservative": "--", "optimistic": ":"}


def _colors(labels) -> dict:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {label: cmap(i % 10) for i, label in enumerate(labels)}


def _strength_colors(strengths) -> dict:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return {s: cmap(i / max(len(strengths) - 1, 1) * 0.9) for i, s in enumerate(strengths)}


def plot_best_of_n(curves: pd.DataFrame, path: Path, k: float, axis: str | None = None) -> None:
    """Gold reward of the best-of-n pick vs KL(best-of-n), line style per selection rule (mean solid, conservative
    r - k u dashed, optimistic r + k u dotted), the oracle in grey. With one run per method: one panel per split, one
    colour per run. A sweep (methods repeated over seeds and the shortcut's strength ``axis``): a panel per split and
    method, one colour per strength, each curve the mean over its runs with their range shaded (mean rule)."""
    from matplotlib.figure import Figure

    if axis is not None and curves.groupby("method").run.nunique().max() > 1:
        _plot_best_of_n_sweep(curves, path, k, axis)
        return
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


def _top_legend(fig: Figure, handles: list) -> None:
    """One legend for every panel, in rows under the title (about 1.7 inches an entry), with the panels below it."""
    ncol = max(1, min(len(handles), int(fig.get_figwidth() / 1.7)))
    rows = -(-len(handles) // ncol)
    height = fig.get_figheight()
    fig.legend(handles=handles, loc="upper center", ncol=ncol, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.45 / height))
    fig.subplots_adjust(top=1 - (0.75 + 0.2 * rows) / height)


def _plot_best_of_n_sweep(curves: pd.DataFrame, path: Path, k: float, axis: str) -> None:
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    # A row per split and world: runs of different worlds meet different candidates and oracles, so a curve is a mean
    # over the runs (seeds) of one world only.
    worlds = sorted(curves.world.unique()) if "world" in curves.columns else [None]
    rows = [(split, world) for split in dict.fromkeys(curves.split) for world in worlds]
    methods = list(dict.fromkeys(curves.method))
    strengths = np.sort(curves[axis].unique())
    colors = _strength_colors(strengths)
    fig = Figure(figsize=(4.6 * len(methods), 4.0 * len(rows)))
    axes = fig.subplots(len(rows), len(methods), squeeze=False)
    for row, (split, world) in zip(axes, rows):
        for ax, method in zip(row, methods):
            part = curves[(curves.split == split) & (curves.method == method)
                          & ((curves.world == world) if world is not None else True)]
            oracle = part[part.selection == "oracle"].groupby("kl").gold.mean()
            ax.plot(oracle.index, oracle.values, color="0.6", linewidth=1.0)
            for strength in strengths:
                for selection, style in STYLE.items():
                    c = part[(part[axis] == strength) & (part.selection == selection)
                             & np.isclose(part.k, 0.0 if selection == "mean" else k)]
                    if c.empty:
                        continue
                    g = c.groupby("kl").gold
                    mean = g.mean()
                    ax.plot(mean.index, mean.values, style, color=colors[strength], linewidth=1.3,
                            marker="o" if selection == "mean" else None, markersize=2.5)
                    if selection == "mean":
                        ax.fill_between(mean.index, g.min(), g.max(), color=colors[strength], alpha=0.15,
                                        linewidth=0)
            ax.set_title(f"{split}: {method}" + (f", world {world}" if len(worlds) > 1 else ""), fontsize=10)
            ax.set_xlabel("KL(best-of-n) [nats]", fontsize=8)
            ax.set_ylabel("gold reward of the pick", fontsize=8)
            ax.grid(alpha=0.3)
    swept = len(strengths) > 1 or strengths[0] != 0  # a world without the shortcut: no strength to name
    handles = [Line2D([], [], color=colors[s], marker="o", markersize=3, label=f"{axis}={s:g}" if swept else "runs")
               for s in strengths]
    handles += [Line2D([], [], color="0.6", label="oracle"), Line2D([], [], color="k", linestyle="-", label="mean r"),
                Line2D([], [], color="k", linestyle="--", label=f"conservative r - {k:g}u"),
                Line2D([], [], color="k", linestyle=":", label=f"optimistic r + {k:g}u")]
    _top_legend(fig, handles)
    top = int(curves.n.max())
    fig.suptitle(f"Best-of-n, n = 1..{top}: mean over the runs of a world (shaded: their range, mean r)", fontsize=11)
    fig.subplots_adjust(left=0.07, right=0.99, bottom=0.55 / fig.get_figheight(), wspace=0.25, hspace=0.35)
    save_figure(fig, Path(path))


def _cell_offsets(table: pd.DataFrame, axis: str, groups: list) -> dict:
    """x offsets, so that the cells of one strength (a method or rule per world) stand side by side."""
    strengths = np.sort(table[axis].unique())
    step = np.diff(strengths).min() if len(strengths) > 1 else 1.0
    width = 0.7 * step / max(len(groups), 1)
    return {g: (i - (len(groups) - 1) / 2) * width for i, g in enumerate(groups)}


def plot_overoptimization(table: pd.DataFrame, axis: str, path: Path) -> None:
    """Rows: splits; columns: peak gold of the mean-selection pick and the largest drop with its 95 % interval,
    against the shortcut's strength ``axis``, one point per cell (a world's runs of a method pooled; markers tell the
    worlds apart, colours the methods). A drop is drawn filled where its interval excludes 0 (it overoptimizes)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    splits = list(dict.fromkeys(table.split))
    methods = list(dict.fromkeys(table.method))
    worlds = sorted(table.world.unique())
    colors = _colors(methods)
    markers = dict(zip(worlds, "osD^vP*X"))
    offsets = _cell_offsets(table, axis, [(m, w) for m in methods for w in worlds])
    fig = Figure(figsize=(11.0, 4.2 * len(splits)))
    axes = fig.subplots(len(splits), 2, squeeze=False)
    for row, split in zip(axes, splits):
        part = table[table.split == split]
        for _, cell in part.iterrows():
            x = cell[axis] + offsets[(cell.method, cell.world)]
            color, marker = colors[cell.method], markers[cell.world]
            row[0].scatter(x, cell.gold_best, color=color, marker=marker, s=30)
            lo, hi = cell.largest_drop - cell.largest_drop_lo, cell.largest_drop_hi - cell.largest_drop
            row[1].errorbar(x, cell.largest_drop, yerr=[[lo], [hi]], color=color, marker=marker, markersize=6,
                            markerfacecolor=color if cell.overoptimizes else "white", capsize=2, linewidth=1.0)
        for ax, title in zip(row, ("peak gold of the pick (mean selection)",
                                   "largest drop, any n to a later n (95 % interval)")):
            ax.set_xticks(np.sort(part[axis].unique()))
            ax.set_title(f"{split}: {title}", fontsize=10)
            ax.set_xlabel(f"dataset.{axis} (shortcut strength)")
            ax.set_ylabel("gold reward")
            ax.grid(alpha=0.3)
        row[1].axhline(0.0, color="0.5", linewidth=0.8)
    handles = [Line2D([], [], color=colors[m], linewidth=2, label=m) for m in methods]
    handles += [Line2D([], [], color="k", marker=markers[w], linestyle="", label=f"world {w}") for w in worlds]
    handles += [Line2D([], [], color="k", marker="o", linestyle="", markerfacecolor="k",
                       label="interval excludes 0: overoptimizes"),
                Line2D([], [], color="k", marker="o", linestyle="", markerfacecolor="white",
                       label="no fall the data can show")]
    runs = "/".join(str(v) for v in sorted(table.runs.unique()))
    fig.suptitle(f"Best-of-n overoptimization vs the shortcut's strength: one point per world and method ({runs} "
                 "runs each, prompts and runs resampled)", fontsize=10)
    _top_legend(fig, handles)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.6 / fig.get_figheight(), wspace=0.25, hspace=0.45)
    save_figure(fig, Path(path))


USE_RULES = (("model_vs_mean", "r - k u (k chosen on held-out prompts)"),
             ("knn_vs_mean", "r - k d (d: k-NN distance in feature space)"),
             ("filter_vs_mean", "oracle filter: beyond the training range last"))


def plot_uncertainty_use(table: pd.DataFrame, axis: str, path: Path, over: pd.DataFrame | None = None) -> None:
    """Rows: splits; columns: methods. The gold gained over mean selection (mean over the KL range, report prompts
    only) by the run's own u, by a k-NN distance in feature space, and by the oracle filter, with 95 % intervals, per
    world, against the shortcut's strength; with ``over`` (over_worlds.csv's rows) and two worlds or more, each
    rule's effect over the worlds beside them (a large black-edged marker, its t-interval over the worlds: the
    interval the docs' conclusions rest on)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    rules = [(c, label) for c, label in USE_RULES if c in table.columns and table[c].notna().any()]
    splits = list(dict.fromkeys(table.split))
    methods = list(dict.fromkeys(table.method))
    worlds = sorted(table.world.unique())
    colors = _colors([c for c, _ in rules])
    markers = dict(zip(worlds, "osD^vP*X"))
    pooled = over is not None and len(worlds) > 1
    offsets = _cell_offsets(table, axis, [(c, w) for c, _ in rules for w in [*worlds, *(["all"] if pooled else [])]])
    fig = Figure(figsize=(4.8 * len(methods), 3.9 * len(splits)))
    axes = fig.subplots(len(splits), len(methods), squeeze=False)
    for row, split in zip(axes, splits):
        for ax, method in zip(row, methods):
            part = table[(table.split == split) & (table.method == method)]
            for column, _ in rules:
                for _, cell in part[part[column].notna()].iterrows():
                    x = cell[axis] + offsets[(column, cell.world)]
                    err = [[cell[column] - cell[f"{column}_lo"]], [cell[f"{column}_hi"] - cell[column]]]
                    ax.errorbar(x, cell[column], yerr=err, color=colors[column], marker=markers[cell.world],
                                markersize=5, capsize=2, linewidth=1.0)
                if not pooled:
                    continue
                rows = over[(over.table == "overoptimization") & (over.split == split) & (over.method == method)
                            & (over.statistic == column)]
                for _, effect in rows.iterrows():
                    ax.errorbar(effect.strength + offsets[(column, "all")], effect.estimate,
                                yerr=[[effect.estimate - effect.lo], [effect.hi - effect.estimate]],
                                color=colors[column], marker="o", markersize=8, markeredgecolor="k",
                                capsize=3, linewidth=2.0)
            ax.axhline(0.0, color="0.5", linewidth=0.8, linestyle="--")
            ax.set_xticks(np.sort(table[axis].unique()))
            ax.set_title(f"{split}: {method}", fontsize=10)
            ax.set_xlabel(f"dataset.{axis}", fontsize=8)
            ax.set_ylabel("gold gained over mean r (KL-average)", fontsize=8)
            ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=colors[c], linewidth=2, label=label) for c, label in rules]
    handles += [Line2D([], [], color="k", marker=markers[w], linestyle="", label=f"world {w}") for w in worlds]
    if pooled:
        handles.append(Line2D([], [], color="0.6", marker="o", markersize=8, markeredgecolor="k", linewidth=2,
                              label=f"over {len(worlds)} worlds"))
    fig.suptitle("Does uncertainty pay off in best-of-n? Paired gain over mean selection, 95 % intervals per world "
                 "and over worlds", fontsize=10)
    _top_legend(fig, handles)
    fig.subplots_adjust(left=0.07, right=0.99, bottom=0.55 / fig.get_figheight(), wspace=0.3, hspace=0.45)
    save_figure(fig, Path(path))


def plot_shortcut(bins: pd.DataFrame, shortcut: pd.DataFrame, axis: str, path: Path, min_count: int = 10) -> None:
    """Rows: methods; columns: per feature, u / median u and r (z-score over the run's candidates) against the
    feature's value, one colour per shortcut strength (candidates pooled over the runs; values held by fewer than
    ``min_count`` candidates left out), solid for eval and dashed for the other splits; the dotted vertical line is
    the training maximum of the feature."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    methods = list(dict.fromkeys(bins.method))
    features = list(dict.fromkeys(bins.feature))
    strengths = np.sort(bins[axis].unique())
    colors = _strength_colors(strengths)
    splits = list(dict.fromkeys(bins.split))
    panels = [(f, column, label) for f in features
              for column, label in (("u_norm", "u / median u"), ("r_z", "r (z-score)"))]
    fig = Figure(figsize=(4.0 * len(panels), 3.3 * len(methods)))
    axes = fig.subplots(len(methods), len(panels), squeeze=False, sharey="col")  # methods on one scale per column
    keys = ["method", axis, "split", "feature", "value"]
    weighted = bins.assign(u_norm=bins.u_norm * bins["count"], r_z=bins.r_z * bins["count"])
    pooled = weighted.groupby(keys, sort=False)[["count", "u_norm", "r_z"]].sum().reset_index()
    pooled[["u_norm", "r_z"]] = pooled[["u_norm", "r_z"]].div(pooled["count"], axis=0)
    pooled = pooled[pooled["count"] >= min_count]
    for row, method in zip(axes, methods):
        for ax, (feature, column, label) in zip(row, panels):
            part = pooled[(pooled.method == method) & (pooled.feature == feature)]
            for (strength, split), line in part.groupby([axis, "split"], sort=True):
                line = line.sort_values("value")
                ax.plot(line.value, line[column], "-" if split == "eval" else "--", marker="o", markersize=2.5,
                        color=colors[strength])
            limits = shortcut[(shortcut.method == method) & (shortcut.feature == feature)].train_max.dropna()
            for top in limits.unique():
                ax.axvline(top, color="k", linestyle=":", linewidth=1.0)
            ax.axhline(1.0 if column == "u_norm" else 0.0, color="0.6", linewidth=0.6)
            ax.set_title(f"{method}: {label} vs {feature}", fontsize=9)
            ax.set_xlabel(f"{feature} (dotted: training max)", fontsize=8)
            ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=colors[s], marker="o", markersize=3, label=f"{axis}={s:g}") for s in strengths]
    handles += [Line2D([], [], color="k", linestyle="-" if split == "eval" else "--", label=split) for split in splits]
    handles.append(Line2D([], [], color="k", linestyle=":", label="training max of the feature"))
    _top_legend(fig, handles)
    fig.suptitle("Does u rise on the candidates that exploit the shortcut? Mean u / median u and r (z-score) per "
                 f"feature value, candidates pooled over runs (values with < {min_count} candidates left out)",
                 fontsize=10)
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.55 / fig.get_figheight(), wspace=0.25, hspace=0.5)
    save_figure(fig, Path(path))


def plot_selection_vs_loss(summary: pd.DataFrame, corr: pd.DataFrame, metrics, loss: str, split: str,
                           path: Path) -> None:
    """One panel per run metric: each run's metric (x) against its downstream ``loss`` (y) on ``split``, one colour
    per method; the title gives Spearman's rho across the runs of each world (w<seed>), its p-value and the number
    of runs."""
    from matplotlib.figure import Figure

    part = summary[summary.split == split]
    methods = list(dict.fromkeys(part.method))
    colors = _colors(methods)
    cols = min(3, len(metrics))
    rows = -(-len(metrics) // cols)
    fig = Figure(figsize=(4.4 * cols, 3.9 * rows))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[len(metrics):]:
        ax.set_visible(False)
    for ax, metric in zip(axes, metrics):
        worlds = sorted(part.world.unique()) if "world" in part.columns else [None]
        markers = dict(zip(worlds, "osD^vP*X"))
        for method in methods:
            for world in worlds:  # a marker per world: their golds are not on one scale
                runs = part[(part.method == method) & ((part.world == world) if world is not None else True)]
                label = method if world is None or len(worlds) == 1 else f"{method}, world {world}"
                ax.scatter(runs[metric], runs[loss], s=22, color=colors[method], marker=markers[world], label=label)
        stat = corr[(corr.split == split) & (corr.downstream == loss) & (corr.run_metric == metric)]
        text = "; ".join(f"w{r.world}: rho {r.spearman:.2f}, p {r.p_value:.2g}, n {int(r.runs)}"
                         for _, r in stat.iterrows()) or "no correlation defined"
        ax.set_title(f"{metric}\n{text}", fontsize=7 if len(stat) > 1 else 9)
        ax.set_xlabel(f"{metric} ({split}, the run's own)", fontsize=8)
        ax.set_ylabel(f"{loss} ({split})", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"Do the runs' own statistics predict {loss}? ({split}; Spearman across the runs of one world)",
                 fontsize=10)
    height = fig.get_figheight()
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.55 / height, top=1 - 0.9 / height, wspace=0.3, hspace=0.55)
    save_figure(fig, Path(path))
