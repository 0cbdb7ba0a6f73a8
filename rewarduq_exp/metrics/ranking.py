"""Calibration and accuracy of probabilistic label ranking ("Calibrated Preference Learning: The Case of Label
Ranking", section 4, appendices D and E), as numpy functions of marginals and true rankings.

Conventions (as in :mod:`rewarduq_exp.ranking.permutations`): ``true_ranks`` is an int array (n, m) of ranks per
item, 1 = best, 0-based item ids; an *event* is an ordered k-tuple of distinct items (E, k). Predicted probabilities
enter through a *marginals* callable ``tuples (E, k) -> (n, E)`` (e.g. ``RankingDistribution.sub_k`` or ``.top_k``),
so the metric functions never see a model; :func:`ranking_evaluation` / :func:`ranking_metrics` (at the end) wire a
:class:`~rewarduq_exp.ranking.distribution.RankingDistribution` to them and return the flat ``rank/...`` dict.

The metrics
-----------
* **Rank-wise sub-k / top-k ECE** (Definitions 6 and 7): one binary calibration problem per event, label 1 where the
  true ranking contains the event (sub-k: a1 > ... > ak with the other items anywhere; top-k: positions 1..k are
  a1..ak), probability = the predicted marginal of the event. Each problem's ECE is the binned estimator of
  :func:`binary_ece`; the total is the plain mean over events (``aggregate="uniform"``, the paper's and the
  reference's default) or a prevalence / predicted-mass weighted mean.
* **Full-rank sub-k / top-k calibration** (Definitions 4 and 5): one multiclass problem per unordered k-subset
  (classes = the k! orderings of the subset; mean over subsets) or a single problem over the top-k prefixes,
  scored with the Dirichlet-kernel estimator of Popordanoska et al. (2022) that appendix E uses
  (:func:`dirichlet_kernel_ece`).
* **Accuracy of the modal ranking**: Kendall tau, Spearman footrule, top-1 accuracy.

Reward models scored on K-wise data (appendix D) are calibrated in :mod:`rewarduq_exp.metrics.kwise`.

Which events are evaluated (appendix E)
---------------------------------------
``events="auto"`` (default) enumerates every event (all P(m,k) ordered k-tuples, all k! classes per subset, all
P(m,k) prefixes) when m < 8, and otherwise restricts to the events *observed in the test labels* (the paper's
restriction to observed rankings; P(8,k) already reaches 40320 at k = 7 and m! grows beyond reach). The rule is
"m >= 8" for every dataset: the reference code restricts by a hard-coded dataset list whose entry "pendigit" never
matches "pendigits", so there pendigits (m = 10) would enumerate 10! rankings; here pendigits (m = 10), yeast
(10), vowel (11), movies and libras (15) and letter (26) are all restricted. ``events="all"`` / ``"observed"``
force either behaviour.

Two deliberate differences from the reference code (whose metric definitions are otherwise reproduced exactly):

* marginals come from the distribution itself (closed forms or full enumeration), so they are properly normalised;
  the reference sums the probabilities of a restricted candidate list of rankings, which loses the mass outside it;
* in restricted full-rank problems the classes are the observed sub-orderings / prefixes **plus one "other" class**
  holding the remaining predicted mass, so every predicted vector stays on the probability simplex (the reference
  drops that mass).

The reference's further options are available for comparison with its tables (issue 26): the discrepancies
``log_ratio`` / ``rel_p`` / ``rel_q`` (:func:`binary_ece`), the ``most_confident`` weighting (:func:`aggregate_ece`;
here for sub-k too, where the reference raises), simplex binning as full-rank estimator (:func:`simplex_binning_ece`,
2 or 3 classes only) and the label-dependent restriction to the most frequent test rankings
(:func:`restrict_to_frequent_rankings`, ``restrict="prob_mass_95"`` / ``"top_10"``), which removes predicted mass
exactly as the reference does (no renormalisation, no "other" class).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy.special import gammaln

from rewarduq_exp.core.checks import check_choice, check_n_bins
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.ranking.distribution import ExplicitDistribution, RankingDistribution
from rewarduq_exp.ranking.permutations import (
    all_orderings,
    check_rankings,
    induced_orderings,
    ordered_tuples,
    orderings_to_ranks,
    ranks_to_orderings,
)

Marginals = Callable[[np.ndarray], np.ndarray]

DISCREPANCIES = ("abs", "jeff", "kl", "log_ratio", "rel_p", "rel_q")
SPACINGS = ("linear", "log")
AGGREGATES = ("uniform", "prevalence", "pred_mass", "most_confident")
EVENT_MODES = ("auto", "all", "observed")
# ``aggregate="most_confident"``: the mean ECE of this many events with the largest predicted mass (always / 5).
MOST_CONFIDENT_EVENTS = 5
# Appendix E's restriction to the most frequent test rankings (label-dependent; see restrict_to_frequent_rankings).
RESTRICTIONS = ("none", "prob_mass_95", "top_10")
PROB_MASS_SHARE = 0.95
TOP_RANKINGS = 10
# Full-rank estimators: the Dirichlet kernel (appendix E) or simplex binning (2 or 3 classes only, step 1/10).
FULL_RANK_ESTIMATORS = ("kernel", "binning")
SIMPLEX_BINS = 10
# From this many items on, events="auto" restricts every metric to the events observed in the test labels.
RESTRICT_FROM_M = 8
# Clamps of the reference estimators: eps of the binary discrepancies (and the first log-spaced edge), the floor of
# f in log f of the Dirichlet kernel, and the constant added to the kernel's denominator.
DISCREPANCY_EPS = 1e-12
KERNEL_LOG_FLOOR = 1e-8
KERNEL_DENOM_EPS = 1e-8
# Marginals up to 1 + this are accepted (sums of probabilities round); anything further outside [0, 1] is an error.
_PROB_TOL = 1e-6
# Work arrays are cut into pieces of about this many float64 elements (32 MiB).
_CHUNK_ELEMENTS = 1 << 22
# At most this many events per call of a marginals function (an explicit distribution builds an R x E x k mask).
_MAX_EVENTS_PER_CALL = 256


# ---------------------------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------------------------






def check_true_ranks(true_ranks) -> np.ndarray:
    """True ranks as int64 (n, m), n >= 1; a one-line UserError unless every row is a permutation of 1..m."""
    r = check_rankings(true_ranks, what="true ranks")
    if len(r) == 0:
        raise UserError("true ranks: no samples")
    return r


def check_k(kind: str, k, m: int, limit: int | None = None) -> int:
    """Validate k for sub-k (2..min(m, limit)) or top-k (1..min(m, limit)) events; one-line UserError otherwise.

    ``limit`` is the distribution's ``max_sub_k`` / ``max_top_k`` (None: no limit beyond m).
    """
    low = 2 if kind == "sub" else 1
    high = m if limit is None else min(m, int(limit))
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not low <= k <= high:
        if high < low:
            raise UserError(f"{kind}-k metrics are not available here (m={m} items, the distribution allows "
                            f"{kind}-k up to {limit}), asked for k={k!r}")
        raise UserError(f"{kind}-k needs k in {low}..{high} (m={m} items"
                        + ("" if limit is None or limit >= m else f", the distribution's max_{kind}_k={limit}")
                        + f"), got k={k!r}")
    return int(k)


def _restricted(m: int, events: str) -> bool:
    check_choice("events", events, EVENT_MODES)
    return events == "observed" or (events == "auto" and m >= RESTRICT_FROM_M)


# ---------------------------------------------------------------------------------------------------------------
# Binary ECE, vectorised over events
# ---------------------------------------------------------------------------------------------------------------


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
    """Per-event results of :func:`binary_ece`: ECE, prevalence (mean label) and predicted mass (mean probability)."""

    ece: np.ndarray
    prevalence: np.ndarray
    pred_mass: np.ndarray


def binary_ece(labels, probs, *, n_bins: int = 10, discrepancy: str = "abs", spacing: str = "linear") -> BinaryECE:
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

    Vectorised: one bincount over the flattened (event, bin) index, no loop over events.
    """
    n_bins = check_n_bins(n_bins)
    check_choice("discrepancy", discrepancy, DISCREPANCIES)
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
    occ = count > 0
    safe = np.where(occ, count, 1.0)
    freq, conf = sum_y / safe, sum_q / safe
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
    ece = np.where(occ, count / n * d, 0.0).sum(axis=1)
    return BinaryECE(ece=ece, prevalence=y.mean(axis=0), pred_mass=q.mean(axis=0))


