"""The RewardUQ paper's comparison figures, drawn from run folders.

* Figure 2: RS_0.2 per method (bars) and backbone (groups), one panel per training dataset.
* Figure 3: reliability diagrams per method and backbone: predicted probability vs empirical frequency, plus the
  lower- and upper-bound curves. The curves are weighted as the metrics are (RewardBench: the subset weights of the
  run's ``metric.reward_bench_weighting``) and the ECE/EBCE printed are the run's metrics.json values, so the figure
  agrees with the selection and Table 1.
* Figure 4: background on the ranking score RS_alpha (Appendix A.4): (a) its attainable range against the win rate,
  (b) the weights f_alpha of eq. 20.
* Figure 5: win rate, CT, CF, ECE and EBCE per method and backbone.

Each (method, backbone, training dataset) is shown with one configuration: the winner of the selection rule
(:mod:`rewarduq_exp.analysis.selection`, on the selection dataset), or, when no configuration passes, the one with
the best rank metric; those bars are hatched and those panels say so. Values are means over the configuration's seeds on
the plotted dataset (error bars: std over seeds). Figures use the Agg canvas through ``matplotlib.figure.Figure``,
as the run's own diagrams do.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from rewarduq_exp.analysis.selection import Configuration, Selection
from rewarduq_exp.analysis.table1 import method_name, method_order, model_order
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.foreign_config import read_foreign_config
from rewarduq_exp.metrics.calibration import calibration_curves
from rewarduq_exp.metrics.diagrams import draw_reliability, save_figure
from rewarduq_exp.metrics.preference import ranking_score_weight
from rewarduq_exp.metrics.scoring import diagram_table, score_predictions
from rewarduq_exp.runs.run_records import RunRecord

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FIGURE5_METRICS = (("win_rate", "win rate"), ("ct_rate", "CT rate"), ("cf_rate", "CF rate"), ("ece", "ECE"),
                   ("ebce", "EBCE"))
FORMATS = ("png", "pdf")


def _palette():
    """The colours of the methods and alphas: tab10 (matplotlib imported here, when a figure is drawn)."""
    from matplotlib import colormaps

    return colormaps["tab10"]


@dataclass
class Shown:
    """The configuration shown for one (method, backbone, training dataset) and how it was chosen."""

    method: str
    model: str
    train_dataset: str
    configuration: Configuration
    selected: bool  # False: no configuration passes, this one has the best rank metric
    searched: list[str]  # the hyperparameters the sweep varied, for printing the chosen setting

    @property
    def how(self) -> str:
        rank = self.configuration.criteria.rank
        return "selected" if self.selected else f"best {rank}, none passes"

    def values(self, dataset: str, metric: str) -> tuple[float, float]:
        """Mean and std over the configuration's seeds of ``metric`` on ``dataset`` (NaN where it is missing)."""
        series = pd.to_numeric(pd.Series([r.metrics.get(dataset, {}).get(metric) for r in self.configuration.runs],
                                         dtype=object), errors="coerce").dropna()
        if series.empty:
            return math.nan, math.nan
        return float(series.mean()), float(series.std(ddof=1)) if len(series) > 1 else 0.0

    def predictions_run(self, dataset: str) -> RunRecord | None:
        """The lowest-seed run that wrote ``predictions/<dataset>.parquet`` (diagrams need one table)."""
        for r in self.configuration.runs:
            if (r.path / "predictions" / f"{dataset}.parquet").is_file():
                return r
        return None


def shown_configurations(selections: list[Selection]) -> list[Shown]:
    shown = []
    for s in selections:
        config, selected = s.best_effort()
        if config is not None:
            shown.append(Shown(s.method, s.model, s.dataset, config, selected, s.searched))
    return sorted(shown, key=lambda x: (x.train_dataset, method_order(x.method), model_order(x.model)))


def default_dataset(records: list[RunRecord], selection_dataset: str) -> str:
    """RewardBench when the runs were scored on it (the paper's figures), else the selection dataset."""
    found = {name for r in records for name in r.metrics}
    return "reward_bench_filtered" if "reward_bench_filtered" in found else selection_dataset


