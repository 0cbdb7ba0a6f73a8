"""Metrics of pointwise score probes (BoRP, section 4 and 5.2), as numpy functions of human scores, predicted scores
and uncertainties. Names are flat under ``probe/…``.

* ``probe/alpha_interval``: Krippendorff's alpha between the human scores and the predictions treated as two raters,
  interval level, on the raw (continuous) predictions. The paper's headline "K-alpha" (Tables 1, 2, 4, 5).
* ``probe/alpha_ordinal``: ordinal level; the ordinal metric is defined over categories, so predictions (and the
  human scores) are rounded to the integer grid of the score range (1..5) first, the way a deployed scorer reports
  a grade. (On raw continuous values every distinct prediction would be a category of its own.)
* ``probe/pearson``, ``probe/spearman`` (scipy), ``probe/rmse``, ``probe/mae``.
* ``probe/u_abs_error_spearman``: Spearman correlation of the uncertainty ``u`` (eq. 3) with the absolute error: the
  paper's claim that ``u`` is a proxy for the error (section 5.2), as one number.
* ``probe/u_rater_std_spearman`` (only for data with a ``rater_std`` column, e.g. ``dataset=vader_ratings``):
  Spearman correlation of ``u`` with the human raters' disagreement on each response; computed where the eval set is
  scored (``rewarduq_exp/runner/evaluation.py``).
* RMSE by uncertainty bins (figure 3b): :func:`rmse_by_uncertainty` returns the per-bin table; the first and last
  bins' RMSE are reported as ``probe/rmse_low_u`` and ``probe/rmse_high_u``.

* Length (for data where each response's length is known; computed where the eval set is scored):
  ``probe/partial_pearson_given_length``: the Pearson correlation of prediction and score after removing from each
  its least-squares fit on the length covariates (:func:`length_covariates`: characters, words and backbone tokens
  of the response, raw and ``log1p``) with an intercept, on the eval set itself: what the probe knows beyond length.
  ``probe/pearson_with_log_length``: Pearson of the prediction with ``log1p(characters)``. A ridge on the same
  covariates is the length baseline (``probe/baseline/length_ridge/...``).

:func:`plot_probe_diagnostics` draws the predicted-vs-human panel and the RMSE-by-u panel into one PNG, and with
``compare`` two more: the probe's and the baselines' alpha and Pearson with the probe's partial correlation given
length, and their RMSE on an axis of its own; a red line names a baseline that matches or beats the probe (matplotlib
``Figure`` on the Agg canvas, written atomically through :func:`rewarduq_exp.metrics.diagrams.save_figure`;
imported by that function only, not with this module).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics.diagrams import save_figure

ALPHA_LEVELS = ("interval", "ordinal")
FIGURE_FILE = "probe_uncertainty.png"
# The krippendorff package builds a (units x values x values) array: 60 GB for 2000 continuous predictions. Above
# this many cells, the interval level uses the closed form for two complete raters below (exact, O(n)).
_KRIPPENDORFF_MAX_CELLS = 4_000_000


def _pair(y_true, y_pred) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(y_true, dtype=float).ravel()
    p = np.asarray(y_pred, dtype=float).ravel()
    if y.shape != p.shape:
        raise UserError(f"probe metrics need as many predictions as scores (got {len(p)} and {len(y)})")
    if len(y) == 0:
        raise UserError("probe metrics need at least one scored sample")
    if not (np.isfinite(y).all() and np.isfinite(p).all()):
        raise UserError("probe metrics got NaN/inf scores or predictions; all values must be finite")
    return y, p


def interval_alpha_two_raters(a: np.ndarray, b: np.ndarray) -> float:
    """Krippendorff's interval alpha for two raters who both rated every unit: ``1 - D_o / D_e`` with the observed
    disagreement ``D_o = mean_u (a_u - b_u)^2`` and the expected one ``D_e = 2 * sum_v (v - mean)^2 / (N - 1)`` over
    all ``N = 2n`` values (Krippendorff 2011 with ``m_u = 2`` pairable values per unit)."""
    values = np.concatenate([a, b])
    d_e = 2.0 * np.sum((values - values.mean()) ** 2) / (len(values) - 1)
    if d_e == 0:
        return float("nan")
    return float(1.0 - np.mean((a - b) ** 2) / d_e)


def krippendorff_alpha(y_true, y_pred, level: str = "interval", score_range: tuple[float, float] = (1, 5)) -> float:
    """Krippendorff's alpha between human scores and predictions as two raters (module docstring); NaN where it is
    undefined (a single value throughout)."""
    import krippendorff

    y, p = _pair(y_true, y_pred)
    if level not in ALPHA_LEVELS:
        raise UserError(f"Krippendorff level={level!r} is invalid; allowed: {', '.join(ALPHA_LEVELS)}")
    if level == "ordinal":
        lo, hi = int(np.ceil(score_range[0])), int(np.floor(score_range[1]))
        domain = np.arange(lo, hi + 1, dtype=float)
        data = np.clip(np.rint(np.vstack([y, p])), lo, hi)
        if len(np.unique(data)) < 2:
            return float("nan")
        return float(krippendorff.alpha(reliability_data=data, value_domain=domain, level_of_measurement="ordinal"))
    n_values = len(np.unique(np.concatenate([y, p])))
    if n_values < 2:
        return float("nan")
    if len(y) * n_values**2 > _KRIPPENDORFF_MAX_CELLS:
        return interval_alpha_two_raters(y, p)
    return float(krippendorff.alpha(reliability_data=np.vstack([y, p]), level_of_measurement="interval"))


def _corr(fn, a, b) -> float:
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")  # a constant has no correlation (scipy would warn and return nan)
    return float(fn(a, b)[0])


def pearson(y_true, y_pred) -> float:
    y, p = _pair(y_true, y_pred)
    return _corr(stats.pearsonr, y, p) if len(y) > 1 else float("nan")


def spearman(y_true, y_pred) -> float:
    y, p = _pair(y_true, y_pred)
    return _corr(stats.spearmanr, y, p) if len(y) > 1 else float("nan")


def rmse(y_true, y_pred) -> float:
    y, p = _pair(y_true, y_pred)
    return float(np.sqrt(np.mean((y - p) ** 2)))


def rmse_by_uncertainty(y_true, y_pred, u, n_bins: int = 5) -> pd.DataFrame:
    """RMSE per quantile bin of the uncertainty ``u`` (the paper's figure 3b).

    Bin edges are the ``0, 1/n_bins, ..., 1`` quantiles of ``u``; bin ``i`` holds ``edges[i] <= u < edges[i+1]`` (the
    last bin includes its upper edge). Tied quantiles (many equal ``u``) merge bins, so fewer than ``n_bins`` rows can
    come back. Columns: ``bin`` (0 = lowest u), ``u_low``, ``u_high`` (edges), ``u_mean``, ``count``, ``rmse``,
    ``mae``.
    """
    y, p = _pair(y_true, y_pred)
    u = np.asarray(u, dtype=float).ravel()
    if u.shape != y.shape or not np.isfinite(u).all():
        raise UserError(f"uncertainty u must hold one finite value per sample (got {u.shape[0]} for {len(y)})")
    if int(n_bins) < 1:
        raise UserError(f"n_bins={n_bins} is invalid: must be an integer >= 1")
    edges = np.unique(np.quantile(u, np.linspace(0.0, 1.0, int(n_bins) + 1)))
    if len(edges) == 1:
        edges = np.array([edges[0], edges[0]])
    which = np.clip(np.searchsorted(edges, u, side="right") - 1, 0, len(edges) - 2)
    rows = []
    for b in range(len(edges) - 1):
        sel = which == b
        if not sel.any():
            continue
        err = y[sel] - p[sel]
        rows.append({"bin": len(rows), "u_low": float(edges[b]), "u_high": float(edges[b + 1]),
                     "u_mean": float(u[sel].mean()), "count": int(sel.sum()),
                     "rmse": float(np.sqrt(np.mean(err ** 2))), "mae": float(np.mean(np.abs(err)))})
    return pd.DataFrame(rows, columns=["bin", "u_low", "u_high", "u_mean", "count", "rmse", "mae"])


def probe_metrics(y_true, y_pred, u=None, *, score_range: tuple[float, float] = (1, 5), n_bins: int = 5) -> dict:
    """All probe metrics as a flat ``probe/…`` dict (module docstring); the uncertainty ones only when ``u`` is
    given."""
    y, p = _pair(y_true, y_pred)
    out = {
        "probe/alpha_interval": krippendorff_alpha(y, p, "interval", score_range),
        "probe/alpha_ordinal": krippendorff_alpha(y, p, "ordinal", score_range),
        "probe/pearson": pearson(y, p),
        "probe/spearman": spearman(y, p),
        "probe/rmse": rmse(y, p),
        "probe/mae": float(np.mean(np.abs(y - p))),
        "probe/n": int(len(y)),
    }
    if u is not None:
        u = np.asarray(u, dtype=float).ravel()
        table = rmse_by_uncertainty(y, p, u, n_bins)
        out["probe/u_mean"] = float(u.mean())
        out["probe/u_abs_error_spearman"] = spearman(u, np.abs(y - p))
        out["probe/rmse_low_u"] = float(table["rmse"].iloc[0])
        out["probe/rmse_high_u"] = float(table["rmse"].iloc[-1])
    return out


# The length of each response, in the order :func:`length_covariates` reads them.
LENGTH_COLUMNS = ("n_chars", "n_words", "n_tokens")


def length_covariates(lengths) -> np.ndarray:
    """(n, 6) covariates of an (n, 3) array of response lengths (:data:`LENGTH_COLUMNS`): the raw counts and their
    ``log1p``, so a linear fit on them follows both a linear and a saturating effect of length."""
    lengths = np.asarray(lengths, dtype=float)
    if lengths.ndim != 2 or lengths.shape[1] != len(LENGTH_COLUMNS) or not np.isfinite(lengths).all() \
            or (lengths < 0).any():
        raise UserError(f"length covariates need an (n, {len(LENGTH_COLUMNS)}) array of counts >= 0 "
                        f"({', '.join(LENGTH_COLUMNS)}); got shape {lengths.shape}")
    return np.hstack([lengths, np.log1p(lengths)])


def _residual(v: np.ndarray, design: np.ndarray) -> np.ndarray:
    coef, *_ = np.linalg.lstsq(design, v, rcond=None)
    return v - design @ coef


def partial_pearson(a, b, covariates) -> float:
    """Pearson correlation of ``a`` and ``b`` controlling for ``covariates`` (n, k): the correlation of the residuals
    of each after its least-squares fit on ``[1, covariates]`` (rank-deficient covariates are fine: ``lstsq``). NaN
    where a residual is (numerically) zero: the covariates explain that variable entirely."""
    a, b = _pair(a, b)
    cov = np.asarray(covariates, dtype=float).reshape(len(a), -1)
    design = np.hstack([np.ones((len(a), 1)), cov])
    ra, rb = _residual(a - a.mean(), design), _residual(b - b.mean(), design)
    scale = max(np.abs(a - a.mean()).max(), np.abs(b - b.mean()).max(), 1.0)
    if len(a) < 3 or min(np.abs(ra).max(), np.abs(rb).max()) <= 1e-9 * scale:
        return float("nan")
    return float(np.dot(ra, rb) / np.sqrt(np.dot(ra, ra) * np.dot(rb, rb)))


def length_metrics(y_true, y_pred, lengths) -> dict:
    """``probe/partial_pearson_given_length`` and ``probe/pearson_with_log_length`` (module docstring) of the
    predictions against the scores, given the (n, 3) response lengths (:data:`LENGTH_COLUMNS`)."""
    y, p = _pair(y_true, y_pred)
    covariates = length_covariates(lengths)
    return {"probe/partial_pearson_given_length": partial_pearson(p, y, covariates),
            "probe/pearson_with_log_length": pearson(np.log1p(covariates[:, 0]), p)}


# The bars of the agreement panel (c), on one axis as they share a scale (-1..1 for sensible predictions), and of the
# error panel (d), on its own axis (a judge's RMSE of 2.45 would squeeze every correlation): (key under probe/, label).
AGREEMENT = (("alpha_interval", "K-alpha"), ("pearson", "Pearson"))
ERROR = (("rmse", "RMSE"),)
COMPARED = AGREEMENT + ERROR
# The probe's own bar in panel (c): what it knows beyond length (a baseline has no such number).
PARTIAL = ("partial_pearson_given_length", "partial r | length")


def comparison(metrics: dict) -> dict[str, dict[str, float]]:
    """``{"probe": {...}, "<baseline>": {...}}`` of :data:`COMPARED` read from a dataset's probe metrics
    (``probe/<key>`` and ``probe/baseline/<name>/<key>``), the probe also with its :data:`PARTIAL` correlation; a
    metric a model lacks (a constant answer, a run without lengths) is NaN."""
    def read(prefix: str, keys) -> dict[str, float]:
        values = {key: metrics.get(f"{prefix}{key}") for key in keys}
        return {key: float("nan") if v is None else float(v) for key, v in values.items()}

    keys = [key for key, _ in COMPARED]
    names = sorted({k.split("/")[2] for k in metrics if k.startswith("probe/baseline/")})
    return {"probe": read("probe/", [*keys, PARTIAL[0]]),
            **{name: read(f"probe/baseline/{name}/", keys) for name in names}}


# Scores on more distinct values than this (means over raters) are binned in panel (a) instead of one point per value.
MAX_SCORE_LEVELS = 10


def plot_probe_diagnostics(y_true, y_pred, u, path: str | Path, *, n_bins: int = 5, title: str = "",
                           score_range: tuple[float, float] = (1, 5), seed: int = 0,
                           compare: dict[str, dict[str, float]] | None = None) -> Path:
    """Write a PNG with (a) predicted vs human score (jittered points, per-score mean) and (b) RMSE per quantile bin
    of ``u`` with the bin counts (figure 3b); with ``compare`` (:func:`comparison`: the probe and the baselines of the
    same rows) also (c) their alpha and Pearson and the probe's partial correlation given length, (d) their RMSE on
    an axis of its own, and in red the line that says which baseline matches or beats the probe
    (:mod:`rewarduq_exp.metrics.probe_rivals`). Returns the path."""
    from matplotlib.figure import Figure

    y, p = _pair(y_true, y_pred)
    table = rmse_by_uncertainty(y, p, u, n_bins)
    path = Path(path)
    fig = Figure(figsize=(12, 8.8) if compare else (10, 4.2))
    ax_a, ax_b, *ax_cd = fig.subplots(2, 2).ravel() if compare else fig.subplots(1, 2)
    levels = np.unique(y)
    if len(levels) <= MAX_SCORE_LEVELS:  # ratings on a few levels: jittered, the mean prediction per level
        jitter = np.random.default_rng(seed).uniform(-0.15, 0.15, len(y))
        centres, means = levels, [p[y == v].mean() for v in levels]
    else:  # continuous scores (a mean over raters): the mean per quantile bin of the score, no jitter
        jitter = np.zeros(len(y))
        bins = np.array_split(np.argsort(y, kind="stable"), MAX_SCORE_LEVELS)
        centres, means = [y[b].mean() for b in bins], [p[b].mean() for b in bins]
    ax_a.scatter(y + jitter, p, s=6, alpha=0.35, color="tab:blue", label="samples")
    ax_a.plot(centres, means, "o-", color="tab:red", label="mean prediction")
    lo, hi = score_range
    ax_a.plot([lo, hi], [lo, hi], "--", color="0.4", linewidth=1.0, label="perfect agreement")
    ax_a.set_xlabel("human score")
    ax_a.set_ylabel("predicted score")
    heading = f"(a) Pearson {pearson(y, p):.3f}, K-alpha {krippendorff_alpha(y, p, 'interval', score_range):.3f}"
    partial = (compare or {}).get("probe", {}).get(PARTIAL[0], float("nan"))
    ax_a.set_title(heading + (f", partial r given length {partial:.3f}" if np.isfinite(partial) else ""),
                   fontsize=10)
    ax_a.legend(loc="upper left", fontsize=8)
    ax_a.grid(alpha=0.3)
    labels = [f"{r.u_low:.2g}-{r.u_high:.2g}" for r in table.itertuples()]
    bars = ax_b.bar(np.arange(len(table)), table["rmse"], color="tab:orange", edgecolor="0.25")
    for bar, count in zip(bars, table["count"]):
        ax_b.annotate(f"n={count}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                      va="bottom", fontsize=7)
    ax_b.set_xticks(np.arange(len(table)), labels, rotation=30, fontsize=7)
    ax_b.set_xlabel("u = |score(final) - score(intermediate)|, quantile bins")
    ax_b.set_ylabel("RMSE")
    ax_b.set_title("(b) RMSE by uncertainty", fontsize=10)
    ax_b.grid(alpha=0.3, axis="y")
    note = None
    if compare:
        from rewarduq_exp.metrics.probe_rivals import METRIC, rival_note

        _plot_agreement(ax_cd[0], compare)
        _plot_error(ax_cd[1], compare)
        note = rival_note(compare["probe"].get(METRIC, float("nan")),
                          {n: m.get(METRIC, float("nan")) for n, m in compare.items() if n != "probe"}, partial)
    if title:
        fig.suptitle(title)
    if note:
        fig.text(0.5, 0.955 if title else 0.985, textwrap.fill(note, 160), ha="center", va="top", fontsize=8,
                 color="tab:red")
    if compare:
        fig.subplots_adjust(left=0.07, right=0.98, bottom=0.1, top=0.88 if title or note else 0.94, wspace=0.22,
                            hspace=0.45)
    else:
        fig.subplots_adjust(left=0.07, right=0.98, bottom=0.2, top=0.85 if title else 0.9, wspace=0.25)
    save_figure(fig, path)
    return path


COLORS = ("tab:blue", "tab:green", "tab:purple", "tab:gray", "tab:brown", "tab:olive")


def _bars(ax, xs, values, width: float, color, label=None) -> None:
    """Bars at ``xs`` with their values written on them (upright on wide bars); a missing value is a zero-height bar
    that says n/a."""
    ax.bar(xs, np.nan_to_num(values), width, label=label, color=color, edgecolor="0.25")
    for x, v in zip(xs, values):
        ax.annotate("n/a" if np.isnan(v) else f"{v:.2f}", (x, 0 if np.isnan(v) else v), ha="center",
                    va="top" if v < 0 else "bottom", fontsize=7, rotation=90 if width < 0.25 else 0)


def _limits(ax, values) -> None:
    found = np.asarray(values, dtype=float)
    found = found[np.isfinite(found)]
    low, high = (min(found.min(), 0.0), max(found.max(), 0.0)) if len(found) else (0.0, 1.0)
    span = (high - low) or 1.0
    ax.set_ylim(low - 0.25 * span * (low < 0), high + 0.25 * span)  # room for the value labels
    ax.axhline(0, color="0.3", linewidth=0.8)
    ax.grid(alpha=0.3, axis="y")


def _plot_agreement(ax, compare: dict[str, dict[str, float]]) -> None:
    """Panel (c): one group of bars per metric of :data:`AGREEMENT`, one bar per model, then the probe's partial
    correlation given length; a missing value says n/a."""
    names = list(compare)
    width = 0.8 / len(names)
    shown = []
    for i, name in enumerate(names):
        xs = np.arange(len(AGREEMENT)) + (i - (len(names) - 1) / 2) * width
        values = np.array([compare[name].get(key, float("nan")) for key, _ in AGREEMENT], dtype=float)
        _bars(ax, xs, values, width, COLORS[i % len(COLORS)], name.replace("_", " "))
        shown.extend(values)
    partial = np.array([compare["probe"].get(PARTIAL[0], float("nan"))])
    _bars(ax, np.array([float(len(AGREEMENT))]), partial, width, COLORS[0])
    shown.extend(partial)
    ax.set_xticks(np.arange(len(AGREEMENT) + 1), [label for _, label in AGREEMENT] + [PARTIAL[1]])
    ax.set_title("(c) agreement with the ratings, same rows", fontsize=10)
    _limits(ax, shown)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.07), ncol=len(names), fontsize=7, frameon=False)


def _plot_error(ax, compare: dict[str, dict[str, float]]) -> None:
    """Panel (d): each model's RMSE, on an axis of its own."""
    names = list(compare)
    values = np.array([compare[name].get(ERROR[0][0], float("nan")) for name in names], dtype=float)
    for i, value in enumerate(values):
        _bars(ax, np.array([float(i)]), np.array([value]), 0.6, COLORS[i % len(COLORS)])
    ax.set_xticks(np.arange(len(names)), [n.replace("_", " ") for n in names], fontsize=8)
    ax.set_ylabel(ERROR[0][1])
    ax.set_title(f"(d) {ERROR[0][1]}, same rows (lower is better)", fontsize=10)
    _limits(ax, values)
