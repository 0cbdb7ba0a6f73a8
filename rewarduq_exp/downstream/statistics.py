"""Intervals for the differences the downstream tasks claim, respecting their design: every table and figure of
``downstream.py`` takes its intervals from here.

Every rule of one run picks from the same candidates of the same prompts, and the runs of one world (its training
seeds) meet the same prompts too: a gain of r - k u over r, or a drop of a curve from one n to a later one, is a
paired difference. Its interval comes from a bootstrap that resamples what is independent and keeps what is shared:
the prompts (shared by every rule, n and run of a world) and, where a cell holds several runs, the runs, each drawn
independently with replacement (a crossed, two-way bootstrap over runs and prompts). The level of a curve has a far
wider spread over prompts than its differences, so a "within a standard error" judged on the level is wrong.

Values come as arrays ``(runs, prompts, ...)``; the resampled mean of a bootstrap draw is a weighted mean with
multinomial counts as weights, so B draws cost one ``einsum`` instead of B copies.

- :func:`bootstrap_means`: B resampled means of ``(R, P, J)`` values (J: the points of a curve, or 1);
- :func:`mean_interval`: the mean over runs and prompts and its 95 % percentile interval, for a paired difference
  computed per run and prompt (``a - b``);
- :func:`cell_difference_interval`: the difference between two cells of one world (different runs, shared prompts),
  e.g. a shortcut's cost against its control;
- :func:`largest_drop` / :func:`largest_drop_interval`: the largest fall of a curve from any earlier n to any later
  one, with an interval from a simultaneous band over every pair of points (a curve that dips and recovers falls;
  one that rises throughout has drop 0). "It overoptimizes" means the interval's lower end is above 0;
- :func:`gao_fit` / :func:`gao_fit_interval`: Gao et al.'s best-of-n form gold(d) - gold(0) = d (alpha - beta d),
  d = sqrt(KL), fitted by least squares, with its peak;
- :func:`paired_t_interval`: active learning's comparison with random, paired by repeat (a handful of repeats, each a
  whole retraining: a t-interval over the per-repeat differences, not a bootstrap of five numbers).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from scipy.stats import t as t_dist

from rewarduq_exp.core.bootstrap import LEVEL, bootstrap_weights, percentile_interval  # noqa: F401 (re-exported)

DRAWS = 2000


def _as_runs_prompts(values) -> np.ndarray:
    """``values`` as (R, P, J): (P,) is one run and one point, (P, J) one run, (R, P, J) as given."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim == 1:
        v = v[None, :, None]
    elif v.ndim == 2:
        v = v[None]
    if v.ndim != 3 or v.shape[0] < 1 or v.shape[1] < 1:
        raise ValueError(f"values must be (prompts,), (prompts, points) or (runs, prompts, points); got {v.shape}")
    return v


def bootstrap_means(values, draws: int = DRAWS, seed: int = 0) -> np.ndarray:
    """(draws, J): the mean over runs and prompts of ``values`` (R, P, J) in each resample, runs and prompts drawn
    with replacement independently (one run: prompts only). The same prompts are drawn for every run and point, so
    differences between points and runs stay paired."""
    v = _as_runs_prompts(values)
    rng = np.random.default_rng(seed)
    runs, prompts = v.shape[:2]
    w_runs = bootstrap_weights(runs, draws, rng) if runs > 1 else np.ones((draws, 1))
    w_prompts = bootstrap_weights(prompts, draws, rng)
    return np.einsum("br,bp,rpj->bj", w_runs, w_prompts, v, optimize=True) / (runs * prompts)