def check_dataset(records: list[RunRecord], dataset: str) -> None:
    found = sorted({name for r in records for name in r.metrics})
    if dataset not in found:
        raise UserError(f"no completed run has metrics for dataset '{dataset}'; datasets found: "
                        f"{', '.join(found) or '(none)'}")


def check_models(shown: list[Shown], models: list[str] | None) -> None:
    available = sorted({x.model for x in shown}, key=model_order)
    unknown = [m for m in models or [] if m not in available]
    if unknown:
        raise UserError(f"unknown model(s) {', '.join(unknown)} for --models; models in the runs: "
                        f"{', '.join(available) or '(none)'}")


# ---------------------------------------------------------------------------------------------------- bar charts
def _grouped_bars(ax, shown: list[Shown], dataset: str, metric: str, colors: dict) -> bool:
    """Bars of ``metric`` per method within groups of backbones; False when nothing has a value."""
    models = sorted({x.model for x in shown}, key=model_order)
    methods = sorted({x.method for x in shown}, key=method_order)
    width = 0.8 / len(methods)
    drawn = False
    for j, method in enumerate(methods):
        for i, model in enumerate(models):
            item = next((x for x in shown if (x.method, x.model) == (method, model)), None)
            if item is None:
                continue
            mean, std = item.values(dataset, metric)
            if math.isnan(mean):
                continue
            drawn = True
            # Hatching marks a configuration that did not pass the thresholds (shown as the best available).
            ax.bar(i - 0.4 + width * (j + 0.5), mean, width * 0.92, yerr=std if std > 0 else None, capsize=2,
                   color=colors[method], edgecolor="0.2", linewidth=0.5, hatch=None if item.selected else "//",
                   zorder=2)
    # Long backbone names collide under narrow groups; slanted labels stay readable.
    slant = len(models) > 2 or max(len(m) for m in models) > 10
    ax.set_xticks(range(len(models)), models, rotation=30 if slant else 0, ha="right" if slant else "center",
                  fontsize=8 if slant else None)
    ax.axhline(0.0, color="0.3", linewidth=0.8)
    ax.grid(axis="y", alpha=0.3, zorder=0)
    return drawn


def _legend_handles(shown: list[Shown], colors: dict) -> list:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=colors[m], edgecolor="0.2", label=method_name(m))
               for m in sorted({x.method for x in shown}, key=method_order)]
    if any(not x.selected for x in shown):
        rank = shown[0].configuration.criteria.rank
        handles.append(Patch(facecolor="white", edgecolor="0.2", hatch="//", label=f"none passes: best {rank}"))
    return handles


def _colors(shown: list[Shown]) -> dict:
    methods = sorted({x.method for x in shown}, key=method_order)
    palette = _palette()
    return {m: palette(i % 10) for i, m in enumerate(methods)}


def figure2(shown: list[Shown], dataset: str, out_dir: Path) -> list[Path] | None:
    """RS_0.2 per method and backbone; one panel per training dataset. None when there is nothing to draw."""
    metric = "rs_0.2"
    train_sets = sorted({x.train_dataset for x in shown})
    n_models = len({x.model for x in shown})
    fig = _figure((max(4.5, 1.1 * n_models + 2.5) * len(train_sets), 4.2))
    # One y scale for all panels, so training datasets compare at a glance.
    axes = fig.subplots(1, len(train_sets), squeeze=False, sharey=True)[0]
    colors = _colors(shown)
    drawn = False
    for ax, train in zip(axes, train_sets):
        drawn |= _grouped_bars(ax, [x for x in shown if x.train_dataset == train], dataset, metric, colors)
        ax.set_title(f"trained on {train}")
        ax.set_ylabel(f"RS$_{{0.2}}$ on {dataset}")
    if not drawn:
        return None
    fig.legend(handles=_legend_handles(shown, colors), loc="outside upper center", ncols=6, fontsize=9)
    return _save(fig, out_dir / "figure2_rs")


