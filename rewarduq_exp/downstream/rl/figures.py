"""The RL study's figures (PNG, written atomically): per method and shortcut strength, one panel each,

- ``rl_gold_vs_kl.png``: gold of the policy's samples against d = sqrt(KL to the reference), one line per objective
  (the mean over worlds and RL seeds at each measured step), shaded +- 1.96 standard errors over them;
- ``rl_proxy_vs_gold.png``: the proxy reward r against the gold along training (overoptimization: r climbs, gold
  does not);
- ``rl_feature.png``: the shortcut's feature (fillers per completion) over the steps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from rewarduq_exp.metrics.diagrams import save_figure


def _cells(curves: pd.DataFrame) -> list[tuple]:
    return sorted(curves.groupby(["method", "filler_bias"]).groups)


def _per_step(curves: pd.DataFrame) -> pd.DataFrame:
    """Mean and standard error over (world, RL seed) per objective and step."""
    grouped = curves.groupby(["method", "filler_bias", "objective", "step"])
    out = grouped[["gold", "reward", "d", "filler"]].mean()
    out["gold_se"] = grouped.gold.std() / np.sqrt(grouped.gold.count())
    return out.reset_index()


def _panels(n: int):
    from matplotlib.figure import Figure

    cols = min(n, 3)
    rows = int(np.ceil(n / cols))
    fig = Figure(figsize=(5.0 * cols, 4.0 * rows), layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False).ravel()


def _colors(objectives) -> dict:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {o: cmap(i % 10) for i, o in enumerate(objectives)}


def plot_rl(tables: dict, out_dir: Path) -> None:
    curves = tables["curves"]
    report = curves[curves.role == "report"]
    if report.empty:
        return
    # kl objectives differ by their coefficient: one line each
    report = report.assign(objective=np.where(report.objective == "kl", report.objective_label, report.objective))
    per_step = _per_step(report)
    cells = _cells(report)
    colors = _colors(sorted(report.objective.unique()))
    for name, x, y in (("rl_gold_vs_kl", "d", "gold"), ("rl_proxy_vs_gold", "reward", "gold"),
                       ("rl_feature", "step", "filler")):
        fig, axes = _panels(len(cells))
        for ax, (method, strength) in zip(axes, cells):
            part = per_step[(per_step.method == method) & (per_step.filler_bias == strength)]
            for objective, line in part.groupby("objective"):
                line = line.sort_values("step")
                ax.plot(line[x], line[y], marker="o", markersize=3, color=colors[objective], label=objective)
                if name == "rl_gold_vs_kl":
                    ax.fill_between(line[x], line.gold - 1.96 * line.gold_se, line.gold + 1.96 * line.gold_se,
                                    color=colors[objective], alpha=0.12, linewidth=0)
            ax.set_title(f"{method}, filler_bias={strength:g}")
            ax.set_xlabel({"d": "d = sqrt(KL to the reference)", "reward": "proxy reward r (mean)",
                           "step": "RL step"}[x])
            ax.set_ylabel({"gold": "gold of the policy's samples", "filler": "fillers per completion"}[y])
            ax.grid(alpha=0.3)
        for ax in axes[len(cells):]:
            ax.set_visible(False)
        axes[0].legend(fontsize=7)
        save_figure(fig, Path(out_dir) / f"{name}.png")
