"""Reliability diagrams in the style of the RewardUQ paper's Figure 3.

Bars show the empirical preference frequency per probability bin, markers the bin's mean predicted probability,
and the bar colour the bin's share of the total weight. Curves come from
:func:`rewarduq_exp.metrics.calibration.calibration_curves`, so the errors in the titles equal those of
``compute_metrics``. Figures are built on ``matplotlib.figure.Figure`` with the Agg canvas: no pyplot, no GUI,
and no global figure registry to leak into. matplotlib (0.3 s to import) is imported by the functions that draw,
not by this module: a run imports it only once its figures are drawn, after its metrics are written.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from rewarduq_exp.core.atomic_write import atomic_path
from rewarduq_exp.core.inside_folder import make_folders
from rewarduq_exp.metrics.calibration import CalibrationCurve, calibration_curves

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PRED_FILE = "calibration_pred.png"
BOUNDS_FILE = "calibration_bounds.png"
_CMAP = "Blues"
_DPI = 150


def draw_reliability(
    fig: Figure, ax: Axes, curve: CalibrationCurve, *, heading: str, xlabel: str, marker_label: str,
    ylabel: str = "empirical preference frequency",
) -> None:
    """One reliability panel on ``ax``: bars, mean-probability markers, diagonal, legend and share colour bar."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    cmap = colormaps[_CMAP]
    edges = curve.edges
    centers = 0.5 * (edges[:-1] + edges[1:])
    occ = curve.occupied
    share = curve.share
    norm = Normalize(vmin=0.0, vmax=float(share.max()))
    # Dark edges keep bins with a tiny share visible although their fill is almost white.
    ax.bar(centers[occ], curve.accuracy[occ], width=np.diff(edges)[occ], color=cmap(norm(share[occ])),
           edgecolor="0.25", linewidth=0.6, zorder=2)
    # Drawn above the bars so it stays visible where frequencies exceed the diagonal.
    ax.plot([0, 1], [0, 1], "--", color="0.3", linewidth=1.0, zorder=3)
    # Markers only: a connecting line would hide the diagonal it usually lies on.
    ax.plot(centers[occ], curve.confidence[occ], "o", color="tab:red", markersize=4.5, zorder=4)
    handles = [
        Patch(facecolor=cmap(0.6), edgecolor="0.25", label="empirical frequency"),
        Line2D([], [], marker="o", linestyle="", color="tab:red", label=marker_label),
        Line2D([], [], linestyle="--", color="0.3", label="perfect calibration"),
    ]
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_aspect("equal")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(heading)
    ax.grid(alpha=0.3, zorder=0)
    ax.legend(handles=handles, loc="best", fontsize=8, framealpha=0.9)
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, shrink=0.8, label="share of weight")


def save_figure(fig: Figure, path: Path) -> None:
    """Save ``fig`` atomically; the format (png, pdf, ...) follows the file suffix. Inside a run, evaluation or
    downstream folder the write is checked when it happens (never through a link; see core/atomic_write.py)."""
    # Readers (e.g. a dashboard polling the run dir) never see a half-written PNG.
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fig.savefig(fh, format=path.suffix.lstrip(".") or "png", dpi=_DPI)


def _fixed_layout_figure(size: tuple[float, float], title: str, wspace: float = 0.2) -> Figure:
    """A figure with fixed margins that fit the square panels, their labels and colour bars.

    Not ``layout="constrained"``: its solver draws every figure an extra time to measure the text, which made the
    run's four diagrams per evaluated dataset most of a small run's time (0.65 s of 1 s per PNG).
    """
    from matplotlib.figure import Figure, SubplotParams

    top = 0.83 if title else 0.9
    return Figure(figsize=size, subplotpars=SubplotParams(left=0.1, right=0.97, bottom=0.11, top=top, wspace=wspace))


def plot_calibration_diagrams(
    predictions: pd.DataFrame, out_dir: Path, *, n_bins: int = 20, title: str = "", reported: dict | None = None
) -> list[Path]:
    """Write ``calibration_pred.png`` (ECE, eq. 7) and ``calibration_bounds.png`` (ELCE and EUCE, eq. 8) into
    ``out_dir`` (created if needed) and return their paths.

    Both use the symmetrised set, as the metrics do; ``title`` is added above the panels when given. ``reported``
    (the dataset's block of metrics.json) gives the ECE, ELCE and EUCE printed in the headings, so the numbers are
    those of the run's metrics even where the metrics average per-category values (RewardBench, official weighting)
    that one pooled curve cannot show; without it the curves' own values are printed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    curves = calibration_curves(predictions, n_bins=n_bins)
    reported = reported or {}
    ece = reported.get("ece", curves["pred"].ece())
    elce = reported.get("elce", curves["lower"].lower_error())
    euce = reported.get("euce", curves["upper"].upper_error())
    out_dir = make_folders(out_dir)  # inside a run folder: never through a link (core/inside_folder.py)
    paths = [out_dir / PRED_FILE, out_dir / BOUNDS_FILE]

    fig = _fixed_layout_figure((5.6, 4.8), title)
    FigureCanvasAgg(fig)
    try:
        draw_reliability(fig, fig.add_subplot(), curves["pred"],
                         heading=f"Predictions: ECE = {ece:.4f}",
                         xlabel="predicted preference probability", marker_label="mean predicted probability")
        if title:
            fig.suptitle(title)
        save_figure(fig, paths[0])
    finally:
        fig.clear()

    fig = _fixed_layout_figure((11.0, 4.8), title, wspace=0.3)
    FigureCanvasAgg(fig)
    try:
        ax_lo, ax_hi = fig.subplots(1, 2)
        draw_reliability(fig, ax_lo, curves["lower"],
                         heading=f"Lower bound: ELCE = {elce:.4f}",
                         xlabel="lower-bound preference probability", marker_label="mean lower bound")
        draw_reliability(fig, ax_hi, curves["upper"],
                         heading=f"Upper bound: EUCE = {euce:.4f}",
                         xlabel="upper-bound preference probability", marker_label="mean upper bound")
        if title:
            fig.suptitle(title)
        save_figure(fig, paths[1])
    finally:
        fig.clear()
    return paths