def figure5(shown: list[Shown], dataset: str, out_dir: Path) -> list[Path] | None:
    """Win rate, CT, CF, ECE and EBCE per method and backbone; one row of panels per training dataset."""
    train_sets = sorted({x.train_dataset for x in shown})
    n_models = len({x.model for x in shown})
    fig = _figure((len(FIGURE5_METRICS) * max(3.2, 0.8 * n_models + 1.5), 3.8 * len(train_sets) + 0.6))
    axes = fig.subplots(len(train_sets), len(FIGURE5_METRICS), squeeze=False, sharey="col")
    colors = _colors(shown)
    drawn = False
    for r, (row, train) in enumerate(zip(axes, train_sets)):
        subset = [x for x in shown if x.train_dataset == train]
        for ax, (metric, label) in zip(row, FIGURE5_METRICS):
            drawn |= _grouped_bars(ax, subset, dataset, metric, colors)
            if r == 0:
                ax.set_title(label)
        row[0].set_ylabel(f"trained on {train}")
    if not drawn:
        return None
    fig.suptitle(f"metrics on {dataset}")
    fig.legend(handles=_legend_handles(shown, colors), loc="outside lower center", ncols=6, fontsize=9)
    return _save(fig, out_dir / "figure5_metrics")


# ---------------------------------------------------------------------------------------------------- diagrams
@dataclass
class Panel:
    """One Figure 3 panel: the curves drawn and the numbers printed, as the run's metrics weight and report them."""

    curves: dict
    ece: float
    ebce: float
    note: str  # how the rows are weighted ("" for plain data)


def figure3_panel(run: RunRecord, table: pd.DataFrame, dataset: str, n_bins: int | None = None) -> Panel:
    """The curves of ``table`` weighted as the run's metrics weight them (its ``metric`` config: scoring, RewardBench
    weighting and, unless ``n_bins`` is given, bins) and the ECE/EBCE of its metrics.json block for ``dataset``; the
    latter are recomputed the same way when the block lacks them (a run scored before the metric existed)."""
    metric_cfg = _run_metric_config(run)
    scoring = str(metric_cfg.get("scoring", "auto"))
    weighting = str(metric_cfg.get("reward_bench_weighting", "official"))
    run_bins = int(metric_cfg.get("n_bins", 20))
    drawn, note = diagram_table(table, scoring, weighting)
    curves = calibration_curves(drawn, n_bins=n_bins or run_bins)
    block = run.metrics.get(dataset, {})
    if "ece" not in block or "ebce" not in block:
        # The run's own bins, so the numbers are those its metrics.json would hold.
        block = score_predictions(table, OmegaConf.create({
            "n_bins": run_bins, "alphas": [0.2], "scoring": scoring, "reward_bench_weighting": weighting,
            "kwise_tie_rule": str(metric_cfg.get("kwise_tie_rule", "official"))}))
    return Panel(curves, float(block["ece"]), float(block["ebce"]), note)


def _run_metric_config(run: RunRecord) -> dict:
    path = run.path / ".hydra" / "config.yaml"
    if not path.is_file():
        return {}
    node = read_foreign_config(path).get("metric")  # a run folder's config: read as data, no resolver called
    return OmegaConf.to_container(node, resolve=False) if node is not None else {}


