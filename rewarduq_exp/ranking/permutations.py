"""Rankings as arrays: the two encodings and enumeration of events.

* ranks-per-item ("ranks"): int array (n, m); ``ranks[s, j]`` is the rank (1 = best) of item j (0-based item ids
  here, 1-based ranks as in the CSVs).
* ordering: int array (n, m); ``order[s, t]`` is the 0-based id of the item at position t (t = 0 is the best).

Everything is 0-based item ids inside the package; the CSVs' 1-based ranks are converted once by the loader.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from rewarduq_exp.core.errors import UserError


def ranks_to_orderings(ranks: np.ndarray) -> np.ndarray:
    """(n, m) ranks (1 = best) -> (n, m) orderings of 0-based items, best first."""
    return np.argsort(np.asarray(ranks), axis=-1, kind="stable")


def orderings_to_ranks(orderings: np.ndarray) -> np.ndarray:
    """(n, m) orderings (best first) -> (n, m) ranks, 1 = best (the inverse permutation, plus one)."""
    orderings = np.asarray(orderings)
    ranks = np.empty_like(orderings)
    np.put_along_axis(ranks, orderings, np.arange(1, orderings.shape[-1] + 1), axis=-1)
    return ranks


def check_rankings(ranks: np.ndarray, what: str = "label columns") -> np.ndarray:
    """Raise a one-line UserError unless every row of ``ranks`` is a permutation of 1..m."""
    ranks = np.asarray(ranks)
    if ranks.ndim != 2 or ranks.shape[1] < 2:
        raise UserError(f"{what}: need at least 2 items per ranking, got shape {ranks.shape}")
    m = ranks.shape[1]
    ok = (np.sort(ranks, axis=1) == np.arange(1, m + 1)).all(axis=1)
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise UserError(
            f"{what}: row {bad} is {ranks[bad].tolist()}, not a permutation of 1..{m} "
            f"(each row must give every item a distinct rank 1 = best .. {m}; ties are not supported)"
        )
    return ranks.astype(np.int64)


def all_orderings(m: int) -> np.ndarray:
    """All m! orderings in lexicographic order, shape (m!, m). Only for small m (exact enumeration)."""
    if m > 9:
        raise UserError(f"exact enumeration of all rankings needs m <= 9 items, got m={m} "
                        f"({math.factorial(m)} rankings)")
    return np.array(list(itertools.permutations(range(m))), dtype=np.int64).reshape(-1, m)


def ordered_tuples(m: int, k: int) -> np.ndarray:
    """All m!/(m-k)! ordered k-tuples of distinct items, shape (P(m,k), k), lexicographic."""
    if not 1 <= k <= m:
        raise UserError(f"k must be between 1 and the number of items m={m}, got k={k}")
    return np.array(list(itertools.permutations(range(m), k)), dtype=np.int64).reshape(-1, k)


def subsets(m: int, k: int) -> np.ndarray:
    """All C(m,k) unordered k-subsets as sorted tuples, shape (C(m,k), k)."""
    if not 1 <= k <= m:
        raise UserError(f"k must be between 1 and the number of items m={m}, got k={k}")
    return np.array(list(itertools.combinations(range(m), k)), dtype=np.int64).reshape(-1, k)


def sub_k_labels(ranks: np.ndarray, tuples: np.ndarray) -> np.ndarray:
    """1 where the true ranking orders tuple items a1 > a2 > ... > ak (others anywhere): (n, m), (E, k) -> (n, E)."""
    r = np.asarray(ranks)[:, np.asarray(tuples)]  # (n, E, k) ranks of the tuple's items
    return (np.diff(r, axis=-1) > 0).all(axis=-1)


def top_k_labels(ranks: np.ndarray, tuples: np.ndarray) -> np.ndarray:
    """1 where the true ranking's first k positions are exactly a1..ak in that order: -> (n, E)."""
    tuples = np.asarray(tuples)
    r = np.asarray(ranks)[:, tuples]  # (n, E, k)
    return (r == np.arange(1, tuples.shape[1] + 1)).all(axis=-1)


def induced_orderings(ranks: np.ndarray, subset: np.ndarray) -> np.ndarray:
    """The ordering each true ranking induces on ``subset`` (k items): (n, k) item ids, best first."""
    subset = np.asarray(subset)
    r = np.asarray(ranks)[:, subset]
    return subset[np.argsort(r, axis=1, kind="stable")]


def kendall_distance(orderings_a: np.ndarray, orderings_b: np.ndarray) -> np.ndarray:
    """Number of discordant item pairs between rankings, vectorised: broadcastable (..., m) orderings -> (...)."""
    ra = orderings_to_ranks(np.asarray(orderings_a))
    rb = orderings_to_ranks(np.asarray(orderings_b))
    da = np.sign(ra[..., :, None] - ra[..., None, :])
    db = np.sign(rb[..., :, None] - rb[..., None, :])
    return ((da * db) < 0).sum(axis=(-2, -1)) // 2
