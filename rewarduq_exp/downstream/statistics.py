"""Intervals for the differences the downstream tasks claim, respecting their design: every table and figure of
``downstream.py`` takes its intervals from here.

**The design.** Every rule of one run picks from the same candidates of the same prompts, and the runs of one world
(its training seeds) meet the same prompts too: a gain of r - k u over r, or a drop of a curve from one n to a later
one, is a paired difference, computed per run and prompt. Values come as arrays ``(runs, prompts, ...)``: a cell of
one world. Runs and prompts are crossed (every run meets every prompt), so the mean of a cell varies with both:

    Var(mean) = s_run^2 / R + s_prompt^2 / P + s_noise^2 / (R P),

estimated from the cell's two-way mean squares (the balanced crossed random-effects model; each variance component
truncated at 0). A contrast of cells on the same prompts (a shortcut's cost against its control: different runs,
shared prompts) gets the same decomposition with the prompts' contrast in place of the prompts' mean. Worlds are
never pooled here: a world is a replicate of the whole study, and :func:`over_worlds_interval` treats them as a
random effect.

**The interval: a studentised bootstrap, never narrower than Student's t.** The plain percentile bootstrap used
before under-covered at the sizes the studies use, for two reasons that call for different cures, both measured
with known truth (``downstream/interval_coverage.py``, ``scripts/interval_coverage.py``):

- *few runs*: with 3 or 5 seeds the run-level variance has 2 or 4 degrees of freedom, and a percentile interval of a
  resampled mean uses the normal's quantiles and a variance shrunk by (R - 1) / R: 0.79-0.87 coverage where
  the seeds vary as much as the prompts. Student's t with the design's Satterthwaite degrees of freedom is the
  textbook cure;
- *skewed, mostly zero per-prompt differences* (a rule that changes the pick on a few prompts): a symmetric interval,
  t included, misses on the long side (0.72-0.82 with 16-32 prompts). The studentised bootstrap (bootstrap-t:
  quantiles of (mean* - mean) / se* over resamples, se* the design's standard error recomputed on each resample)
  follows the skew, second-order correct, where BCa only partly does.

Each cure fails where the other holds (the bootstrap-t's run resamples are too few to learn a tail from 3 seeds;
t ignores skew), so the interval takes the bootstrap-t's critical values but never narrower than Student's t at
the Satterthwaite degrees of freedom (equivalently: the union of the two intervals), nor than the runs' part of the
variance alone with its own R - 1 degrees of freedom (pooled, the Satterthwaite degrees of freedom are largest
exactly when the seeds' spread came out small by chance: 0.924 coverage at 3 seeds without it). Where the prompts
that differ are so few that resamples with none of them are more than the tail's share, the bootstrap-t's end is
infinite: the data cannot bound the mean on that side, and the interval says so (an ``unbounded`` note) instead of
inventing an end.

**Where no interval promises its level.** The coverage was measured (at least 0.93 for a 95 % interval) with 16 and
32 prompts, one run or 3 and 5 crossed runs. Outside that, every interval carries a ``note`` naming why it cannot
promise its level (fewer than :data:`MIN_PROMPTS` prompts, 2 runs in a cell, an unbounded end); tables list those in
a column and the docs draw no conclusion from them.

- :func:`paired_interval` / :func:`mean_interval`: the mean of a paired difference per run and prompt;
- :func:`cell_difference_interval`: two cells of one world (different runs, shared prompts);
- :func:`largest_drop` / :func:`largest_drop_interval`: the largest fall of a curve from any earlier n to any later
  one, with a simultaneous studentised band over every pair of points;
- :func:`gao_fit` / :func:`gao_fit_interval`: Gao et al.'s forms, best-of-n gold(d) - gold(0) = d (alpha - beta d)
  and RL d (alpha - beta log d);
- :func:`over_worlds_interval`, :func:`largest_drop_over_worlds`: the effect over worlds (a t-interval over the
  worlds' own estimates);
- :func:`paired_t_interval`: active learning's comparison with random, paired by repeat.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from scipy.stats import t as t_dist

from rewarduq_exp.core.bootstrap import LEVEL, bootstrap_weights, percentile_interval

DRAWS = 2000
# The sizes at which the coverage was measured (downstream/interval_coverage.py): below them no level is promised.
MIN_PROMPTS = 16
MIN_RUNS = 3        # a cell of one run is conditional on that run; 2 runs give the run variance 1 degree of freedom
MIN_WORLDS = 3      # the over-world t-interval; below it a note says it cannot promise its level


class Interval(NamedTuple):
    """An estimate and its interval; ``note`` is empty where the interval promises its level, else why it cannot."""
    estimate: float
    lo: float
    hi: float
    note: str = ""


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


# ---------------------------------------------------------------------------------------------- the design's variance
class _Moments(NamedTuple):
    mean: np.ndarray          # (B, J) the contrast of the cells' means
    var: np.ndarray           # (B, J) its estimated variance (components truncated at 0)
    df: np.ndarray            # (B, J) Satterthwaite degrees of freedom
    run_var: np.ndarray       # (B, J) the runs' part of var alone
    run_df: np.ndarray        # (B, J) its own Satterthwaite degrees of freedom (sum_c R_c - 1 at most)


def _contrast_moments(cells: list[np.ndarray], coefficients, w_runs: list[np.ndarray],
                      w_prompts: np.ndarray) -> _Moments:
    """The contrast sum_c coefficient_c * mean(cell_c) of cells (R_c, P, J) on shared prompts, and its variance by the
    crossed random-effects decomposition, for every resample at once: ``w_runs[c]`` (B, R_c) and ``w_prompts``
    (B, P) are resampling counts (ones: the data itself). A resample is an R x P table of its own (rows and columns
    repeated by their counts), so the classical two-way mean squares apply to it as they are.

    Per cell with R > 1 runs: s2_rows (variance of the runs' means over the prompts) estimates s_run^2 + s_noise^2 / P
    and MS_E (the interaction mean square) s_noise^2; the prompts' contrast d_p = sum_c coefficient_c * (mean of
    prompt p over cell c's runs) has variance s_d^2 + sum_c coefficient_c^2 s_noise,c^2 / R_c. So

        Var = sum_c coef_c^2 max(s2_rows_c - MS_E,c / P, 0) / R_c + max(s2_d, sum_c coef_c^2 MS_E,c / R_c) / P,

    which for one cell is (MS_runs + MS_prompts - MS_E) / (R P) when nothing is truncated. A cell of one run has no
    run term: its run is held fixed (the interval is about that run)."""
    n_prompts = w_prompts.shape[1]
    mean = 0.0
    contrast_by_prompt = 0.0
    run_part, noise_part = 0.0, 0.0
    terms, run_terms = [], []   # (coefficient * mean square, its degrees of freedom), for Satterthwaite
    draws, points = w_prompts.shape[0], cells[0].shape[2]

    def over_prompts(a):   # (B, P, J) summed over prompts with the resample's counts
        return np.einsum("bp,bpj->bj", w_prompts, a)

    for cell, coef, w_r in zip(cells, coefficients, w_runs):
        runs = cell.shape[0]
        # matrix products rather than three-operand einsums: 10x faster at the coverage grid's sizes
        by_prompt = (w_r @ cell.reshape(runs, -1)).reshape(-1, n_prompts, points) / runs     # (B, P, J)
        by_prompt = np.broadcast_to(by_prompt, (draws, n_prompts, points))
        cell_mean = over_prompts(by_prompt) / n_prompts
        mean = mean + coef * cell_mean
        contrast_by_prompt = contrast_by_prompt + coef * by_prompt
        if runs == 1:
            continue
        by_run = (w_prompts @ cell.transpose(1, 0, 2).reshape(n_prompts, -1)).reshape(draws, runs, points) / n_prompts
        run_sq = np.einsum("br,brj->bj", np.broadcast_to(w_r, (draws, runs)), by_run ** 2)
        s2_rows = np.maximum(run_sq - runs * cell_mean ** 2, 0.0) / (runs - 1)
        total_sq = over_prompts(np.broadcast_to((w_r @ (cell ** 2).reshape(runs, -1)).reshape(-1, n_prompts, points),
                                                (draws, n_prompts, points)))
        prompt_sq = over_prompts(by_prompt ** 2)
        ss_noise = total_sq - n_prompts * run_sq - runs * prompt_sq + runs * n_prompts * cell_mean ** 2
        ms_noise = np.maximum(ss_noise, 0.0) / ((runs - 1) * (n_prompts - 1))
        run_term = coef ** 2 * np.maximum(s2_rows - ms_noise / n_prompts, 0.0) / runs
        run_part = run_part + run_term
        run_terms.append((run_term, runs - 1))
        noise_part = noise_part + coef ** 2 * ms_noise / runs
        terms += [(coef ** 2 * s2_rows / runs, runs - 1),
                  (-coef ** 2 * ms_noise / (runs * n_prompts), (runs - 1) * (n_prompts - 1))]
    s2_d = np.maximum(over_prompts(contrast_by_prompt ** 2) - n_prompts * mean ** 2, 0.0) / (n_prompts - 1)
    var = run_part + np.maximum(s2_d, noise_part) / n_prompts
    terms.append((s2_d / n_prompts, n_prompts - 1))
    with np.errstate(divide="ignore", invalid="ignore"):
        df = var ** 2 / sum(term ** 2 / dof for term, dof in terms)
        run_df = (run_part ** 2 / sum(term ** 2 / dof for term, dof in run_terms) if run_terms
                  else np.ones_like(var))   # no cell of several runs: no runs' part, its df unused
    df = np.where(np.isfinite(df) & (df > 0), df, float(n_prompts - 1))
    run_df = np.where(np.isfinite(run_df) & (run_df > 0), run_df, 1.0)
    run_var = np.broadcast_to(run_part, var.shape)   # a plain 0 where every cell is one run
    return _Moments(mean, var, np.clip(df, 1.0, None), run_var, np.clip(run_df, 1.0, None))


def _studentised(cells: list[np.ndarray], coefficients, draws: int, seed: int, level: float):
    """Point estimate (J,), its standard error (J,), degrees of freedom (J,) and the bootstrap's studentised draws
    (B, J) (+-inf where a resample has no spread but moved; 0 where it has none and did not)."""
    rng = np.random.default_rng(seed)
    n_prompts = cells[0].shape[1]
    # centred per cell and point: the mean squares subtract sums of squares, which a large level would swamp
    shift = sum(coef * c.mean((0, 1)) for c, coef in zip(cells, coefficients))
    cells = [c - c.mean((0, 1)) for c in cells]
    # A resample without spread has variance 0, which the sums of squares leave as rounding of order 1e-16 of the
    # values' square: a standard error below this is no spread (a move by it is unbounded, not a huge t).
    tol = 1e-6 * max(max(float(np.abs(c).max(initial=0.0)) for c in cells), 1e-300)
    point = _contrast_moments(cells, coefficients, [np.ones((1, c.shape[0])) for c in cells],
                              np.ones((1, n_prompts)))
    w_runs = [bootstrap_weights(c.shape[0], draws, rng) if c.shape[0] > 1 else np.ones((draws, 1)) for c in cells]
    w_prompts = bootstrap_weights(n_prompts, draws, rng)
    boot = _contrast_moments(cells, coefficients, w_runs, w_prompts)
    mean, se, df = point.mean[0], np.sqrt(point.var[0]), point.df[0]
    # The runs' part alone with its own few degrees of freedom: with 3 seeds it has 2, which the pooled Satterthwaite
    # degrees of freedom overstate exactly when the seeds' spread came out small (coverage 0.924 at 3 runs without it)
    run_half = t_dist.ppf(0.5 + level / 2, point.run_df[0]) * np.sqrt(point.run_var[0])
    # exact ties (a resample equal to the data) count as no move, not as rounding divided by a tiny se
    moved = boot.mean - mean
    moved = np.where(np.abs(moved) <= 1e-9 * tol, 0.0, moved)
    boot_se = np.sqrt(boot.var)
    with np.errstate(divide="ignore", invalid="ignore"):
        t_star = np.where(boot_se > tol, moved / np.where(boot_se > tol, boot_se, 1.0),
                          np.where(moved == 0, 0.0, np.sign(moved) * np.inf))
    return mean + shift, np.where(se > tol, se, 0.0), df, t_star, run_half


def _design_note(cells: list[np.ndarray]) -> str:
    prompts = cells[0].shape[1]
    notes = []
    if prompts < MIN_PROMPTS:
        notes.append(f"{prompts} prompts (fewer than {MIN_PROMPTS})")
    if any(c.shape[0] == 2 for c in cells):
        notes.append(f"2 runs in a cell (1 or at least {MIN_RUNS})")
    return "; ".join(notes)


def _check_cells(cells) -> list[np.ndarray]:
    out = [_as_runs_prompts(c) for c in cells]
    if len({c.shape[1:] for c in out}) != 1:
        raise ValueError(f"cells must share their prompts and points; got {[c.shape for c in out]}")
    return out


ONE_PROMPT = "1 prompt: no interval"


def contrast_intervals(cells, coefficients, draws: int = DRAWS, seed: int = 0,
                       level: float = LEVEL) -> list[Interval]:
    """The contrast sum_c coefficient_c * mean(cell_c) of cells ((P,), (P, J) or (R_c, P, J): runs and prompts
    crossed within a cell, the prompts shared by every cell) and its ``level`` interval, one per point J: the
    studentised bootstrap (prompts resampled once for every cell, each cell's runs on their own), its critical values
    never narrower than Student's t at the design's Satterthwaite degrees of freedom (the module's docstring)."""
    cells = _check_cells(cells)
    if cells[0].shape[1] < 2:   # nothing to resample: the estimate alone (e.g. 3 prompts cut into 2 and 1)
        estimate = sum(coef * c.mean((0, 1)) for c, coef in zip(cells, coefficients))
        return [Interval(float(e), np.nan, np.nan, ONE_PROMPT) for e in np.atleast_1d(estimate)]
    mean, se, df, t_star, run_half = _studentised(cells, coefficients, draws, seed, level)
    tail = (1 - level) / 2
    q_lo, q_hi = percentile_interval(t_star, level)
    with np.errstate(divide="ignore", invalid="ignore"):
        t_crit = np.maximum(t_dist.ppf(1 - tail, df), np.where(se > 0, run_half / se, 0.0))
    upper_crit, lower_crit = np.maximum(q_hi, t_crit), np.minimum(q_lo, -t_crit)
    design = _design_note(cells)
    out = []
    for j in range(mean.size):
        if se[j] == 0 and not np.any(t_star[:, j]):   # every run and prompt alike: the difference is exact
            out.append(Interval(float(mean[j]), float(mean[j]), float(mean[j]), design))
            continue
        lo = mean[j] - upper_crit[j] * se[j] if np.isfinite(upper_crit[j]) else -np.inf
        hi = mean[j] - lower_crit[j] * se[j] if np.isfinite(lower_crit[j]) else np.inf
        note = design
        if not (np.isfinite(lo) and np.isfinite(hi)):
            note = "; ".join(filter(None, [note, "unbounded: too few prompts or runs differ to bound it"]))
        out.append(Interval(float(mean[j]), float(lo), float(hi), note))
    return out


def paired_interval(values, draws: int = DRAWS, seed: int = 0, level: float = LEVEL) -> Interval:
    """The mean of ``values`` ((P,), or (R, P): one paired difference per run and prompt) and its interval."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim not in (1, 2):
        raise ValueError(f"paired_interval takes (prompts,) or (runs, prompts) values; got {v.shape}")
    return contrast_intervals([(v[None] if v.ndim == 1 else v)[:, :, None]], [1.0], draws, seed, level)[0]


def mean_interval(values, draws: int = DRAWS, seed: int = 0, level: float = LEVEL) -> tuple[float, float, float]:
    """:func:`paired_interval` as (estimate, lo, hi), for callers that keep no note."""
    return paired_interval(values, draws, seed, level)[:3]


def cell_difference_interval(a, b, draws: int = DRAWS, seed: int = 0, level: float = LEVEL) -> Interval:
    """mean(a) - mean(b) for two cells of one world, ``a`` (Ra, P) and ``b`` (Rb, P): different runs on the same
    prompts. Each draw resamples the prompts once for both cells (they are shared) and the runs of each cell on
    their own (they are not)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"cells must be (runs, prompts) on the same prompts; got {a.shape} and {b.shape}")
    return contrast_intervals([a[:, :, None], b[:, :, None]], [1.0, -1.0], draws, seed, level)[0]


# ---------------------------------------------------------------------------------------------- curves
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
    simultaneous band d_ij +- c_ij se_ij: se_ij its design standard error, c the ``level`` quantile over resamples of
    max_ij |d*_ij - d_ij| / se*_ij (a studentised max-t band, se* recomputed on each resample), never below each
    pair's own Student-t value. With probability ``level`` every true d_ij lies in its band at once, so the true
    largest drop max(0, max d_ij) lies in [max(0, max lower), max(0, max upper)]. ``lo > 0`` is the test "the curve
    falls somewhere", at the stated level.

    Returns ``drop``, ``lo``, ``hi``, ``from_index``, ``to_index`` (the pair of the point estimate), ``c`` and
    ``note`` (empty where the band promises its level)."""
    v = _as_runs_prompts(values)
    curve = v.mean((0, 1))
    drop, i, j = largest_drop(curve)
    note = _design_note([v])
    if curve.size < 2:
        return {"drop": 0.0, "lo": 0.0, "hi": 0.0, "from_index": 0, "to_index": 0, "c": np.nan, "note": note}
    if v.shape[1] < 2:
        return {"drop": drop, "lo": np.nan, "hi": np.nan, "from_index": i, "to_index": j, "c": np.nan,
                "note": ONE_PROMPT}
    upper_i, upper_j = np.triu_indices(curve.size, k=1)
    pairs = v[..., upper_i] - v[..., upper_j]                     # (R, P, pairs)
    diff, se, df, t_star, run_half = _studentised([pairs], [1.0], draws, seed, level)
    varies = se > 0
    if not varies.any():  # every prompt alike: the differences are exact
        top = float(max(0.0, diff.max()))
        return {"drop": drop, "lo": top, "hi": top, "from_index": i, "to_index": j, "c": 0.0, "note": note}
    c = float(np.quantile(np.abs(t_star[:, varies]).max(1), level, method="inverted_cdf"))
    with np.errstate(divide="ignore", invalid="ignore"):
        crit = np.maximum(c, np.maximum(t_dist.ppf(0.5 + level / 2, df), np.where(se > 0, run_half / se, 0.0)))
    if not np.isfinite(c):
        note = "; ".join(filter(None, [note, "unbounded: too few prompts or runs differ to bound it"]))
        return {"drop": drop, "lo": 0.0, "hi": np.inf, "from_index": i, "to_index": j, "c": c, "note": note}
    half = np.where(varies, crit * se, 0.0)
    return {"drop": drop, "lo": float(max(0.0, (diff - half).max())), "hi": float(max(0.0, (diff + half).max())),
            "from_index": i, "to_index": j, "c": c, "note": note}


GAO_FORMS = ("best_of_n", "rl")


def _gao_design(d: np.ndarray, form: str) -> np.ndarray:
    """The two columns of gain = alpha d - beta g(d): g(d) = d^2 (best-of-n) or d log d (RL; 0 at d = 0)."""
    if form not in GAO_FORMS:
        raise ValueError(f"Gao's form {form!r} is not one of {GAO_FORMS}")
    if form == "best_of_n":
        return np.stack([d, -d ** 2], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        d_log_d = np.where(d > 0, d * np.log(np.where(d > 0, d, 1.0)), 0.0)
    return np.stack([d, -d_log_d], axis=1)


def gao_fit(d, gain, form: str = "best_of_n") -> tuple[float, float]:
    """Least-squares alpha, beta of Gao et al.'s (2023) forms, gain = gold(d) - gold(0), d = sqrt(KL): best-of-n
    gain = d (alpha - beta d); RL gain = d (alpha - beta log d). ``gain`` (J,) or (..., J) fits every leading row at
    once."""
    d = np.asarray(d, dtype=np.float64)
    design = _gao_design(d, form)                                 # (J, 2)
    y = np.asarray(gain, dtype=np.float64)
    coef, *_ = np.linalg.lstsq(design, y.reshape(-1, d.size).T, rcond=None)  # (2, rows)
    alpha, beta = coef
    return (float(alpha[0]), float(beta[0])) if y.ndim == 1 else (alpha.reshape(y.shape[:-1]),
                                                                   beta.reshape(y.shape[:-1]))


def gao_peak(alpha, beta, form: str = "best_of_n") -> tuple[np.ndarray, np.ndarray]:
    """The fitted curve's peak (d*, gain there), d = inf where beta <= 0 (it never turns down).

    Best-of-n: d* = alpha / (2 beta), gain alpha^2 / (4 beta) where alpha > 0 (alpha <= 0: d = 0, gain 0). RL: the
    derivative alpha - beta (log d + 1) vanishes at d* = exp(alpha / beta - 1), where the gain is beta d* (> 0 for any
    alpha: -beta d log d rises first)."""
    alpha, beta = np.asarray(alpha, dtype=np.float64), np.asarray(beta, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if form == "rl":
            d_peak = np.where(beta > 0, np.exp(np.minimum(alpha / np.where(beta > 0, beta, 1.0) - 1, 700)), np.inf)
            return d_peak, np.where(beta > 0, beta * d_peak, np.inf)
        d_peak = np.where(beta > 0, np.maximum(alpha, 0) / (2 * beta), np.inf)
        gain = np.where(beta > 0, np.maximum(alpha, 0) ** 2 / (4 * beta), np.inf)
    return d_peak, gain


def gao_fit_interval(d, values, draws: int = DRAWS, seed: int = 0, level: float = LEVEL,
                     form: str = "best_of_n") -> dict:
    """:func:`gao_fit` on the mean curve of ``values`` ((P, J) or (R, P, J), gold per prompt and n; the gain is taken
    from the first point, d[0] = 0), with intervals for alpha, beta, the peak's d and its gain (an interval end of
    inf: some resamples never turn down), and the fit's R^2.

    alpha and beta are linear in the curve (least squares), so they are the means of every run's and prompt's own
    fit: their intervals are :func:`contrast_intervals`' of those. The peak is not linear (a ratio): its interval is
    the percentile interval of the crossed bootstrap's refits, which promises no level (``peak_note`` says so)."""
    v = _as_runs_prompts(values)
    curve = v.mean((0, 1))
    alpha, beta = gao_fit(d, curve - curve[0], form)
    d_peak, gain = gao_peak(alpha, beta, form)
    per_unit = np.stack(gao_fit(d, v - v[..., :1], form), axis=-1)      # (R, P, 2): each run's and prompt's alpha, beta
    fitted_alpha, fitted_beta = contrast_intervals([per_unit], [1.0], draws, seed, level)
    boot = bootstrap_means(v, draws, seed)
    b_peak, b_gain = gao_peak(*gao_fit(d, boot - boot[:, :1], form), form)
    fitted = _gao_design(np.asarray(d, dtype=np.float64), form) @ np.array([alpha, beta])
    resid = (curve - curve[0]) - fitted
    total = ((curve - curve[0]) - (curve - curve[0]).mean()) ** 2
    out = {"alpha": alpha, "beta": beta, "d_peak": float(d_peak), "gain_peak": float(gain),
           "r2": float(1 - (resid ** 2).sum() / total.sum()) if total.sum() > 0 else np.nan,
           "alpha_lo": fitted_alpha.lo, "alpha_hi": fitted_alpha.hi, "beta_lo": fitted_beta.lo,
           "beta_hi": fitted_beta.hi, "note": fitted_beta.note or fitted_alpha.note,
           "peak_note": "percentile interval of a ratio: no level promised"}
    for name, boot_values in (("d_peak", b_peak), ("gain_peak", b_gain)):
        lo, hi = percentile_interval(boot_values, level)
        out[f"{name}_lo"], out[f"{name}_hi"] = float(lo), float(hi)
    return out


# ---------------------------------------------------------------------------------------------- over worlds
def over_worlds_interval(estimates, level: float = LEVEL) -> Interval:
    """The effect over worlds: the mean of the worlds' own estimates (one per world, each from its cell) and the
    t-interval mean +- t_{W-1} sd / sqrt(W) over them.

    A world is drawn from the world generator as a whole (utilities, pairs, candidates), so the worlds' estimates are
    independent draws of (world effect + that world's sampling error over runs and prompts). Their spread carries both
    at once: the t-interval over them is the hierarchical interval (worlds, then runs within a world, then prompts)
    without estimating the inner levels, exact for normal world effects whatever the design inside a world. Fewer
    than :data:`MIN_WORLDS` worlds (or NaN estimates left out below it) get a note; one world has no interval."""
    x = np.asarray(estimates, dtype=np.float64)
    x = x[np.isfinite(x)]
    worlds = x.size
    if worlds == 0:
        return Interval(np.nan, np.nan, np.nan, "no world")
    mean = float(x.mean())
    if worlds == 1:
        return Interval(mean, np.nan, np.nan, "1 world: no interval over worlds")
    half = float(t_dist.ppf(0.5 + level / 2, worlds - 1) * x.std(ddof=1) / np.sqrt(worlds))
    note = f"{worlds} worlds (fewer than {MIN_WORLDS})" if worlds < MIN_WORLDS else ""
    return Interval(mean, mean - half, mean + half, note)


def largest_drop_over_worlds(curves, level: float = LEVEL) -> dict:
    """The largest drop of the mean over worlds of the worlds' curves ``curves`` (W, J), with a simultaneous band over
    every pair of points from the worlds' own differences: d_ij +- c se_ij, se_ij = sd_w(d_ij,w) / sqrt(W), and
    c = Student's t_{W-1} at the Bonferroni level over the pairs (a handful of worlds cannot estimate the pairs'
    joint tail; Bonferroni needs none). ``lo > 0``: the curve falls over worlds, at the stated level."""
    g = np.asarray(curves, dtype=np.float64)
    worlds, points = g.shape
    drop, i, j = largest_drop(g.mean(0))
    out = {"drop": drop, "from_index": i, "to_index": j, "worlds": worlds}
    if worlds < 2 or points < 2:
        return {**out, "lo": np.nan, "hi": np.nan, "note": "1 world: no interval over worlds"}
    upper_i, upper_j = np.triu_indices(points, k=1)
    d = g[:, upper_i] - g[:, upper_j]
    c = float(t_dist.ppf(1 - (1 - level) / (2 * d.shape[1]), worlds - 1))
    half = c * d.std(0, ddof=1) / np.sqrt(worlds)
    mean = d.mean(0)
    note = f"{worlds} worlds (fewer than {MIN_WORLDS})" if worlds < MIN_WORLDS else ""
    return {**out, "lo": float(max(0.0, (mean - half).max())), "hi": float(max(0.0, (mean + half).max())),
            "note": note}


# ---------------------------------------------------------------------------------------------- repeats
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
