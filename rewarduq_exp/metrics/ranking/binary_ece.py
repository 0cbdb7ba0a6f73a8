"""Binned ECE of many binary problems at once (one per event) and the ways to combine the per-event ECEs.

The rank-wise metrics (:mod:`~rewarduq_exp.metrics.ranking.rankwise`) make one binary problem per event; the K-wise
top-1 calibration of :mod:`rewarduq_exp.metrics.kwise` uses the same bins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rewarduq_exp.core.checks import check_choice, check_n_bins
from rewarduq_exp.core.errors import UserError

DISCREPANCIES = ("abs", "jeff", "kl", "log_ratio", "rel_p", "rel_q")
SPACINGS = ("linear", "log")
AGGREGATES = ("uniform", "prevalence", "pred_mass", "most_confident")
# ``aggregate="most_confident"``: the mean ECE of this many events with the largest predicted mass (always / 5).
MOST_CONFIDENT_EVENTS = 5
# eps of the binary discrepancies (and the first log-spaced edge), as in the reference estimators.
DISCREPANCY_EPS = 1e-12
# Marginals up to 1 + this are accepted (sums of probabilities round); anything further outside [0, 1] is an error.
_PROB_TOL = 1e-6


def bin_edges(n_bins: int = 10, spacing: str = "linear") -> np.ndarray:
    """The n_bins + 1 bin edges on [0, 1].

    ``linear``: equal width, edges b / n_bins (so a probability of exactly 0.7 is in [0.7, 0.8) with 10 bins).
    ``log``: n_bins + 1 log-spaced points from 1e-12 to 1 with the first edge set to 0 (the reference's "log"
    option; with 10 bins every probability above 10^-1.2 = 0.063 shares the last bin).
    """
    n_bins = check_n_bins(n_bins)
    check_choice("spacing", spacing, SPACINGS)
    if spacing == "linear":
        return np.arange(n_bins + 1) / n_bins  # each edge b / n_bins correctly rounded (linspace can be 1 ulp off)
    edges = np.logspace(np.log10(DISCREPANCY_EPS), 0.0, n_bins + 1)
    edges[0], edges[-1] = 0.0, 1.0
    return edges


# Probabilities are put in bins after rounding to this many decimals: a marginal summed in float64 that should land
# exactly on an edge (0.7 + 0.2 = 0.8999999999999999 for 0.9) then goes to the bin the exact value belongs to.
BIN_DECIMALS = 12


def bin_index(q: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The bin of each probability: edges left-closed, 1.0 in the last bin (0..len(edges) - 2), after rounding to
    ``BIN_DECIMALS`` decimals (only for the assignment: bin means use the probabilities as they are)."""
    return np.digitize(np.round(q, BIN_DECIMALS), edges[1:-1])


def _bernoulli_kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return p * np.log(p / q) + (1.0 - p) * np.log((1.0 - p) / (1.0 - q))


@dataclass(frozen=True, eq=False)
class BinaryECE:
    """Per-event results of :func:`binary_ece`: ECE, prevalence (mean label) and predicted mass (mean probability);
    ``also``: the per-event ECE under each further discrepancy asked for (from the same bins)."""

    ece: np.ndarray
    prevalence: np.ndarray
    pred_mass: np.ndarray
    also: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class BinSums:
    """One binning pass of E binary problems: per (event, bin) the count, the label sum and the probability sum
    (E, n_bins), and the number of samples n. Every discrepancy is a function of these alone."""

    count: np.ndarray
    sum_y: np.ndarray
    sum_q: np.ndarray
    n: int


