"""Events of the ranking metrics: which ordered k-tuples are evaluated (all of them, or those observed in the test
labels; appendix E), their binary labels, and the argument checks that every ranking metric shares.

Conventions (as in :mod:`rewarduq_exp.ranking.permutations`): ``true_ranks`` is an int array (n, m) of ranks per
item, 1 = best, 0-based item ids; an *event* is an ordered k-tuple of distinct items, one row of an (E, k) array.
Predicted probabilities enter through a *marginals* callable ``tuples (E, k) -> (n, E)`` (e.g.
``RankingDistribution.sub_k`` or ``.top_k``), so no metric sees a model.

Order of events and classes
---------------------------
Every list of events here, and every list of classes of a full-rank problem, is in **lexicographic order** of the
0-based tuples: ``itertools`` order where all are enumerated, ``np.unique`` order where they are observed ones.
The order changes no uniform, prevalence- or mass-weighted mean and no kernel estimate. It decides two things:
which events ``aggregate="most_confident"`` keeps when predicted masses tie across its 5th place
(:func:`~rewarduq_exp.metrics.ranking.binary_ece.aggregate_ece`), and which two classes simplex binning bins on
(p_1, p_2) in a full-rank problem (:func:`~rewarduq_exp.metrics.ranking.full_rank.simplex_bins`).

The reference code enumerates events and classes with ``itertools.permutations`` when m < 8, the same lexicographic
order, so there both give the same results. From m = 8 on it lists the *observed* events and classes by iterating a
Python ``set`` of 1-based tuples: an order that CPython's tuple hashes and set table decide (fixed for int tuples,
whatever PYTHONHASHSEED), not lexicographic and promised by no Python version. We keep the lexicographic order
everywhere: it is deterministic and does not depend on Python's set or hash internals. From m = 8 on, ``most_confident``
with tied masses and simplex binning of restricted problems (``restrict`` other than "none", whose problems have no
"other" class) can therefore differ from the reference.
Example (m = 8, top-1, ``most_confident``): true best items [0, 0, 1, 1, 2, 3, 4, 4, 5, 5, 5, 6, 7], every sample
predicting 0.5 on the ranking 0 > 1 > ... > 7 and 0.5 on 1 > 0 > 2 > ... > 7. Items 0 and 1 get mass 0.5 and ECE 1/2 -
2/13 each; items 2..7 get mass 0 and ECE = their frequency, and tie for the last 3 places. Lexicographic order keeps
items 2, 3, 4: (2 (1/2 - 2/13) + 1/13 + 1/13 + 2/13) / 5 = 1/5 = 0.2000. The reference's set order (0-based items 5, 1,
4, 7, 3, 0, 6, 2) keeps items 5, 4, 7: (1 - 4/13 + 3/13 + 2/13 + 1/13) / 5 = 3/13 = 0.2308.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from rewarduq_exp.core.checks import check_choice
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.ranking.permutations import all_orderings, check_rankings, ordered_tuples, ranks_to_orderings

Marginals = Callable[[np.ndarray], np.ndarray]

EVENT_MODES = ("auto", "all", "observed")
# From this many items on, events="auto" restricts every metric to the events observed in the test labels.
RESTRICT_FROM_M = 8
# Work arrays are cut into pieces of about this many float64 elements (32 MiB).
_CHUNK_ELEMENTS = 1 << 22
# At most this many events per call of a marginals function (an explicit distribution builds an R x E x k mask).
_MAX_EVENTS_PER_CALL = 256


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
