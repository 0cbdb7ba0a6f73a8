"""Full-rank sub-k and top-k calibration (Definitions 4 and 5): one multiclass problem per unordered k-subset
(classes = its orderings) or one over the top-k prefixes, scored with the Dirichlet kernel
(:mod:`~rewarduq_exp.metrics.ranking.kernel`) or by simplex binning (2 or 3 classes only).

Classes are listed in lexicographic order; simplex binning bins the first two of them, so from m = 8 on, where the
reference code lists observed classes in Python set order, a restricted problem can bin differently (see "Order of
events and classes" in :mod:`~rewarduq_exp.metrics.ranking.events`). The kernel estimate does not depend on the
order of the classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rewarduq_exp.core.checks import check_choice
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics.ranking.binary_ece import BIN_DECIMALS
from rewarduq_exp.metrics.ranking.events import (
    _CHUNK_ELEMENTS,
    _MAX_EVENTS_PER_CALL,
    Marginals,
    _all_subsets,
    _marginals,
    _restricted,
    all_prefixes,
    check_k,
    check_true_ranks,
    observed_prefixes,
    observed_sub_orderings,
)
from rewarduq_exp.metrics.ranking.kernel import check_kernel_args, dirichlet_kernel_ece
from rewarduq_exp.ranking.permutations import all_orderings, induced_orderings, ranks_to_orderings

# Full-rank estimators: the Dirichlet kernel (appendix E) or simplex binning (2 or 3 classes only, step 1/10).
FULL_RANK_ESTIMATORS = ("kernel", "binning")
SIMPLEX_BINS = 10


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

    Classes: all k! orderings of the subset in itertools order of the sorted subset (lexicographic, the reference's
    order); restricted (m >= 8 under ``events="auto"``): the orderings observed in the test labels in lexicographic
    order (the reference: Python set order) plus an "other" class with the remaining mass when fewer than k! are
    observed. Label = the ordering the true ranking induces on the subset;
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
    prefixes (of ``class_ranks``, default ``true_ranks``; lexicographic, where the reference uses Python set order)
    plus an "other" class (unless ``other_class=False``) when restricted; label = the true prefix; vector = top-k
    marginals."""
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
# Simplex binning (the reference's other estimator; 2 or 3 classes)
# ---------------------------------------------------------------------------------------------------------------


class BinningUndefined(UserError):
    """Simplex binning asked for a problem with other than 2 or 3 classes."""


def simplex_bins(probs, *, n_bins: int = SIMPLEX_BINS) -> np.ndarray:
    """The simplex bin of each predicted vector (n, K), K = 2 or 3, as one integer per row.

    Step 1 / n_bins. K = 2: the bin of p_1, floor(n_bins * p_1) capped at n_bins - 1 (the last bin holds 1.0).
    K = 3: the pair (i, j) = (floor(n_bins * p_1), floor(n_bins * p_2)), each capped at n_bins; when i + j exceeds
    n_bins (possible only when p_1 + p_2 rounds above 1) the index of the larger coordinate (p_1 on a tie) is lowered
    to make i + j = n_bins. That gives the (n_bins + 1)(n_bins + 2) / 2 = 66 triangular bins of the reference code
    (only p_1 and p_2 are binned; p_3 is not looked at). The bins therefore depend on the order of the classes:
    the problems here list them lexicographically, as the reference does for m < 8 but not from m = 8 on (see the
    module docstring).

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