def bin_sums(labels, probs, *, n_bins: int = 10, spacing: str = "linear") -> BinSums:
    """The per-bin sums of E binary problems (labels and probabilities (n, E), or (n,) for one problem): one
    bincount over the flattened (event, bin) index per sum, no loop over events."""
    n_bins = check_n_bins(n_bins)
    y = np.asarray(labels, dtype=np.float64)
    q = np.asarray(probs, dtype=np.float64)
    if y.ndim == 1:
        y = y[:, None]
    if q.ndim == 1:
        q = q[:, None]
    if y.shape != q.shape or y.ndim != 2 or y.shape[0] == 0:
        raise UserError(f"labels and probabilities must have the same (n, E) shape with n >= 1, got "
                        f"{np.shape(labels)} and {np.shape(probs)}")
    if not np.isfinite(q).all() or q.min(initial=0.0) < -_PROB_TOL or q.max(initial=0.0) > 1.0 + _PROB_TOL:
        raise UserError("predicted probabilities must be finite and in [0, 1]")
    n, n_events = y.shape
    edges = bin_edges(n_bins, spacing)
    b = bin_index(q, edges)
    flat = (b + n_bins * np.arange(n_events)[None, :]).ravel()
    size = n_events * n_bins
    count = np.bincount(flat, minlength=size).reshape(n_events, n_bins).astype(np.float64)
    sum_y = np.bincount(flat, weights=y.ravel(), minlength=size).reshape(n_events, n_bins)
    sum_q = np.bincount(flat, weights=q.ravel(), minlength=size).reshape(n_events, n_bins)
    return BinSums(count=count, sum_y=sum_y, sum_q=sum_q, n=n)


def binned_discrepancy(sums: BinSums, discrepancy: str = "abs") -> np.ndarray:
    """sum_b (n_b / n) d(p_b, q_b) per event (E,) from one binning pass (see :func:`binary_ece` for each d)."""
    check_choice("discrepancy", discrepancy, DISCREPANCIES)
    count, sum_y = sums.count, sums.sum_y
    occ = count > 0
    safe = np.where(occ, count, 1.0)
    freq, conf = sum_y / safe, sums.sum_q / safe
    eps = DISCREPANCY_EPS
    if discrepancy == "abs":
        d = np.abs(freq - conf)
    elif discrepancy == "kl":
        d = _bernoulli_kl(np.clip(freq, eps, 1 - eps), np.clip(conf, eps, 1 - eps))
    elif discrepancy == "jeff":
        p_s = (sum_y + 0.5) / (count + 1.0)
        c = np.clip(conf, eps, 1 - eps)
        d = -np.expm1(-(_bernoulli_kl(p_s, c) + _bernoulli_kl(c, p_s)))
    elif discrepancy == "log_ratio":
        d = np.abs(np.log((freq + eps) / (np.maximum(conf, 0.0) + eps)))
    elif discrepancy == "rel_p":
        d = np.abs(freq - conf) / (freq + eps)
    else:  # rel_q
        d = np.abs(freq - conf) / (np.maximum(conf, 0.0) + eps)
    return np.where(occ, count / sums.n * d, 0.0).sum(axis=1)