def mean_interval(values, draws: int = DRAWS, seed: int = 0, level: float = LEVEL) -> tuple[float, float, float]:
    """The mean of ``values`` ((P,), or (R, P): one paired difference per run and prompt) and its percentile
    interval from the crossed bootstrap over runs and prompts."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim not in (1, 2):
        raise ValueError(f"mean_interval takes (prompts,) or (runs, prompts) values; got {v.shape}")
    v = (v[None] if v.ndim == 1 else v)[:, :, None]  # (runs, prompts, one point)
    boot = bootstrap_means(v, draws, seed)[:, 0]
    lo, hi = percentile_interval(boot, level)
    return float(v.mean()), float(lo), float(hi)


def cell_difference_interval(a, b, draws: int = DRAWS, seed: int = 0,
                             level: float = LEVEL) -> tuple[float, float, float]:
    """mean(a) - mean(b) for two cells of one world, ``a`` (Ra, P) and ``b`` (Rb, P): different runs on the same
    prompts. Each draw resamples the prompts once for both cells (they are shared) and the runs of each cell on
    their own (they are not)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"cells must be (runs, prompts) on the same prompts; got {a.shape} and {b.shape}")
    rng = np.random.default_rng(seed)
    w_prompts = bootstrap_weights(a.shape[1], draws, rng) / a.shape[1]
    means = [np.einsum("br,bp,rp->b", bootstrap_weights(len(v), draws, rng) / len(v), w_prompts, v) for v in (a, b)]
    lo, hi = percentile_interval(means[0] - means[1], level)
    return float(a.mean() - b.mean()), float(lo), float(hi)


def largest_drop(curve) -> tuple[float, int, int]:
    """The largest fall of ``curve`` (J,) from any point to a later one, max over i < j of curve[i] - curve[j], and
    the pair (i, j); 0 and (0, 0) when it never falls (J = 1 included)."""
    g = np.asarray(curve, dtype=np.float64)
    if g.size < 2:
        return 0.0, 0, 0
    falls = g[:, None] - g[None, :]
    falls[np.tril_indices(g.size)] = -np.inf  # only earlier -> later
    i, j = np.unravel_index(int(np.argmax(falls)), falls.shape)
    return (float(falls[i, j]), int(i), int(j)) if falls[i, j] > 0 else (0.0, 0, 0)


def largest_drop_interval(values, draws: int = DRAWS, seed: int = 0, level: float = LEVEL) -> dict:
    """The largest drop of the mean curve of ``values`` ((P, J) or (R, P, J): gold of the pick per run, prompt and n)
    and a ``level`` interval for it.

    The largest drop is a maximum over pairs, which a plain bootstrap of the maximum gets wrong where the curve is
    flat (noise alone makes some pair fall). Instead every pair's difference d_ij = g_i - g_j (i < j) gets a
    simultaneous band: d_ij +- c se_ij, with se_ij its bootstrap standard error and c the ``level`` quantile of
    max_ij |d*_ij - d_ij| / se_ij over the draws (a studentised max-t band). With probability ``level`` every true
    d_ij lies in its band at once, so the true largest drop max(0, max d_ij) lies in [max(0, max lower),
    max(0, max upper)]. ``lo > 0`` is the test "the curve falls somewhere", at the stated level.

    Returns ``drop``, ``lo``, ``hi``, ``from_index``, ``to_index`` (the pair of the point estimate) and ``c``."""
    v = _as_runs_prompts(values)
    curve = v.mean((0, 1))
    drop, i, j = largest_drop(curve)
    if curve.size < 2:
        return {"drop": 0.0, "lo": 0.0, "hi": 0.0, "from_index": 0, "to_index": 0, "c": np.nan}
    boot = bootstrap_means(v, draws, seed)                      # (B, J)
    upper_i, upper_j = np.triu_indices(curve.size, k=1)
    diff = curve[upper_i] - curve[upper_j]                        # (pairs,)
    boot_diff = boot[:, upper_i] - boot[:, upper_j]               # (B, pairs)
    se = boot_diff.std(0, ddof=1)
    varies = se > 1e-12 * max(1.0, float(np.abs(curve).max()))
    if not varies.any():  # every prompt alike: the differences are exact
        top = float(max(0.0, diff.max()))
        return {"drop": drop, "lo": top, "hi": top, "from_index": i, "to_index": j, "c": 0.0}
    t = np.abs(boot_diff[:, varies] - diff[varies]) / se[varies]
    c = float(np.quantile(t.max(1), level))
    half = np.where(varies, c * se, 0.0)
    return {"drop": drop, "lo": float(max(0.0, (diff - half).max())), "hi": float(max(0.0, (diff + half).max())),
            "from_index": i, "to_index": j, "c": c}