def figure3(shown: list[Shown], dataset: str, out_dir: Path, models: list[str] | None = None,
            n_bins: int | None = None) -> list[Path] | None:
    """Reliability diagrams: rows are backbones (``models``, default all), columns methods; each panel as
    :func:`figure3_panel` (``n_bins`` default: each run's ``metric.n_bins``)."""
    items = [x for x in shown if not models or x.model in models]
    tables = {}
    for x in items:
        run = x.predictions_run(dataset)
        if run is not None:
            tables[id(x)] = (run, pd.read_parquet(run.path / "predictions" / f"{dataset}.parquet"))
    items = [x for x in items if id(x) in tables]
    if not items:
        return None
    rows = sorted({(x.model, x.train_dataset) for x in items}, key=lambda r: (model_order(r[0]), r[1]))
    methods = sorted({x.method for x in items}, key=method_order)
    several_train = len({x.train_dataset for x in items}) > 1
    panels = {id(x): figure3_panel(tables[id(x)][0], tables[id(x)][1], dataset, n_bins) for x in items}
    weighted = "; ".join(sorted({p.note for p in panels.values() if p.note}))
    # Under the official weighting the printed numbers are category means, which one pooled curve cannot show.
    mean = any("official" in p.note for p in panels.values())
    note = (f"{weighted}: curves pool the rows with the metrics' weights (each category 1/4); ECE/EBCE from "
            "metrics.json" + (" (official: mean of the 4 category values)" if mean else "")) if weighted else ""
    # Wrapped to the figure's width (about 13 characters per inch at this size): one method column is narrow.
    title = [f"calibration on {dataset}", *textwrap.wrap(note, int(13 * 4.6 * len(methods)))]
    # Room for the title lines and the legend below, on top of the square panels.
    fig = _figure((4.6 * len(methods), 4.4 * len(rows) + 0.6 + 0.2 * len(title)))
    axes = fig.subplots(len(rows), len(methods), squeeze=False)
    for r, (model, train) in enumerate(rows):
        for c, method in enumerate(methods):
            ax = axes[r][c]
            item = next((x for x in items if (x.method, x.model, x.train_dataset) == (method, model, train)), None)
            if item is None:
                ax.set_axis_off()
                continue
            run = tables[id(item)][0]
            panel = panels[id(item)]
            curves = panel.curves
            heading = (f"{method_name(method)} / {model}" + (f" ({train})" if several_train else "")
                       + f"\nECE {panel.ece:.3f}, EBCE {panel.ebce:.3f}\n{item.how}, seed {run.seed}")
            draw_reliability(fig, ax, curves["pred"], heading=heading,
                             xlabel="preference probability (prediction or bound)",
                             marker_label="mean predicted probability")
            handles = _bound_curves(ax, curves)
            ax.title.set_fontsize(9)
    # One legend for all panels: per-panel legends would cover the curves they explain. Fewer columns when there
    # are few panels, so the legend is never wider than the figure.
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 2 * len(methods)), fontsize=8)
    fig.suptitle("\n".join(title), fontsize=10)
    return _save(fig, out_dir / "figure3_calibration")


def _bound_curves(ax, curves) -> list:
    """Add the lower- and upper-bound reliability curves (each bound binned by its own value, as ELCE/EUCE are);
    remove the panel's legend and return its handles plus the curves' ones, for a figure-level legend."""
    from matplotlib.lines import Line2D

    extra = []
    for key, color, marker, label in (("lower", "tab:green", "v", "lower bound"),
                                      ("upper", "tab:purple", "^", "upper bound")):
        curve = curves[key]
        occ = curve.occupied
        ax.plot(curve.confidence[occ], curve.accuracy[occ], marker=marker, color=color, linewidth=1.0,
                markersize=3.5, zorder=5)
        extra.append(Line2D([], [], marker=marker, color=color, linewidth=1.0, label=f"{label} vs frequency"))
    legend = ax.get_legend()
    handles = list(legend.legend_handles) if legend is not None else []
    if legend is not None:
        legend.remove()
    return handles + extra


# ---------------------------------------------------------------------------------------------------- figure 4
FIGURE4_RANGE_ALPHAS = (0.0, 0.2, 1.0)  # panel (a), as in the paper
FIGURE4_ALPHAS = (0.0, 0.2, 0.5, 1.0)  # panel (b)
# The caption's worked example (alpha 0.2, win rate 0.6 -> 0.8), marked in panel (b).
_EXAMPLE_ALPHA, _EXAMPLE_RATES = 0.2, (0.6, 0.8)