def binary_ece(labels, probs, *, n_bins: int = 10, discrepancy: str = "abs", spacing: str = "linear",
               also=()) -> BinaryECE:
    """Binned ECE of E binary problems at once: labels and probabilities (n, E) (or (n,) for one problem).

    Bins: ``n_bins`` edges from :func:`bin_edges`, left-closed and right-open, probability 1.0 in the last bin (a
    probability's bin is the number of edges <= it, minus one, clamped to the bins). Per non-empty bin b with n_b
    samples, frequency p_b = mean label and confidence q_b = mean probability; empty bins are skipped and

        ECE = sum_b (n_b / n) * d(p_b, q_b)

    with the discrepancy d (eps = 1e-12):

    * ``abs``: |p_b - q_b| (the usual ECE; the exact frequency, so a perfectly calibrated bin gives exactly 0 — the
      reference's test-only ``calculate_binary_ece`` divides by n_b + 1e-6 instead);
    * ``jeff`` (appendix E's Jeffreys divergence, in the reference's form): the Jeffreys-smoothed frequency
      p~ = (sum of labels + 1/2) / (n_b + 1), q = q_b clamped to [eps, 1 - eps], J = KL(p~||q) + KL(q||p~) for
      Bernoulli distributions, d = 1 - exp(-J) in [0, 1). The smoothing makes d > 0 even under perfect calibration;
    * ``kl``: Bernoulli KL(p_b || q_b) with both clamped to [eps, 1 - eps] (unbounded when q_b is near 0 or 1);
      appendix E's KL divergence;
    * ``log_ratio``: |ln((p_b + eps) / (q_b + eps))|;
    * ``rel_p``: |p_b - q_b| / (p_b + eps), the error relative to the observed frequency;
    * ``rel_q``: |p_b - q_b| / (q_b + eps), the error relative to the predicted probability.

    ``log_ratio``, ``rel_p`` and ``rel_q`` are the reference code's further options (the paper defines none of
    them). **rel_q, log_ratio and kl explode when a bin's confidence q_b is near 0** while its frequency is not:
    rel_q reaches p_b * 1e12 for q_b = 0 (values around 1e11 on the reference's own synthetic cases), log_ratio
    about 27.6 and kl about 27.6 * p_b; rel_p does the same when p_b is near 0 and q_b is not (a bin whose events
    never happen). Such a single bin dominates the mean over events, so these totals are mostly a count of
    near-zero bins; use them to compare with the reference's tables, not as calibration scores. (Negative
    probabilities within the rounding tolerance count as 0 here.)

    ``also``: further discrepancies, each computed from the same bins (one :func:`bin_sums` pass for all of them)
    into ``BinaryECE.also[<name>]``.

    Vectorised: one bincount over the flattened (event, bin) index, no loop over events.
    """
    n_bins = check_n_bins(n_bins)
    check_choice("discrepancy", discrepancy, DISCREPANCIES)
    for name in also:
        check_choice("discrepancy", name, DISCREPANCIES)
    sums = bin_sums(labels, probs, n_bins=n_bins, spacing=spacing)
    y = np.asarray(labels, dtype=np.float64)
    q = np.asarray(probs, dtype=np.float64)
    ece = binned_discrepancy(sums, discrepancy)
    others = {name: (ece if name == discrepancy else binned_discrepancy(sums, name)) for name in also}
    return BinaryECE(ece=ece, prevalence=y.reshape(len(y), -1).mean(axis=0),
                     pred_mass=q.reshape(len(q), -1).mean(axis=0), also=others)


def aggregate_ece(ece, prevalence=None, pred_mass=None, aggregate: str = "uniform") -> float:
    """Combine per-event ECEs: ``uniform`` plain mean (default), ``prevalence`` sum(ECE * prev) / sum(prev),
    ``pred_mass`` sum(ECE * mass) / sum(mass), ``most_confident`` the ECEs of the 5 events with the largest
    predicted mass, summed and divided by 5. NaN when there is no event or the weights sum to 0.

    ``most_confident`` computes what the reference code does: events are ordered by their normalised predicted
    mass mass / sum(mass), descending (the same order as the mass itself), and the sum is **always divided by 5**,
    even when there are fewer than 5 events (top-1 with m = 3 averages 3 ECEs over 5). Tied masses keep the order
    in which the events are given; the metrics give them in lexicographic order, which is the reference's order for
    m < 8 but not from m = 8 on, where the reference iterates a Python set of the observed events: with ties across
    the 5th place the two can differ (0.2000 here, 0.2308 there in the example of "Order of events and classes" in
    :mod:`~rewarduq_exp.metrics.ranking.events`). The paper defines none of these weightings; Definitions 6 and 7
    ask for calibration of every event.
    """
    check_choice("aggregate", aggregate, AGGREGATES)
    ece = np.asarray(ece, dtype=np.float64)
    if ece.size == 0:
        return float("nan")
    if aggregate == "uniform":
        return float(ece.mean())
    if aggregate == "most_confident":
        mass = np.asarray(pred_mass, dtype=np.float64)
        total = mass.sum()
        key = mass / total if total > 0 else mass  # the reference sorts by the normalised mass
        order = np.argsort(-key, kind="stable")
        return float(ece[order[:MOST_CONFIDENT_EVENTS]].sum() / MOST_CONFIDENT_EVENTS)
    w = np.asarray(prevalence if aggregate == "prevalence" else pred_mass, dtype=np.float64)
    total = w.sum()
    return float(np.dot(ece, w) / total) if total > 0 else float("nan")