def gao_fit(d, gain) -> tuple[float, float]:
    """Least-squares alpha, beta of gain = d (alpha - beta d) (Gao et al. 2023, best-of-n: gain = gold(d) - gold(0),
    d = sqrt(KL)); ``gain`` (J,) or (..., J) fits every leading row at once."""
    d = np.asarray(d, dtype=np.float64)
    design = np.stack([d, -d ** 2], axis=1)                       # (J, 2)
    y = np.asarray(gain, dtype=np.float64)
    coef, *_ = np.linalg.lstsq(design, y.reshape(-1, d.size).T, rcond=None)  # (2, rows)
    alpha, beta = coef
    return (float(alpha[0]), float(beta[0])) if y.ndim == 1 else (alpha.reshape(y.shape[:-1]),
                                                                   beta.reshape(y.shape[:-1]))


def gao_peak(alpha, beta) -> tuple[np.ndarray, np.ndarray]:
    """The fitted curve's peak: d* = alpha / (2 beta) and its gain alpha^2 / (4 beta) where beta > 0 and alpha > 0;
    a curve that never turns down (beta <= 0) peaks at d = inf; one that falls from the start (alpha <= 0, beta > 0)
    at d = 0 with gain 0."""
    alpha, beta = np.asarray(alpha, dtype=np.float64), np.asarray(beta, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        d_peak = np.where(beta > 0, np.maximum(alpha, 0) / (2 * beta), np.inf)
        gain = np.where(beta > 0, np.maximum(alpha, 0) ** 2 / (4 * beta), np.inf)
    return d_peak, gain


def gao_fit_interval(d, values, draws: int = DRAWS, seed: int = 0, level: float = LEVEL) -> dict:
    """:func:`gao_fit` on the mean curve of ``values`` ((P, J) or (R, P, J), gold per prompt and n; the gain is taken
    from the first point, d[0] = 0), with percentile intervals from the crossed bootstrap for alpha, beta, the peak's
    d and its gain (an interval end of inf: some resamples never turn down). Also the fit's R^2."""
    v = _as_runs_prompts(values)
    curve = v.mean((0, 1))
    alpha, beta = gao_fit(d, curve - curve[0])
    d_peak, gain = gao_peak(alpha, beta)
    boot = bootstrap_means(v, draws, seed)
    b_alpha, b_beta = gao_fit(d, boot - boot[:, :1])
    b_peak, b_gain = gao_peak(b_alpha, b_beta)
    fitted = np.asarray(d) * (alpha - beta * np.asarray(d))
    resid = (curve - curve[0]) - fitted
    total = ((curve - curve[0]) - (curve - curve[0]).mean()) ** 2
    out = {"alpha": alpha, "beta": beta, "d_peak": float(d_peak), "gain_peak": float(gain),
           "r2": float(1 - (resid ** 2).sum() / total.sum()) if total.sum() > 0 else np.nan}
    for name, boot_values in (("alpha", b_alpha), ("beta", b_beta), ("d_peak", b_peak), ("gain_peak", b_gain)):
        lo, hi = percentile_interval(boot_values, level)
        out[f"{name}_lo"], out[f"{name}_hi"] = float(lo), float(hi)
    return out


class PairedInterval(NamedTuple):
    """Paired differences reduced along an axis: their mean, the t-interval, the t-test's p-value, how many there
    are (finite ones) and how many are > 0."""
    mean: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    p: np.ndarray
    n: np.ndarray
    wins: np.ndarray


def paired_t_interval(diffs, axis: int = -1, level: float = 0.95) -> PairedInterval:
    """The paired t-interval of the differences ``diffs`` along ``axis`` (one per repeat; NaN ones left out):
    mean ± t_{(1+level)/2, n-1} sd / sqrt(n), and the two-sided p-value of the paired t-test (as
    ``scipy.stats.ttest_rel`` of the two sides); interval and p-value are NaN for n < 2. Vectorised: every other axis
    is a separate comparison."""
    d = np.asarray(diffs, dtype=float)
    finite = np.isfinite(d)
    n = finite.sum(axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(finite, d, 0.0).sum(axis=axis) / n
        dev = np.where(finite, d - np.expand_dims(mean, axis), 0.0)
        se = np.sqrt((dev ** 2).sum(axis=axis) / (n - 1) / n)
        enough = n >= 2
        df = np.where(enough, n - 1, 1)
        half = np.where(enough, t_dist.ppf(0.5 + level / 2, df) * se, np.nan)
        p = np.where(enough, 2 * t_dist.sf(np.abs(mean / se), df), np.nan)
    return PairedInterval(mean, mean - half, mean + half, p, n, (d > 0).sum(axis=axis))