def figure4(out_dir: Path, alphas=FIGURE4_ALPHAS, range_alphas=FIGURE4_RANGE_ALPHAS,
            shown: list[Shown] | None = None, dataset: str | None = None) -> list[Path]:
    """Background on RS_alpha (paper Figure 4, Appendix A.4).

    (a) For each of ``range_alphas``, the attainable range of RS_alpha against the win rate w: from -f_alpha(1 - w)
    (every false prediction confident, no true one) to f_alpha(w) (every true one confident, no false one), by
    eq. 20; RS_0 spans [-1, 1] whatever w, RS_1 spans [w - 1, w]. With ``shown`` and ``dataset``, the shown
    configurations' (win rate, RS_0.2) on ``dataset`` are marked.
    (b) The weights f_alpha(x) = x / (x + alpha (1 - x)) of eq. 20 for each of ``alphas``, with the caption's
    example: at alpha 0.2, w 0.6 -> 0.8 moves f(w) 0.88 -> 0.95 and f(1 - w) 0.77 -> 0.56.
    """
    from matplotlib.lines import Line2D

    x = np.linspace(0.0, 1.0, 401)
    every = sorted({float(a) for a in (*alphas, *range_alphas)})
    palette = _palette()
    color = {a: palette(i % 10) for i, a in enumerate(every)}
    fig = _figure((11.0, 5.0))
    ax_range, ax_weight = fig.subplots(1, 2)
    for a in range_alphas:
        a = float(a)
        upper, lower = ranking_score_weight(x, a), -ranking_score_weight(1.0 - x, a)
        ax_range.fill_between(x, lower, upper, color=color[a], alpha=0.07, linewidth=0)
        ax_range.plot(x, upper, color=color[a])
        ax_range.plot(x, lower, color=color[a], linestyle="--")
    for a in alphas:
        ax_weight.plot(x, ranking_score_weight(x, float(a)), color=color[float(a)])
    handles = [Line2D([], [], color=color[a], label=f"α = {a:g}") for a in every]
    handles += [Line2D([], [], color="0.3", label="(a) max  f$_α$(w)"),
                Line2D([], [], color="0.3", linestyle="--", label="(a) min  −f$_α$(1 − w)")]
    if shown and dataset:
        points = [(x_.values(dataset, "win_rate")[0], x_.values(dataset, "rs_0.2")[0]) for x_ in shown]
        points = [pt for pt in points if not any(math.isnan(v) for v in pt)]
        if points:
            ax_range.scatter(*zip(*points), marker="x", color="black", zorder=5)
            handles.append(Line2D([], [], marker="x", linestyle="", color="black",
                                  label=f"shown runs: RS$_{{0.2}}$ on {dataset}"))
    ax_range.axhline(0.0, color="0.3", linewidth=0.8)
    ax_range.set(xlabel="win rate w", ylabel="attainable RS$_α$", title="(a) ranking score ranges",
                 xlim=(0, 1), ylim=(-1.05, 1.05))

    # The caption's example: the true-confidence weight f(w) and the false-confidence weight f(1 - w).
    a = _EXAMPLE_ALPHA
    w0, w1 = _EXAMPLE_RATES
    for (u, v), label in (((w0, w1), "f(w)"), ((1 - w0, 1 - w1), "f(1 − w)")):
        fu, fv = ranking_score_weight(u, a), ranking_score_weight(v, a)
        ax_weight.annotate("", xy=(v, fv), xytext=(u, fu),
                           arrowprops={"arrowstyle": "->", "color": "black", "linewidth": 1.0})
        ax_weight.plot([u, v], [fu, fv], "o", color="black", markersize=3.5, zorder=5)
    f = {r: ranking_score_weight(r, a) for r in (w0, w1, 1 - w0, 1 - w1)}
    ax_weight.text(0.98, 0.03, f"α = {a:g}, w {w0:g} → {w1:g}:\n"
                               f"f(w) {f[w0]:.2f} → {f[w1]:.2f} (×{f[w1] / f[w0]:.2f})\n"
                               f"f(1 − w) {f[1 - w0]:.2f} → {f[1 - w1]:.2f} (×{f[1 - w1] / f[1 - w0]:.2f})",
                   transform=ax_weight.transAxes, ha="right", va="bottom", fontsize=8,
                   bbox={"facecolor": "white", "edgecolor": "0.7", "alpha": 0.9})
    ax_weight.set(xlabel="x (win rate w, or 1 − w)", ylabel="f$_α$(x) = x / (x + α(1 − x))",
                  title="(b) ranking score weights (eq. 20)", xlim=(0, 1), ylim=(0, 1.05))
    for ax in (ax_range, ax_weight):
        ax.grid(alpha=0.3)
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 4), fontsize=9)
    return _save(fig, out_dir / "figure4_ranking_score")


# ---------------------------------------------------------------------------------------------------- output
def _figure(size: tuple[float, float]) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, stem: Path) -> list[Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(f".{fmt}") for fmt in FORMATS]
    try:
        for path in paths:
            save_figure(fig, path)
    finally:
        fig.clear()
    return paths
