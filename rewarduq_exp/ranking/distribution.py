"""What a ranking distribution must answer: the contract between label-ranking learners and ranking metrics.

A learner's ``predict_distribution(X)`` returns one object for n samples over m items. The metrics never see the
model: they ask the object for marginals of events and compare them with the true rankings. Each implementation
computes marginals from its own structure (closed forms for Plackett-Luce, insertion structure for Mallows, ...);
only ``ExplicitDistribution`` holds probabilities of listed rankings, for small m, tests and reference cases.

Events (0-based item ids):
* sub-k event, an ordered k-tuple (a1..ak): "a1 > a2 > ... > ak in the ranking, other items anywhere";
* top-k event, an ordered k-tuple: "the first k positions are exactly a1..ak, in that order".
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.ranking.permutations import orderings_to_ranks


class RankingDistribution(ABC):
    """Distributions over rankings of ``m`` items for ``n`` samples (one distribution per sample)."""

    n: int
    m: int
    # Largest k for which sub-k / top-k marginals exist (RPC knows pairs only: max_sub_k = 2, max_top_k = 0).
    max_sub_k: int
    max_top_k: int

    @abstractmethod
    def sub_k(self, tuples: np.ndarray) -> np.ndarray:
        """P(a1 > ... > ak) for each ordered tuple: (E, k) int -> (n, E) float64."""

    @abstractmethod
    def top_k(self, tuples: np.ndarray) -> np.ndarray:
        """P(first k positions = a1..ak) for each ordered tuple: (E, k) int -> (n, E) float64."""

    @abstractmethod
    def mode_ranks(self) -> np.ndarray:
        """The point prediction as ranks-per-item (n, m), 1 = best (used for Kendall tau, footrule, top-1)."""

    def pairwise(self) -> np.ndarray:
        """P(i > j) as an (n, m, m) matrix with zero diagonal (sub-2 marginals)."""
        i, j = np.triu_indices(self.m, k=1)
        p = self.sub_k(np.stack([i, j], axis=1))
        out = np.zeros((self.n, self.m, self.m))
        out[:, i, j] = p
        out[:, j, i] = 1.0 - p
        return out

    def check_k(self, kind: str, k: int) -> None:
        limit = self.max_sub_k if kind == "sub" else self.max_top_k
        if not 1 <= k <= limit:
            raise UserError(
                f"{type(self).__name__} has {kind}-k marginals for k in 1..{limit} only, asked for k={k}"
                + (" (it models pairwise preferences only)" if limit <= 2 else "")
            )


class ExplicitDistribution(RankingDistribution):
    """Probabilities of listed rankings: ``orderings`` (R, m) best first, ``probs`` (n, R).

    Marginals are event masks times probabilities (one matmul per call). Mass not on the listed rankings is simply
    absent, so with a partial list the marginals are sums over the listed rankings only (the reference code's
    semantics); use it with all m! orderings for a proper distribution.
    """

    def __init__(self, orderings: np.ndarray, probs: np.ndarray):
        self.orderings = np.asarray(orderings, dtype=np.int64)
        self.probs = np.asarray(probs, dtype=np.float64)
        if self.probs.ndim == 1:
            self.probs = self.probs[None, :]
        if self.probs.shape[1] != len(self.orderings):
            raise ValueError(f"probs has {self.probs.shape[1]} columns for {len(self.orderings)} orderings")
        self.n, self.m = self.probs.shape[0], self.orderings.shape[1]
        self.max_sub_k = self.max_top_k = self.m
        self._ranks = orderings_to_ranks(self.orderings)  # (R, m)

    def sub_k(self, tuples: np.ndarray) -> np.ndarray:
        r = self._ranks[:, np.asarray(tuples)]  # (R, E, k)
        mask = (np.diff(r, axis=-1) > 0).all(axis=-1)  # (R, E)
        return self.probs @ mask

    def top_k(self, tuples: np.ndarray) -> np.ndarray:
        tuples = np.asarray(tuples)
        mask = (self.orderings[:, None, : tuples.shape[1]] == tuples[None]).all(axis=-1)  # (R, E)
        return self.probs @ mask

    def mode_ranks(self) -> np.ndarray:
        return self._ranks[np.argmax(self.probs, axis=1)]
