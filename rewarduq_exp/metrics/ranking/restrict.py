"""Appendix E's restriction to the most frequent rankings, as the reference code does it (its ``95_prob_mass`` /
``top_10``): label-dependent, and it removes predicted mass outside the selected rankings."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rewarduq_exp.core.checks import check_choice
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics.ranking.events import _MAX_EVENTS_PER_CALL, _marginals, check_true_ranks
from rewarduq_exp.ranking.distribution import ExplicitDistribution, RankingDistribution
from rewarduq_exp.ranking.permutations import orderings_to_ranks, ranks_to_orderings

# Appendix E's restriction to the most frequent test rankings (label-dependent; see restrict_to_frequent_rankings).
RESTRICTIONS = ("none", "prob_mass_95", "top_10")
PROB_MASS_SHARE = 0.95
TOP_RANKINGS = 10


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
