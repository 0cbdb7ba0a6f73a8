"""Every ranking metric of one predicted distribution: :func:`ranking_evaluation` wires a
:class:`~rewarduq_exp.ranking.distribution.RankingDistribution` (its marginals and modal ranking) to the metric
functions of the other modules and returns the flat ``rank/...`` dict with per-event details."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rewarduq_exp.core.checks import check_choice
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics.ranking.accuracy import ranking_accuracy
from rewarduq_exp.metrics.ranking.binary_ece import AGGREGATES, DISCREPANCIES
from rewarduq_exp.metrics.ranking.events import (
    EVENT_MODES,
    _restricted,
    check_k,
    check_true_ranks,
    sample_subsets,
    sub_k_events,
    top_k_events,
)
from rewarduq_exp.metrics.ranking.full_rank import (
    FULL_RANK_ESTIMATORS,
    BinningUndefined,
    FullRankECE,
    full_rank_sub_k_ece,
    full_rank_top_k_ece,
)
from rewarduq_exp.metrics.ranking.kernel import check_kernel_args
from rewarduq_exp.metrics.ranking.rankwise import RankwiseECE, rankwise_ece
from rewarduq_exp.metrics.ranking.restrict import RESTRICTIONS, restrict_to_frequent_rankings
from rewarduq_exp.ranking.distribution import RankingDistribution

# The metric names of ranking_evaluation:
#
# * ``rank/kendall_tau``, ``rank/footrule``, ``rank/footrule_norm``, ``rank/top1_accuracy``: the modal ranking
#   (always on every test sample, whatever ``restrict``);
# * ``rank/sub_<k>/ece`` (k >= 2) and ``rank/top_<k>/ece`` (k >= 1): rank-wise ECE (Definitions 6, 7), with
#   ``.../n_events``; the discrepancy of ``ece`` is ``discrepancy`` (default abs);
# * ``rank/sub_<k>/<d>`` and ``rank/top_<k>/<d>`` for each d of ``divergences`` (the run's default: kl, jeff,
#   appendix E's KL and Jeffreys divergences): the same binned quantity with discrepancy d, from the same bins
#   (:mod:`~rewarduq_exp.metrics.ranking.rankwise` says which reading of the paper's lost equations this is);
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
                       full_rank_estimator: str = "kernel", seed: int = 0, divergences=()) -> RankingEvaluation:
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
    Events and classes are listed in lexicographic order: from m = 8 on ``aggregate="most_confident"`` with tied
    masses and simplex binning of restricted problems can differ from the reference, which lists observed ones in
    Python set order (see :mod:`~rewarduq_exp.metrics.ranking.events`).
    ``divergences``: further discrepancies of every rank-wise sub-k / top-k key (``rank/<kind>_<k>/<d>``), from the
    bins of its ECE (a list of names of :data:`DISCREPANCIES`; an unknown one is a one-line UserError).
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
    divergences = check_divergences(divergences)
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
    opts = dict(n_bins=n_bins, discrepancy=discrepancy, spacing=spacing, aggregate=aggregate, also=divergences)
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
        out.update({f"rank/sub_{k}/{name}": value for name, value in res_k.also.items()})
        out[f"rank/sub_{k}/n_events"] = float(len(tuples))
        if full_rank and full_rank_metric("sub", k, lambda: full_rank_sub_k_ece(
                kernel_ranks, on_kernel_rows(eval_dist.sub_k), k, subsets=subsets, **full_opts)):
            out[f"rank/full/sub_{k}/n_subsets"] = float(len(subsets))
    for k in ks_top:
        tuples = top_k_events(true_ranks, k, events=events)
        res_k = rankwise[f"top_{k}"] = rankwise_ece("top", eval_ranks, eval_dist.top_k, tuples, **opts)
        out[f"rank/top_{k}/ece"] = res_k.ece
        out.update({f"rank/top_{k}/{name}": value for name, value in res_k.also.items()})
        out[f"rank/top_{k}/n_events"] = float(len(tuples))
        if full_rank:
            fr = full_rank_metric("top", k, lambda: full_rank_top_k_ece(
                kernel_ranks, on_kernel_rows(eval_dist.top_k), k, **full_opts))
            if fr is not None:
                out[f"rank/full/top_{k}/n_classes"] = float(fr.n_classes[0])
    return RankingEvaluation(metrics=out, rankwise=rankwise, full_rank=full, skipped=skipped)


def check_divergences(divergences) -> tuple[str, ...]:
    """The further discrepancies as a tuple of distinct names of ``DISCREPANCIES`` (None or empty: none)."""
    if divergences is None:
        return ()
    if isinstance(divergences, str):
        divergences = [divergences]
    try:
        names = [str(d) for d in divergences]
    except TypeError:
        raise UserError(f"divergences must be a list of {' | '.join(DISCREPANCIES)}, got {divergences!r}") from None
    for name in names:
        check_choice("divergences", name, DISCREPANCIES)
    return tuple(dict.fromkeys(names))


def ranking_metrics(dist: RankingDistribution, true_ranks: np.ndarray, ks_sub=None, ks_top=None, n_bins: int = 10,
                    discrepancy: str = "abs", kernel_h: float = 1.0, kernel_p: float = 1,
                    max_subsets: int | None = DEFAULT_MAX_SUBSETS, seed: int = 0, *, spacing: str = "linear",
                    aggregate: str = "uniform", full_rank: bool = True, max_k: int = DEFAULT_MAX_K,
                    events: str = "auto", kernel_max_samples: int | None = DEFAULT_KERNEL_MAX_SAMPLES,
                    restrict: str = "none", full_rank_estimator: str = "kernel", divergences=()) -> dict[str, float]:
    """The flat ``rank/...`` metric dict of :func:`ranking_evaluation` (same arguments)."""
    return ranking_evaluation(dist, true_ranks, ks_sub=ks_sub, ks_top=ks_top, n_bins=n_bins,
                              discrepancy=discrepancy, spacing=spacing, aggregate=aggregate, kernel_h=kernel_h,
                              kernel_p=kernel_p, full_rank=full_rank, max_k=max_k, max_subsets=max_subsets,
                              events=events, kernel_max_samples=kernel_max_samples, restrict=restrict,
                              full_rank_estimator=full_rank_estimator, seed=seed,
                              divergences=divergences).metrics