def aggregate_ece(ece, prevalence=None, pred_mass=None, aggregate: str = "uniform") -> float:
    """Combine per-event ECEs: ``uniform`` plain mean (default), ``prevalence`` sum(ECE * prev) / sum(prev),
    ``pred_mass`` sum(ECE * mass) / sum(mass), ``most_confident`` the ECEs of the 5 events with the largest
    predicted mass, summed and divided by 5. NaN when there is no event or the weights sum to 0.

    ``most_confident`` follows the reference code exactly: events are ordered by their normalised predicted mass
    mass / sum(mass) (the same order as the mass itself; ties keep the event order, itertools / lexicographic), and
    the sum is **always divided by 5**, even when there are fewer than 5 events (top-1 with m = 3 averages 3 ECEs
    over 5). The paper defines none of these weightings; Definitions 6 and 7 ask for calibration of every event.
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


# ---------------------------------------------------------------------------------------------------------------
# Events
# ---------------------------------------------------------------------------------------------------------------


def _lexsorted(rows: np.ndarray) -> np.ndarray:
    if len(rows) == 0:
        return rows
    return rows[np.lexsort(rows.T[::-1])]


def sample_subsets(m: int, k: int, max_subsets: int | None, rng: np.random.Generator) -> np.ndarray:
    """The unordered k-subsets to evaluate, sorted rows (S, k) in lexicographic order.

    All C(m, k) of them when ``max_subsets`` is None or not smaller; otherwise ``max_subsets`` distinct subsets drawn
    uniformly without replacement with ``rng`` (so the result depends on the seed).
    """
    total = math.comb(m, k)
    if max_subsets is not None and (isinstance(max_subsets, bool) or not isinstance(max_subsets, (int, np.integer))
                                    or max_subsets < 1):
        raise UserError(f"max_subsets must be a positive integer or None, got {max_subsets!r}")
    if max_subsets is None or total <= max_subsets:
        return _all_subsets(m, k)
    if total <= 1_000_000:
        chosen = np.sort(rng.choice(total, size=int(max_subsets), replace=False))
        return _all_subsets(m, k)[chosen]
    found: set[tuple[int, ...]] = set()
    while len(found) < max_subsets:  # rejection sampling: collisions are rare when C(m, k) is this large
        found.add(tuple(sorted(rng.choice(m, size=k, replace=False).tolist())))
    return _lexsorted(np.array(sorted(found), dtype=np.int64))


def _all_subsets(m: int, k: int) -> np.ndarray:
    from itertools import combinations

    return np.array(list(combinations(range(m), k)), dtype=np.int64).reshape(-1, k)


def _orderings_of_subsets(subsets: np.ndarray) -> np.ndarray:
    """All k! orderings of each (sorted) subset, grouped by subset, itertools order within: (S * k!, k)."""
    k = subsets.shape[1]
    return subsets[:, all_orderings(k)].reshape(-1, k)


def observed_sub_orderings(true_ranks, subsets) -> np.ndarray:
    """The distinct orderings that the true rankings induce on the given subsets, lexicographically sorted (E, k)."""
    r = check_true_ranks(true_ranks)
    subsets = np.asarray(subsets, dtype=np.int64)
    n, k = len(r), subsets.shape[1]
    step = max(1, _CHUNK_ELEMENTS // max(1, n * k))
    found = []
    for lo in range(0, len(subsets), step):
        s = subsets[lo: lo + step]  # (S, k)
        pos = np.argsort(r[:, s], axis=2, kind="stable")  # (n, S, k)
        rows = np.take_along_axis(np.broadcast_to(s, pos.shape), pos, axis=2).reshape(-1, k)
        found.append(np.unique(rows, axis=0))
    return np.unique(np.concatenate(found), axis=0) if found else np.zeros((0, k), dtype=np.int64)


def observed_prefixes(true_ranks, k: int) -> np.ndarray:
    """The distinct top-k prefixes (best first) of the true rankings, lexicographically sorted (E, k)."""
    return np.unique(ranks_to_orderings(check_true_ranks(true_ranks))[:, :k], axis=0)


def sub_k_events(true_ranks, k: int, *, events: str = "auto", subsets=None) -> np.ndarray:
    """The sub-k events (ordered k-tuples) to evaluate, lexicographically sorted (E, k).

    Unrestricted (m < 8 under ``events="auto"``, or ``"all"``): every ordering of every subset, i.e. all P(m, k)
    ordered tuples when ``subsets`` is None. Restricted: the sub-orderings observed in ``true_ranks`` on those subsets
    (all C(m, k) subsets when None), appendix E's restriction to observed rankings.
    """
    r = check_true_ranks(true_ranks)
    m = r.shape[1]
    k = check_k("sub", k, m)
    if _restricted(m, events):
        return observed_sub_orderings(r, _all_subsets(m, k) if subsets is None else subsets)
    if subsets is None:
        return ordered_tuples(m, k)
    return _lexsorted(_orderings_of_subsets(np.sort(np.asarray(subsets, dtype=np.int64), axis=1)))


# Enumerating more top-k prefixes than this (events=all with many items) is refused with one line, not attempted.
MAX_EXACT_EVENTS = 1_000_000


def all_prefixes(m: int, k: int) -> np.ndarray:
    """All P(m, k) ordered k-tuples, or a one-line UserError when there are too many to enumerate."""
    if math.perm(m, k) > MAX_EXACT_EVENTS:
        raise UserError(f"events=all needs all P({m}, {k}) = {math.perm(m, k):,} top-{k} prefixes of m={m} items, "
                        f"more than {MAX_EXACT_EVENTS:,}; use metric.ranking.events=auto or observed, or a smaller "
                        "metric.ranking.max_k")
    return ordered_tuples(m, k)


def top_k_events(true_ranks, k: int, *, events: str = "auto") -> np.ndarray:
    """The top-k events (prefixes): all P(m, k) when unrestricted, else the prefixes observed in ``true_ranks``."""
    r = check_true_ranks(true_ranks)
    m = r.shape[1]
    k = check_k("top", k, m)
    return observed_prefixes(r, k) if _restricted(m, events) else all_prefixes(m, k)


def event_labels(kind: str, true_ranks, tuples) -> np.ndarray:
    """Binary labels (n, E): the true ranking contains the sub-k event (``kind="sub"``) or has it as top-k prefix."""
    check_choice("kind", kind, ("sub", "top"))
    r = np.asarray(true_ranks)[:, np.asarray(tuples, dtype=np.int64)]  # (n, E, k) ranks of the tuple items
    if kind == "sub":
        return (np.diff(r, axis=-1) > 0).all(axis=-1)
    return (r == np.arange(1, r.shape[-1] + 1)).all(axis=-1)


def _marginals(marginals: Marginals, tuples: np.ndarray, n: int) -> np.ndarray:
    p = np.asarray(marginals(tuples), dtype=np.float64)
    if p.shape != (n, len(tuples)):
        raise ValueError(f"marginals returned shape {p.shape} for {len(tuples)} events and n={n} samples")
    return p


# ---------------------------------------------------------------------------------------------------------------
# Rank-wise sub-k and top-k ECE (Definitions 6 and 7)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class RankwiseECE:
    """A rank-wise sub-k / top-k result: the aggregated ECE and the per-event details (for figures)."""

    ece: float
    events: np.ndarray  # (E, k) ordered tuples, 0-based items
    event_ece: np.ndarray  # (E,)
    prevalence: np.ndarray  # (E,) mean label
    pred_mass: np.ndarray  # (E,) mean predicted probability


def rankwise_ece(kind: str, true_ranks, marginals: Marginals, tuples, *, n_bins: int = 10,
                 discrepancy: str = "abs", spacing: str = "linear", aggregate: str = "uniform") -> RankwiseECE:
    """Rank-wise ECE over the given events (``kind`` "sub" or "top"): one :func:`binary_ece` per event, combined
    by :func:`aggregate_ece`. Events are processed in chunks so that n x chunk arrays stay small."""
    r = check_true_ranks(true_ranks)
    tuples = np.asarray(tuples, dtype=np.int64)
    n = len(r)
    # most_confident is accepted for sub-k as well (the reference raises there): one metric.ranking.aggregate value
    # applies to the whole sub-k / top-k sweep, and "the 5 events with the most predicted mass" is as well defined
    # for sub-k events as for prefixes, so refusing it would only make such a run fail half-way.
    check_choice("aggregate", aggregate, AGGREGATES)
    step = max(1, min(_MAX_EVENTS_PER_CALL, _CHUNK_ELEMENTS // n))
    parts = []
    for lo in range(0, len(tuples), step):
        t = tuples[lo: lo + step]
        parts.append(binary_ece(event_labels(kind, r, t), _marginals(marginals, t, n), n_bins=n_bins,
                                discrepancy=discrepancy, spacing=spacing))
    if parts:
        ece = np.concatenate([p.ece for p in parts])
        prev = np.concatenate([p.prevalence for p in parts])
        mass = np.concatenate([p.pred_mass for p in parts])
    else:
        ece = prev = mass = np.zeros(0)
    return RankwiseECE(ece=aggregate_ece(ece, prev, mass, aggregate), events=tuples, event_ece=ece,
                       prevalence=prev, pred_mass=mass)


def rankwise_sub_k_ece(true_ranks, marginals: Marginals, k: int, *, events: str = "auto", subsets=None,
                       n_bins: int = 10, discrepancy: str = "abs", spacing: str = "linear",
                       aggregate: str = "uniform") -> RankwiseECE:
    """Rank-wise sub-k ECE (Definition 6): events from :func:`sub_k_events`, marginals = P(a1 > ... > ak | x).

    With all P(m, k) events both (i, j) and (j, i) count for k = 2 (their ECEs are equal under ``abs``), and the
    uniform mean is dominated by rare events for large k, as in the paper's figures.
    """
    tuples = sub_k_events(true_ranks, k, events=events, subsets=subsets)
    return rankwise_ece("sub", true_ranks, marginals, tuples, n_bins=n_bins, discrepancy=discrepancy,
                        spacing=spacing, aggregate=aggregate)


def rankwise_top_k_ece(true_ranks, marginals: Marginals, k: int, *, events: str = "auto", n_bins: int = 10,
                       discrepancy: str = "abs", spacing: str = "linear", aggregate: str = "uniform") -> RankwiseECE:
    """Rank-wise top-k ECE (Definition 7): events from :func:`top_k_events`, marginals = P(first k = a1..ak | x).

    Top-(m-1) is the same event as the full ranking, so top-(m-1) = top-m = sub-m.
    """
    tuples = top_k_events(true_ranks, k, events=events)
    return rankwise_ece("top", true_ranks, marginals, tuples, n_bins=n_bins, discrepancy=discrepancy,
                        spacing=spacing, aggregate=aggregate)


# ---------------------------------------------------------------------------------------------------------------
# Full-rank calibration: Dirichlet kernel estimator (Definitions 4 and 5, appendix E)
# ---------------------------------------------------------------------------------------------------------------


def check_kernel_args(h, p) -> tuple[float, float]:
    if isinstance(h, bool) or not isinstance(h, (int, float, np.integer, np.floating)) or not h > 0:
        raise UserError(f"kernel bandwidth h must be a number > 0, got {h!r}")
    if isinstance(p, bool) or not isinstance(p, (int, float, np.integer, np.floating)) or not p >= 1:
        raise UserError(f"kernel norm p must be a number >= 1 (or inf), got {p!r}")
    return float(h), float(p)


# The kernel works on row blocks of about this many float64 elements (2 MiB: the block is written by one matrix
# product and then read four times, so it should stay in cache; 32 MiB blocks made the n = 5000 case 2x slower).
_KERNEL_CHUNK_ELEMENTS = 1 << 18
# Up to this many classes the per-class sums of kernel weights are one matrix product with the one-hot labels (BLAS,
# O(n^2 C)); above it, sums over the runs of label-sorted columns (O(n^2), independent of C).
_ONEHOT_MAX_CLASSES = 16


@functools.cache
def _blas_threads():
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


def _one_blas_thread(skinny: bool):
    """One BLAS thread for products whose inner dimension is tiny: they are memory-bound, so a second thread gains
    little, and on a busy machine OpenBLAS's threads wait for each other (a full-rank sub-3 sweep at n = 1000 took
    1.9 s instead of 65 ms while another process kept both cores busy). Large products keep their threads."""
    return _blas_threads().limit(limits=1) if skinny else contextlib.nullcontext()


def dirichlet_kernel_errors(probs, labels, *, h: float = 1.0, p: float = 1, chunk_size: int | None = None
                            ) -> np.ndarray:
    """Per-sample errors ||yhat_j - f_j||_p of the Dirichlet-kernel estimator (see :func:`dirichlet_kernel_ece`)."""
    h, p = check_kernel_args(h, p)
    f = np.asarray(probs, dtype=np.float64)
    y = np.asarray(labels).astype(np.int64).reshape(-1)
    if f.ndim != 2 or len(f) != len(y):
        raise UserError(f"kernel ECE needs probabilities (n, C) and labels (n,), got {np.shape(probs)} and "
                        f"{np.shape(labels)}")
    n, n_classes = f.shape
    if n < 2:
        raise UserError(f"the leave-one-out kernel estimator needs at least 2 samples, got {n}")
    if y.min() < 0 or y.max() >= n_classes:
        raise UserError(f"kernel ECE: labels must be class indices in 0..{n_classes - 1}")
    # Samples sorted by label once, so the columns of each class are one contiguous run (no per-block gather).
    order = np.argsort(y, kind="stable")
    f, y = f[order], y[order]
    alpha = f / h + 1.0  # Dirichlet parameters of each sample i
    # log k(f_j; f_i) = log_norm_i + sum_c (alpha_ic - 1) log f_jc as ONE matrix product: [log f_j, 1] @ [alpha_i - 1;
    # log_norm_i], where log_norm_i = ln Gamma(sum_c alpha_ic) - sum_c ln Gamma(alpha_ic).
    left = np.empty((n, n_classes + 1))
    left[:, :n_classes] = np.log(np.maximum(f, KERNEL_LOG_FLOOR))
    left[:, n_classes] = 1.0
    right = np.empty((n_classes + 1, n))
    right[:n_classes] = (alpha - 1.0).T
    right[n_classes] = gammaln(alpha.sum(axis=1)) - gammaln(alpha).sum(axis=1)
    onehot = runs = None
    if n_classes <= _ONEHOT_MAX_CLASSES:  # one product gives the per-class sums and, in the last column, the total
        onehot = np.zeros((n, n_classes + 1))
        onehot[np.arange(n), y] = 1.0
        onehot[:, n_classes] = 1.0
    else:
        runs = np.unique(y, return_index=True)  # (classes present, start of each one's columns)
    if chunk_size is None:
        chunk_size = max(1, _KERNEL_CHUNK_ELEMENTS // max(n, n_classes))
    step = int(chunk_size)
    errors = np.empty(n)
    with _one_blas_thread(onehot is not None):
        for lo in range(0, n, step):
            errors[lo: lo + step] = _kernel_block(left, right, f, onehot, runs, lo, min(n, lo + step), p)
    errors[order] = errors.copy()
    return errors


def _kernel_block(left, right, f, onehot, runs, lo: int, hi: int, p: float) -> np.ndarray:
    """The errors of rows lo:hi of the kernel estimator (the arrays of :func:`dirichlet_kernel_errors`)."""
    n_classes = f.shape[1]
    logk = left[lo:hi] @ right  # (c, n): log Dir(f_j; alpha_i), rows j, columns i
    logk[np.arange(hi - lo), np.arange(lo, hi)] = -np.inf  # leave one out
    logk -= logk.max(axis=1, keepdims=True)
    w = np.exp(logk, out=logk)
    if onehot is not None:
        sums = w @ onehot
        num, total = sums[:, :n_classes], sums[:, n_classes:]
    else:
        present, starts = runs
        num = np.zeros((hi - lo, n_classes))
        num[:, present] = np.add.reduceat(w, starts, axis=1)
        total = w.sum(axis=1, keepdims=True)
    diff = np.abs(num / (total + KERNEL_DENOM_EPS) - f[lo:hi])
    if np.isinf(p):
        return diff.max(axis=1)
    if p == 1:
        return diff.sum(axis=1)
    return (diff**p).sum(axis=1) ** (1.0 / p)


def dirichlet_kernel_ece(probs, labels, *, h: float = 1.0, p: float = 1, chunk_size: int | None = None) -> float:
    """Canonical (full-distribution) calibration error with the Dirichlet kernel (Popordanoska et al. 2022).

    For predicted vectors f_j (n, C) and class labels y_j, with alpha_i = f_i / h + 1:

        log k(f_j; f_i) = ln Gamma(sum_c alpha_ic) - sum_c ln Gamma(alpha_ic) + sum_c (alpha_ic - 1) ln f_jc

    the Dirichlet(alpha_i) log-density at f_j, f clamped at 1e-8 inside the log; leave-one-out (k(f_j; f_j) = 0);
    each row j shifted by its maximum before exponentiating (w_ji); yhat_j = sum_i w_ji e_{y_i} /
    (sum_i w_ji + 1e-8); and ECE = (1/n) sum_j ||yhat_j - f_j||_p.

    Reading chosen where the paper's appendix E formula is garbled: the **p-norm itself** (no p-th power, no outer
    root), with the defaults h = 1 and p = 1 of the reference experiments (the paper prints a squared 2-norm; the
    reference's docstring says L_p^p; its code and its published numbers use the plain norm). Caveats: with
    constant predictions it is the distance to the leave-one-out label frequency, so a perfectly calibrated
    constant predictor scores > 0 at finite n (0.2 for 6 samples of a fair binary outcome); with h = 1 (alpha in
    [1, 2]) the kernel is nearly flat, so the score mostly measures the distance of each f_j from the pooled label
    distribution: on synthetic Plackett-Luce data (m = 4, n = 2000, full-rank sub-2) the true model scores 0.31
    and a temperature-flattened one (log-weights x 0.3) 0.15, while h = 0.02 orders them correctly (0.04 vs
    0.16). Work is chunked over rows j: memory O(chunk * n + n * C), the (n, n, C) tensor of the reference is never
    formed (the sum over classes is one matrix product); time O(n^2 C).
    """
    return float(dirichlet_kernel_errors(probs, labels, h=h, p=p, chunk_size=chunk_size).mean())


@dataclass(frozen=True, eq=False)
class FullRankProblem:
    """One multiclass problem: predicted vectors (n, C), labels (n,) and the classes (C_listed, k).

    When ``has_other`` the last column of ``probs`` is the "other" class (the predicted mass not on a listed class)
    and ``classes`` lists only the C - 1 named ones.
    """

    probs: np.ndarray
    labels: np.ndarray
    classes: np.ndarray
    has_other: bool


def _class_index(classes: np.ndarray, rows: np.ndarray, other: int) -> np.ndarray:
    """Index of each row among the class rows, ``other`` where it is none of them."""
    both = np.concatenate([classes, rows])
    _, inv = np.unique(both, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    class_of = np.full(len(both), other, dtype=np.int64)
    class_of[inv[: len(classes)]] = np.arange(len(classes))
    return class_of[inv[len(classes):]]


def _problem(classes: np.ndarray, probs: np.ndarray, true_rows: np.ndarray, restricted: bool,
             n_possible: int) -> FullRankProblem:
    has_other = restricted and len(classes) < n_possible
    if has_other:
        rest = np.clip(1.0 - probs.sum(axis=1, keepdims=True), 0.0, None)
        probs = np.concatenate([probs, rest], axis=1)
    labels = _class_index(classes, true_rows, other=len(classes))
    if not has_other and (labels == len(classes)).any():
        raise ValueError("a true sub-ranking is not among the classes")  # unreachable: classes cover the labels
    return FullRankProblem(probs=probs, labels=labels, classes=classes, has_other=has_other)


def sub_k_full_rank_problems(true_ranks, marginals: Marginals, subsets, *, events: str = "auto",
                             class_ranks=None, other_class: bool = True) -> list[FullRankProblem]:
    """The multiclass problem of each unordered subset (rows of ``subsets``, k items) for full-rank sub-k.

    Classes: all k! orderings of the subset in itertools order of the sorted subset; restricted (m >= 8 under
    ``events="auto"``): the orderings observed in the test labels (lexicographic) plus an "other" class with the
    remaining mass when fewer than k! are observed. Label = the ordering the true ranking induces on the subset;
    predicted vector = the sub-k marginals of the classes (``marginals``).

    ``class_ranks``: the rankings whose sub-orderings are the restricted classes (default ``true_ranks``; the
    restriction to frequent rankings passes the labels from before it dropped samples, as the reference does);
    ``other_class=False`` leaves out the "other" class (the reference's semantics: mass off the classes is lost).
    """
    r = check_true_ranks(true_ranks)
    n, m = r.shape
    source = r if class_ranks is None else check_true_ranks(class_ranks)
    subsets = np.sort(np.asarray(subsets, dtype=np.int64), axis=1)
    k = subsets.shape[1]
    restricted = _restricted(m, events)
    n_possible = math.factorial(k)
    if restricted:
        class_lists = [observed_sub_orderings(source, s[None, :]) for s in subsets]
    else:
        perms = all_orderings(k)
        class_lists = [s[perms] for s in subsets]
    all_classes = np.concatenate(class_lists)
    step = max(1, min(_MAX_EVENTS_PER_CALL, _CHUNK_ELEMENTS // n))
    probs = np.concatenate([_marginals(marginals, all_classes[lo: lo + step], n)
                            for lo in range(0, len(all_classes), step)], axis=1)
    problems, lo = [], 0
    for s, classes in zip(subsets, class_lists):
        hi = lo + len(classes)
        problems.append(_problem(classes, probs[:, lo:hi], induced_orderings(r, s), restricted and other_class,
                                 n_possible))
        lo = hi
    return problems


def top_k_full_rank_problem(true_ranks, marginals: Marginals, k: int, *, events: str = "auto", class_ranks=None,
                            other_class: bool = True) -> FullRankProblem:
    """The multiclass problem of full-rank top-k: classes = all P(m, k) prefixes (lexicographic), or the observed
    prefixes (of ``class_ranks``, default ``true_ranks``) plus an "other" class (unless ``other_class=False``) when
    restricted; label = the true prefix; vector = top-k marginals."""
    r = check_true_ranks(true_ranks)
    n, m = r.shape
    k = check_k("top", k, m)
    restricted = _restricted(m, events)
    source = r if class_ranks is None else check_true_ranks(class_ranks)
    classes = observed_prefixes(source, k) if restricted else all_prefixes(m, k)
    step = max(1, min(_MAX_EVENTS_PER_CALL, _CHUNK_ELEMENTS // n))
    probs = np.concatenate([_marginals(marginals, classes[lo: lo + step], n)
                            for lo in range(0, len(classes), step)], axis=1)
    n_possible = math.perm(m, k)
    return _problem(classes, probs, ranks_to_orderings(r)[:, :k], restricted and other_class, n_possible)


# ---------------------------------------------------------------------------------------------------------------
# Full-rank calibration: simplex binning (the reference's other estimator; 2 or 3 classes)
# ---------------------------------------------------------------------------------------------------------------


class BinningUndefined(UserError):
    """Simplex binning asked for a problem with other than 2 or 3 classes."""


def simplex_bins(probs, *, n_bins: int = SIMPLEX_BINS) -> np.ndarray:
    """The simplex bin of each predicted vector (n, K), K = 2 or 3, as one integer per row.

    Step 1 / n_bins. K = 2: the bin of p_1, floor(n_bins * p_1) capped at n_bins - 1 (the last bin holds 1.0).
    K = 3: the pair (i, j) = (floor(n_bins * p_1), floor(n_bins * p_2)), each capped at n_bins; when i + j exceeds
    n_bins (possible only when p_1 + p_2 rounds above 1) the index of the larger coordinate (p_1 on a tie) is lowered
    to make i + j = n_bins. That gives the (n_bins + 1)(n_bins + 2) / 2 = 66 triangular bins of the reference code
    (only p_1 and p_2 are binned; p_3 is not looked at).

    Floors are taken of the exact value the probability stands for (rounded to ``BIN_DECIMALS`` decimals, as
    :func:`bin_index`): 0.3 is in [0.3, 0.4). The reference truncates p / 0.1, which puts 0.3 (2.9999999999999996
    tenths) in [0.2, 0.3); the two agree everywhere except on such edge values.
    """
    f = np.asarray(probs, dtype=np.float64)
    n_classes = f.shape[1]
    if n_classes not in (2, 3):
        raise BinningUndefined(f"simplex binning needs 2 or 3 classes, got {n_classes}")
    inner = np.arange(1, n_bins + 1) / n_bins  # edges 1/n_bins .. 1: floor(n_bins * p) = number of them <= p

    def floor_bins(p):
        return np.digitize(np.round(p, BIN_DECIMALS), inner)

    i = floor_bins(f[:, 0])
    if n_classes == 2:
        return np.minimum(i, n_bins - 1)
    i, j = np.minimum(i, n_bins), np.minimum(floor_bins(f[:, 1]), n_bins)
    over = i + j > n_bins
    lower_i, lower_j = over & (f[:, 0] >= f[:, 1]), over & (f[:, 1] > f[:, 0])
    i, j = np.where(lower_i, n_bins - j, i), np.where(lower_j, n_bins - i, j)
    return i * (n_bins + 1) + j


def simplex_binning_ece(probs, labels, *, n_bins: int = SIMPLEX_BINS) -> float:
    """Multiclass (canonical) calibration error by simplex binning, for 2 or 3 classes:

        error = sum_b (n_b / N) * || mean_{i in b} f_i - mean_{i in b} e_{y_i} ||_1

    over the non-empty bins b of :func:`simplex_bins` (step 0.1 by default), e_y the one-hot label. The reference
    code's ``strong_calibration_error_torch`` (its ``mode="binning"``); the paper uses the Dirichlet kernel instead
    and defines no binned estimator. A one-line :class:`BinningUndefined` (a UserError) for other class counts:
    the number of bins would grow as n_bins^(K - 1).
    """
    f = np.asarray(probs, dtype=np.float64)
    y = np.asarray(labels).astype(np.int64).reshape(-1)
    if f.ndim != 2 or len(f) != len(y) or len(f) == 0:
        raise UserError(f"simplex binning needs probabilities (n, C) with n >= 1 and labels (n,), got "
                        f"{np.shape(probs)} and {np.shape(labels)}")
    n, n_classes = f.shape
    bins = simplex_bins(f, n_bins=n_bins)
    if y.min() < 0 or y.max() >= n_classes:
        raise UserError(f"simplex binning: labels must be class indices in 0..{n_classes - 1}")
    present, inv = np.unique(bins, return_inverse=True)
    inv = inv.reshape(-1)
    count = np.bincount(inv, minlength=len(present)).astype(np.float64)
    sum_f = np.zeros((len(present), n_classes))
    np.add.at(sum_f, inv, f)
    sum_y = np.zeros((len(present), n_classes))
    np.add.at(sum_y, (inv, y), 1.0)
    l1 = np.abs(sum_f / count[:, None] - sum_y / count[:, None]).sum(axis=1)
    return float(np.sum(count / n * l1))


# ---------------------------------------------------------------------------------------------------------------
# Full-rank sub-k / top-k calibration error (Definitions 4 and 5)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class FullRankECE:
    """A full-rank result: the ECE (mean over problems) and each problem's ECE; ``subsets`` (S, k) for sub-k."""

    ece: float
    problem_ece: np.ndarray
    n_classes: np.ndarray
    subsets: np.ndarray | None = None


def _check_binning_classes(kind: str, k: int, counts) -> None:
    bad = sorted({int(c) for c in counts} - {2, 3})
    if bad:
        raise BinningUndefined(f"full-rank {kind}-{k}: simplex binning needs 2 or 3 classes per problem, got "
                               f"{bad[0]}{' (and more)' if len(bad) > 1 else ''}")


def _estimate(problem: FullRankProblem, estimator: str, h: float, p: float, chunk_size: int | None) -> float:
    if estimator == "binning":
        return simplex_binning_ece(problem.probs, problem.labels)
    return dirichlet_kernel_ece(problem.probs, problem.labels, h=h, p=p, chunk_size=chunk_size)


def full_rank_sub_k_ece(true_ranks, marginals: Marginals, k: int, *, subsets=None, events: str = "auto",
                        h: float = 1.0, p: float = 1, chunk_size: int | None = None, estimator: str = "kernel",
                        class_ranks=None, other_class: bool = True) -> FullRankECE:
    """Full-rank sub-k calibration error (Definition 4, eq. 9): the ECE of each subset's multiclass problem
    (:func:`sub_k_full_rank_problems`), averaged uniformly over the subsets (all C(m, k) unless ``subsets`` given,
    e.g. from :func:`sample_subsets`).

    ``estimator``: ``kernel`` (:func:`dirichlet_kernel_ece`, cost O(S * n^2 * C)) or ``binning``
    (:func:`simplex_binning_ece`; only when every problem has 2 or 3 classes, i.e. k = 2 with all orderings
    enumerated, otherwise a one-line :class:`BinningUndefined`). ``class_ranks`` / ``other_class``: see
    :func:`sub_k_full_rank_problems`.
    """
    r = check_true_ranks(true_ranks)
    m = r.shape[1]
    k = check_k("sub", k, m)
    check_kernel_args(h, p)
    check_choice("full_rank_estimator", estimator, FULL_RANK_ESTIMATORS)
    if estimator == "binning" and not _restricted(m, events):
        _check_binning_classes("sub", k, [math.factorial(k)])  # before computing any marginal
    subsets = _all_subsets(m, k) if subsets is None else np.sort(np.asarray(subsets, dtype=np.int64), axis=1)
    if subsets.ndim != 2 or subsets.shape[1] != k:
        raise UserError(f"subsets must be an (S, {k}) array of item ids, got shape {subsets.shape}")
    problems = sub_k_full_rank_problems(r, marginals, subsets, events=events, class_ranks=class_ranks,
                                        other_class=other_class)
    n_classes = np.array([q.probs.shape[1] for q in problems])
    if estimator == "binning":
        _check_binning_classes("sub", k, n_classes)
    values = np.array([_estimate(q, estimator, h, p, chunk_size) for q in problems])
    return FullRankECE(ece=float(values.mean()) if len(values) else float("nan"), problem_ece=values,
                       n_classes=n_classes, subsets=subsets)


def full_rank_top_k_ece(true_ranks, marginals: Marginals, k: int, *, events: str = "auto", h: float = 1.0,
                        p: float = 1, chunk_size: int | None = None, estimator: str = "kernel", class_ranks=None,
                        other_class: bool = True) -> FullRankECE:
    """Full-rank top-k calibration error (Definition 5, eq. 10): the ECE of the single problem over prefixes
    (``estimator`` as in :func:`full_rank_sub_k_ece`; binning only with 2 or 3 prefixes, e.g. top-1 with m <= 3).
    Top-(m-1) is full-rank calibration itself (Definition 1, eq. 5)."""
    check_kernel_args(h, p)
    check_choice("full_rank_estimator", estimator, FULL_RANK_ESTIMATORS)
    r = check_true_ranks(true_ranks)
    m = r.shape[1]
    if estimator == "binning" and not _restricted(m, events):
        _check_binning_classes("top", k, [math.perm(m, check_k("top", k, m))])
    q = top_k_full_rank_problem(r, marginals, k, events=events, class_ranks=class_ranks, other_class=other_class)
    if estimator == "binning":
        _check_binning_classes("top", k, [q.probs.shape[1]])
    value = _estimate(q, estimator, h, p, chunk_size)
    return FullRankECE(ece=value, problem_ece=np.array([value]), n_classes=np.array([q.probs.shape[1]]))


# ---------------------------------------------------------------------------------------------------------------
# Appendix E's restriction to the most frequent rankings (the reference's 95_prob_mass / top_10)
# ---------------------------------------------------------------------------------------------------------------


def frequent_rankings(true_ranks, restrict: str) -> np.ndarray:
    """The most frequent full rankings of ``true_ranks`` as orderings (R, m), most frequent first.

    The rankings are counted and sorted by count, descending; equal counts keep the order of first occurrence in
    ``true_ranks``. ``prob_mass_95``: the first rankings whose cumulative share of the samples reaches >= 0.95;
    ``top_10``: the 10 most frequent (all when there are fewer).
    """
    r = check_true_ranks(true_ranks)
    check_choice("restrict", restrict, RESTRICTIONS[1:])
    uniq, first, counts = np.unique(ranks_to_orderings(r), axis=0, return_index=True, return_counts=True)
    order = np.lexsort((first, -counts))  # count descending, then first occurrence
    if restrict == "top_10":
        return uniq[order[:TOP_RANKINGS]]
    share = np.cumsum(counts[order]) / len(r)
    return uniq[order[: int(np.argmax(share >= PROB_MASS_SHARE)) + 1]]  # the last share is 1.0


class _RestrictedPairs(RankingDistribution):
    """A pairs-only distribution (RPC) on some samples, each pair's probability kept where ``allowed[a, b]`` (some
    selected ranking ranks a before b) and 0 elsewhere."""

    def __init__(self, inner: RankingDistribution, rows: np.ndarray, allowed: np.ndarray):
        self.inner, self.rows, self.allowed = inner, rows, allowed
        self.n, self.m = len(rows), inner.m
        self.max_sub_k, self.max_top_k = 2, 0

    def sub_k(self, tuples) -> np.ndarray:
        t = np.asarray(tuples, dtype=np.int64)
        self.check_k("sub", t.shape[1])
        p = np.asarray(self.inner.sub_k(t), dtype=np.float64)[self.rows]
        return p * self.allowed[t[:, 0], t[:, 1]] if t.shape[1] == 2 else p

    def top_k(self, tuples) -> np.ndarray:
        self.check_k("top", np.asarray(tuples).shape[1])  # always raises: no top-k marginals
        raise AssertionError("unreachable")

    def mode_ranks(self) -> np.ndarray:
        return self.inner.mode_ranks()[self.rows]


@dataclass(frozen=True, eq=False)
class RestrictedRankings:
    """The result of :func:`restrict_to_frequent_rankings`: ``selected`` orderings (R, m), the boolean ``keep`` mask
    of the samples (n,), and ``dist``, the restricted distribution on the kept samples (keep.sum() of them)."""

    selected: np.ndarray
    keep: np.ndarray
    dist: RankingDistribution


def restrict_to_frequent_rankings(dist: RankingDistribution, true_ranks, restrict: str) -> RestrictedRankings:
    """Appendix E's restriction to the most frequent rankings, as the reference code implements it
    (``rank_weighting`` = ``95_prob_mass`` / ``top_10``; the paper: "among these observed rankings, we retain the
    most frequent ones based on empirical frequency").

    1. select rankings with :func:`frequent_rankings` from the test labels themselves;
    2. drop the samples whose true ranking is not selected;
    3. drop the predicted mass outside the selected rankings, **without renormalising**: the restricted
       distribution is an explicit one over the selected rankings, each with the model's own probability of that
       full ranking (its top-(m-1) marginal), so every marginal only sums the selected rankings. A pairs-only
       distribution (RPC, no full-ranking probabilities) keeps P(a > b) when some selected ranking ranks a before b
       and sets it to 0 otherwise (the reference keeps a partial key consistent with at least one selected ranking).

    **Label-dependent and mass-removing**: which rankings count depends on the test labels, and a model that spreads
    probability over rankings outside the selection loses that mass from every marginal, so it looks miscalibrated
    (the reference's Mallows full-rank ECE is 0.94 on segment under 95%). Use it to compare with the reference's
    tables, not as a calibration measure.
    """
    r = check_true_ranks(true_ranks)
    if (len(r), r.shape[1]) != (dist.n, dist.m):
        raise UserError(f"true ranks have shape {r.shape} but the distribution covers n={dist.n} samples of "
                        f"m={dist.m} items")
    selected = frequent_rankings(r, restrict)
    orderings = ranks_to_orderings(r)
    keep = (orderings[:, None, :] == selected[None, :, :]).all(axis=2).any(axis=1)
    rows = np.flatnonzero(keep)
    m = dist.m
    if dist.max_top_k >= m - 1 or dist.max_sub_k >= m:
        full = selected[:, : m - 1] if dist.max_top_k >= m - 1 else selected
        fn = dist.top_k if dist.max_top_k >= m - 1 else dist.sub_k
        probs = np.concatenate([_marginals(fn, full[lo: lo + _MAX_EVENTS_PER_CALL], dist.n)
                                for lo in range(0, len(full), _MAX_EVENTS_PER_CALL)], axis=1)
        restricted: RankingDistribution = ExplicitDistribution(selected, probs[rows])
    elif dist.max_sub_k == 2 and dist.max_top_k == 0:
        ranks = orderings_to_ranks(selected)
        allowed = (ranks[:, :, None] < ranks[:, None, :]).any(axis=0)
        restricted = _RestrictedPairs(dist, rows, allowed)
    else:
        raise UserError(f"restrict={restrict} needs full-ranking probabilities or pairwise ones; "
                        f"{type(dist).__name__} has sub-k up to {dist.max_sub_k} and top-k up to {dist.max_top_k}")
    return RestrictedRankings(selected=selected, keep=keep, dist=restricted)


# ---------------------------------------------------------------------------------------------------------------
# Accuracy of the modal ranking
# ---------------------------------------------------------------------------------------------------------------


def _check_pair(true_ranks, pred_ranks) -> tuple[np.ndarray, np.ndarray]:
    t = check_true_ranks(true_ranks)
    p = np.asarray(pred_ranks)
    if p.shape != t.shape:
        raise UserError(f"predicted ranks have shape {p.shape}, true ranks {t.shape}")
    return t, p


def kendall_tau_samples(true_ranks, pred_ranks) -> np.ndarray:
    """Per-sample Kendall tau_a: (concordant - discordant) / (m (m - 1) / 2) over item pairs; a pair tied in either
    ranking counts as discordant (sklr's ``tau_score``, used by the reference). 1 = identical, -1 = reversed."""
    t, p = _check_pair(true_ranks, pred_ranks)
    m = t.shape[1]
    i, j = np.triu_indices(m, k=1)
    step = max(1, _CHUNK_ELEMENTS // len(i))
    out = np.empty(len(t))
    for lo in range(0, len(t), step):
        s = np.sign(t[lo: lo + step, i] - t[lo: lo + step, j]) * np.sign(p[lo: lo + step, i] - p[lo: lo + step, j])
        out[lo: lo + step] = 2.0 * (s > 0).sum(axis=1) / len(i) - 1.0
    return out


def footrule_samples(true_ranks, pred_ranks) -> np.ndarray:
    """Per-sample Spearman footrule sum_j |rank_true(j) - rank_pred(j)| (0 = identical)."""
    t, p = _check_pair(true_ranks, pred_ranks)
    return np.abs(t - p).sum(axis=1).astype(np.float64)


def max_footrule(m: int) -> int:
    """The largest footrule between two rankings of m items, floor(m^2 / 2) (attained by the reversal)."""
    return (m * m) // 2


def top1_correct(true_ranks, pred_ranks) -> np.ndarray:
    """Per sample, 1.0 where the predicted best item (rank 1) is the true best item."""
    t, p = _check_pair(true_ranks, pred_ranks)
    return (np.argmin(t, axis=1) == np.argmin(p, axis=1)).astype(np.float64)


def ranking_accuracy(true_ranks, pred_ranks) -> dict[str, float]:
    """Means over samples: ``kendall_tau``, ``footrule``, ``footrule_norm`` (footrule / floor(m^2/2), in [0, 1])
    and ``top1_accuracy``."""
    t, p = _check_pair(true_ranks, pred_ranks)
    foot = footrule_samples(t, p)
    return {
        "kendall_tau": float(kendall_tau_samples(t, p).mean()),
        "footrule": float(foot.mean()),
        "footrule_norm": float(foot.mean() / max_footrule(t.shape[1])),
        "top1_accuracy": float(top1_correct(t, p).mean()),
    }


# ---------------------------------------------------------------------------------------------------------------
# Every metric of one predicted distribution: the flat ``rank/...`` dict
# ---------------------------------------------------------------------------------------------------------------
#
# ranking_evaluation wires a RankingDistribution (its marginals and modal ranking) to the functions above. Names:
#
# * ``rank/kendall_tau``, ``rank/footrule``, ``rank/footrule_norm``, ``rank/top1_accuracy``: the modal ranking
#   (always on every test sample, whatever ``restrict``);
# * ``rank/sub_<k>/ece`` (k >= 2) and ``rank/top_<k>/ece`` (k >= 1): rank-wise ECE (Definitions 6, 7), with
#   ``.../n_events``;
# * ``rank/full/sub_<k>/ece`` and ``rank/full/top_<k>/ece``: full-rank calibration error (Definitions 4, 5; the
#   Dirichlet kernel, or simplex binning with ``full_rank_estimator="binning"``), with
#   ``rank/full/sub_<k>/n_subsets`` and ``rank/full/top_<k>/n_classes``;
# * with ``restrict`` other than "none": ``rank/restrict/n_rankings`` (rankings selected) and
#   ``rank/restrict/n_samples`` (test samples kept).
#
# Which k: by default sub-k for k = 2..min(m, max_sub_k, max_k) and top-k for k = 1..min(m - 1, max_top_k, max_k),
# **plus top-(m-1) for every m**: the full ranking itself, so ``rank/top_<m-1>/ece`` is rank-wise calibration
# (Definition 2) and ``rank/full/top_<m-1>/ece`` full-rank calibration (Definition 1) of the whole ranking; it is
# the same event as sub-m and top-m. It is left out only where the distribution has no such marginals (RPC) or
# where it would enumerate more than 8! = 40,320 rankings (events=all, or "auto" never: from m = 8 "auto" uses the
# observed rankings, at most n), with the reason in ``RankingEvaluation.skipped``. ``max_k`` (default 5) bounds the
# sub-k / top-k sweep only: the reference sweeps k up to m, which for letter (m = 26) means P(26, k) events and
# C(26, k) subsets. A distribution without top-k marginals (RPC: pairs only, max_top_k = 0) simply has no top-k
# keys, and RPC's sub-k stops at 2: absent keys, never -1 sentinels. Sub-k problems use at most ``max_subsets``
# (default 200) unordered subsets per k, drawn without replacement with ``numpy.random.default_rng((seed, k))``
# when C(m, k) is larger (never for m <= 9 and k <= 5); the rank-wise sub-k events are then the orderings of those
# same subsets (observed ones when m >= 8). Cost of the kernel metrics: O(S n^2 C) per k; letter (n = 4000 per
# fold) takes about 0.4 s per sub-3 subset on 2 cores, so lower max_subsets or set full_rank=False there. The full
# ranking of m = 7 (segment: 5040 classes) is one kernel problem with C = 5040.
#
# Simplex binning (``full_rank_estimator="binning"``) exists for 2 or 3 classes only: full-rank sub-2 and, for
# m <= 3, top-1 (more with events=observed when few orderings are observed). Every other full-rank key is left out
# with its reason in ``skipped`` (the label-ranking run logs the reasons once), not an error.

DEFAULT_MAX_K = 5
DEFAULT_MAX_SUBSETS = 200
DEFAULT_KERNEL_MAX_SAMPLES = 1000
# The full ranking joins the default top-k sweep unless that enumerates more rankings than this (m >= 9 with
# events=all): a kernel problem with m! classes needs O(n m!) memory several times over.
FULL_RANKING_MAX_EVENTS = math.factorial(8)


@dataclass(frozen=True, eq=False)
class RankingEvaluation:
    """``metrics``: the flat dict; ``rankwise`` / ``full_rank``: per-event and per-subset details keyed like the
    metric prefixes (``"sub_2"``, ``"top_1"``), for figures; ``skipped``: metric keys left out, with the reason."""

    metrics: dict[str, float]
    rankwise: dict[str, RankwiseECE] = field(default_factory=dict)
    full_rank: dict[str, FullRankECE] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def _ks(kind: str, ks, m: int, limit: int, max_k: int) -> list[int]:
    if ks is None:
        low, high = (2, m) if kind == "sub" else (1, m - 1)
        return list(range(low, min(high, limit, max_k) + 1))
    values = [ks] if isinstance(ks, (int, np.integer)) else list(ks)
    return sorted({check_k(kind, k, m, limit) for k in values})


def default_top_ks(m: int, limit: int, max_k: int, events: str) -> tuple[list[int], str | None]:
    """The default top-k values: 1..min(m - 1, limit, max_k) and the full ranking m - 1 (when ``limit`` allows it);
    and the reason the full ranking is left out (None when it is not)."""
    ks = _ks("top", None, m, limit, max_k)
    full = m - 1
    if full < 1 or limit < full or full in ks:
        return ks, None
    if not _restricted(m, events) and math.perm(m, full) > FULL_RANKING_MAX_EVENTS:
        return ks, (f"the full ranking (top-{full}) is left out: events={events} would enumerate all {m}! = "
                    f"{math.perm(m, full):,} rankings (more than {FULL_RANKING_MAX_EVENTS:,}); use events=auto or "
                    "observed to get it over the observed rankings")
    return ks + [full], None


def ranking_evaluation(dist: RankingDistribution, true_ranks: np.ndarray, *, ks_sub=None, ks_top=None,
                       n_bins: int = 10, discrepancy: str = "abs", spacing: str = "linear",
                       aggregate: str = "uniform", kernel_h: float = 1.0, kernel_p: float = 1,
                       full_rank: bool = True, max_k: int = DEFAULT_MAX_K,
                       max_subsets: int | None = DEFAULT_MAX_SUBSETS, events: str = "auto",
                       kernel_max_samples: int | None = DEFAULT_KERNEL_MAX_SAMPLES, restrict: str = "none",
                       full_rank_estimator: str = "kernel", seed: int = 0) -> RankingEvaluation:
    """Every ranking metric of ``dist`` against ``true_ranks`` (n, m; 1 = best), with per-event details.

    ``ks_sub`` / ``ks_top``: the k values (None: the default sweep above, top-(m-1) included; an explicit k outside
    2..min(m, max_sub_k) or 1..min(m, max_top_k) is a one-line UserError). ``n_bins``, ``discrepancy``,
    ``spacing``, ``aggregate``: the rank-wise ECE (:func:`binary_ece`, :func:`aggregate_ece`); ``kernel_h``,
    ``kernel_p``: the full-rank kernel estimator (h = 1, p = 1 as in the reference experiments);
    ``full_rank_estimator``: ``kernel`` or ``binning`` (:func:`simplex_binning_ece`; keys whose problems do not have
    2 or 3 classes are skipped); ``full_rank=False`` skips the full-rank metrics (O(n^2) each with the kernel);
    ``events``: "auto" (all events for m < 8, observed ones from m = 8), "all" or "observed". ``restrict``:
    "none" (default), or "prob_mass_95" / "top_10", appendix E's label-dependent restriction to the most frequent
    test rankings (:func:`restrict_to_frequent_rankings`: samples with other rankings are dropped and predicted mass
    outside the selection is removed, so models that spread mass look miscalibrated; for comparison with the
    reference's tables). Events and restricted class lists are then still taken from every test label (as the
    reference does) and the restricted full-rank problems have no "other" class (the removed mass stays removed).
    ``kernel_max_samples``: the kernel metrics use at most this many test samples, a seeded random subset
    (``default_rng([seed, 7])``) when there are more (None: all): the estimator costs O(n^2 C) per problem, 0.4 s
    per sub-k subset at n = 4000 (letter's test folds), so 200 subsets per k would take minutes per fold; at
    n = 1000 it is 16x cheaper. Rank-wise metrics always use every (kept) sample. Names and defaults: see the
    comment block above.
    """
    true_ranks = check_true_ranks(true_ranks)
    n, m = true_ranks.shape
    if (n, m) != (dist.n, dist.m):
        raise UserError(f"true ranks have shape {(n, m)} but the distribution covers n={dist.n} samples of "
                        f"m={dist.m} items")
    if isinstance(max_k, bool) or not isinstance(max_k, (int, np.integer)) or max_k < 1:
        raise UserError(f"max_k must be an integer >= 1, got {max_k!r}")
    check_choice("events", events, EVENT_MODES)
    check_choice("restrict", restrict, RESTRICTIONS)
    check_choice("full_rank_estimator", full_rank_estimator, FULL_RANK_ESTIMATORS)
    check_choice("discrepancy", discrepancy, DISCREPANCIES)
    check_choice("aggregate", aggregate, AGGREGATES)
    check_kernel_args(kernel_h, kernel_p)
    if kernel_max_samples is not None and (isinstance(kernel_max_samples, bool) or kernel_max_samples < 2):
        raise UserError(f"kernel_max_samples must be an integer >= 2 or null (all samples), got {kernel_max_samples!r}")
    skipped: dict[str, str] = {}
    ks_sub = _ks("sub", ks_sub, m, dist.max_sub_k, max_k)
    if ks_top is None:
        ks_top, reason = default_top_ks(m, dist.max_top_k, max_k, events)
        if reason:
            skipped[f"rank/top_{m - 1}/ece"] = reason
            if full_rank:
                skipped[f"rank/full/top_{m - 1}/ece"] = reason
    else:
        ks_top = _ks("top", ks_top, m, dist.max_top_k, max_k)

    out: dict[str, float] = {f"rank/{key}": value
                             for key, value in ranking_accuracy(true_ranks, dist.mode_ranks()).items()}
    rankwise: dict[str, RankwiseECE] = {}
    full: dict[str, FullRankECE] = {}
    opts = dict(n_bins=n_bins, discrepancy=discrepancy, spacing=spacing, aggregate=aggregate)
    # Events (and restricted class lists) always come from every test label; the metrics use the kept samples.
    eval_ranks, eval_dist, class_ranks = true_ranks, dist, None
    if restrict != "none":
        res = restrict_to_frequent_rankings(dist, true_ranks, restrict)
        eval_ranks, eval_dist, class_ranks = true_ranks[res.keep], res.dist, true_ranks
        out["rank/restrict/n_rankings"] = float(len(res.selected))
        out["rank/restrict/n_samples"] = float(res.keep.sum())
    n_eval = len(eval_ranks)
    rows = np.arange(n_eval)
    if kernel_max_samples is not None and n_eval > kernel_max_samples:
        rows = np.sort(np.random.default_rng([seed, 7]).choice(n_eval, int(kernel_max_samples), replace=False))
    kernel_ranks = eval_ranks[rows]
    full_opts = dict(events=events, h=kernel_h, p=kernel_p, estimator=full_rank_estimator, class_ranks=class_ranks,
                     other_class=restrict == "none")

    def on_kernel_rows(marginals):
        return marginals if len(rows) == n_eval else (lambda tuples: marginals(tuples)[rows])

    def full_rank_metric(kind: str, k: int, compute) -> FullRankECE | None:
        key = f"rank/full/{kind}_{k}/ece"
        if len(kernel_ranks) < 2:
            skipped[key] = f"only {len(kernel_ranks)} test sample(s) left after restrict={restrict}"
            return None
        try:
            fr = full[f"{kind}_{k}"] = compute()
        except BinningUndefined as err:
            skipped[key] = str(err)
            return None
        out[key] = fr.ece
        return fr

    for k in ks_sub:
        subsets = sample_subsets(m, k, max_subsets, np.random.default_rng((seed, k)))
        tuples = sub_k_events(true_ranks, k, events=events, subsets=subsets)
        res_k = rankwise[f"sub_{k}"] = rankwise_ece("sub", eval_ranks, eval_dist.sub_k, tuples, **opts)
        out[f"rank/sub_{k}/ece"] = res_k.ece
        out[f"rank/sub_{k}/n_events"] = float(len(tuples))
        if full_rank and full_rank_metric("sub", k, lambda: full_rank_sub_k_ece(
                kernel_ranks, on_kernel_rows(eval_dist.sub_k), k, subsets=subsets, **full_opts)):
            out[f"rank/full/sub_{k}/n_subsets"] = float(len(subsets))
    for k in ks_top:
        tuples = top_k_events(true_ranks, k, events=events)
        res_k = rankwise[f"top_{k}"] = rankwise_ece("top", eval_ranks, eval_dist.top_k, tuples, **opts)
        out[f"rank/top_{k}/ece"] = res_k.ece
        out[f"rank/top_{k}/n_events"] = float(len(tuples))
        if full_rank:
            fr = full_rank_metric("top", k, lambda: full_rank_top_k_ece(
                kernel_ranks, on_kernel_rows(eval_dist.top_k), k, **full_opts))
            if fr is not None:
                out[f"rank/full/top_{k}/n_classes"] = float(fr.n_classes[0])
    return RankingEvaluation(metrics=out, rankwise=rankwise, full_rank=full, skipped=skipped)


def ranking_metrics(dist: RankingDistribution, true_ranks: np.ndarray, ks_sub=None, ks_top=None, n_bins: int = 10,
                    discrepancy: str = "abs", kernel_h: float = 1.0, kernel_p: float = 1,
                    max_subsets: int | None = DEFAULT_MAX_SUBSETS, seed: int = 0, *, spacing: str = "linear",
                    aggregate: str = "uniform", full_rank: bool = True, max_k: int = DEFAULT_MAX_K,
                    events: str = "auto", kernel_max_samples: int | None = DEFAULT_KERNEL_MAX_SAMPLES,
                    restrict: str = "none", full_rank_estimator: str = "kernel") -> dict[str, float]:
    """The flat ``rank/...`` metric dict of :func:`ranking_evaluation` (same arguments)."""
    return ranking_evaluation(dist, true_ranks, ks_sub=ks_sub, ks_top=ks_top, n_bins=n_bins,
                              discrepancy=discrepancy, spacing=spacing, aggregate=aggregate, kernel_h=kernel_h,
                              kernel_p=kernel_p, full_rank=full_rank, max_k=max_k, max_subsets=max_subsets,
                              events=events, kernel_max_samples=kernel_max_samples, restrict=restrict,
                              full_rank_estimator=full_rank_estimator, seed=seed).metrics
