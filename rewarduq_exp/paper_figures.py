"""The RewardUQ paper's comparison figures, drawn from run folders.

* Figure 2: RS_0.2 per method (bars) and backbone (groups), one panel per training dataset.
* Figure 3: reliability diagrams per method and backbone: predicted probability vs empirical frequency, plus the
  lower- and upper-bound curves.
* Figure 5: win rate, CT, CF, ECE and EBCE per method and backbone.

Each (method, backbone, training dataset) is shown with one configuration: the winner of the selection rule
(:mod:`rewarduq_exp.selection`, on the selection dataset), or, when no configuration passes, the one with the best
rank metric; those bars are hatched and those panels say so. Values are means over the configuration's seeds on
the plotted dataset (error bars: std over seeds). Figures use the Agg canvas through ``matplotlib.figure.Figure``,
as the run's own diagrams do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from rewarduq_exp.errors import UserError
from rewarduq_exp.metrics.calibration import calibration_curves
from rewarduq_exp.metrics.diagrams import draw_reliability, save_figure
from rewarduq_exp.run_records import RunRecord
from rewarduq_exp.selection import Configuration, Selection
from rewarduq_exp.table1 import method_name, method_order, model_order

FIGURE5_METRICS = (("win_rate", "win rate"), ("ct_rate", "CT rate"), ("cf_rate", "CF rate"), ("ece", "ECE"),
                   ("ebce", "EBCE"))
FORMATS = ("png", "pdf")
_COLORS = colormaps["tab10"]


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
    handles = [Patch(facecolor=colors[m], edgecolor="0.2", label=method_name(m))
               for m in sorted({x.method for x in shown}, key=method_order)]
    if any(not x.selected for x in shown):
        rank = shown[0].configuration.criteria.rank
        handles.append(Patch(facecolor="white", edgecolor="0.2", hatch="//", label=f"none passes: best {rank}"))
    return handles


def _colors(shown: list[Shown]) -> dict:
    methods = sorted({x.method for x in shown}, key=method_order)
    return {m: _COLORS(i % 10) for i, m in enumerate(methods)}


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
def figure3(shown: list[Shown], dataset: str, out_dir: Path, models: list[str] | None = None,
            n_bins: int = 20) -> list[Path] | None:
    """Reliability diagrams: rows are backbones (``models``, default all), columns methods."""
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
    fig = _figure((4.6 * len(methods), 4.4 * len(rows) + 0.4))
    axes = fig.subplots(len(rows), len(methods), squeeze=False)
    for r, (model, train) in enumerate(rows):
        for c, method in enumerate(methods):
            ax = axes[r][c]
            item = next((x for x in items if (x.method, x.model, x.train_dataset) == (method, model, train)), None)
            if item is None:
                ax.set_axis_off()
                continue
            run, table = tables[id(item)]
            curves = calibration_curves(table, n_bins=n_bins)
            ebce = 0.5 * (curves["lower"].lower_error() + curves["upper"].upper_error())
            heading = (f"{method_name(method)} / {model}" + (f" ({train})" if several_train else "")
                       + f"\nECE {curves['pred'].ece():.3f}, EBCE {ebce:.3f}\n{item.how}, seed {run.seed}")
            draw_reliability(fig, ax, curves["pred"], heading=heading,
                             xlabel="preference probability (prediction or bound)",
                             marker_label="mean predicted probability")
            handles = _bound_curves(ax, curves)
            ax.title.set_fontsize(9)
    # One legend for all panels: per-panel legends would cover the curves they explain. Fewer columns when there
    # are few panels, so the legend is never wider than the figure.
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 2 * len(methods)), fontsize=8)
    fig.suptitle(f"calibration on {dataset}")
    return _save(fig, out_dir / "figure3_calibration")


def _bound_curves(ax, curves) -> list:
    """Add the lower- and upper-bound reliability curves (each bound binned by its own value, as ELCE/EUCE are);
    remove the panel's legend and return its handles plus the curves' ones, for a figure-level legend."""
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


# ---------------------------------------------------------------------------------------------------- output
def _figure(size: tuple[float, float]) -> Figure:
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
