"""What a ranking distribution must answer: the contract between label-ranking learners and ranking metrics.

A learner's ``predict_distribution(X)`` returns one object for n samples over m items. The metrics never see the
model: they ask the object for marginals of events and compare them with the true rankings. Each implementation
computes marginals from its own structure (closed forms for Plackett-Luce, insertion structure for Mallows, ...);
only ``ExplicitDistribution`` holds probabilities of listed rankings, for small m, tests and reference cases.

Events (0-based item ids):
* sub-k event, an ordered k-tuple (a1..ak): "a1 > a2 > ... > ak in the ranking, other items anywhere";
* top-k event, an ordered k-tuple: "the first k positions are exactly a1..ak, in that order".

Temperature: ``temper(T)`` is the distribution's natural one-parameter family for post-hoc recalibration (T = 1:
the distribution itself, the same object), and ``temperature_nll(true_ranks)`` the mean negative log-likelihood of
held-out rankings as a function of T, which a calibration fold minimises. Tempering is a calibration map: it never
moves the point prediction (``mode_ranks`` of a tempered distribution is its source's, so Kendall tau and top-1
accuracy are unchanged).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.ranking.permutations import check_rankings, orderings_to_ranks, ranks_to_orderings


class RankingDistribution(ABC):
    """Distributions over rankings of ``m`` items for ``n`` samples (one distribution per sample)."""

    n: int
    m: int
    # Largest k for which sub-k / top-k marginals exist (RPC knows pairs only: max_sub_k = 2, max_top_k = 0).
    max_sub_k: int
    max_top_k: int
    # The modal ranking a tempered distribution keeps from its source (set by ``temper``; None: its own).
    _fixed_mode: np.ndarray | None = None

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

    # ------------------------------------------------------------------------------------------------ temperature
    def temper(self, temperature: float) -> RankingDistribution:
        """The distribution with temperature T > 0 (``_temper``: each model's natural parameter, see the
        implementations); T = 1 returns this very object, so it changes nothing. The tempered distribution keeps
        this one's modal ranking: for PL, RankClassifier and Mallows it is the same ranking for every T
        mathematically (only rounding could create ties), and for RPC's Borda count, which tempering the pairwise
        probabilities can reorder, recalibration is declared not to change the point prediction."""
        t = check_temperature(temperature)
        if t == 1.0:
            return self
        out = self._temper(t)
        out._fixed_mode = self.mode_ranks()
        return out

    def _temper(self, t: float) -> RankingDistribution:
        raise UserError(f"{type(self).__name__} has no temperature parameter")

    def log_likelihood(self, true_ranks) -> np.ndarray:
        """Per-sample log-likelihood of the true rankings (n, m ranks-per-item) under this distribution: (n,)."""
        raise UserError(f"{type(self).__name__} has no likelihood of rankings")

    def temperature_nll(self, true_ranks) -> Callable[[float], float]:
        """T -> mean negative log-likelihood of ``true_ranks`` under ``temper(T)`` (implementations precompute
        what does not depend on T)."""
        def nll(t: float) -> float:
            return -float(np.mean(self.temper(t).log_likelihood(true_ranks)))
        return nll

    def check_k(self, kind: str, k: int) -> None:
        limit = self.max_sub_k if kind == "sub" else self.max_top_k
        if not 1 <= k <= limit:
            raise UserError(
                f"{type(self).__name__} has {kind}-k marginals for k in 1..{limit} only, asked for k={k}"
                + (" (it models pairwise preferences only)" if limit <= 2 else "")
            )


def check_temperature(temperature) -> float:
    """A temperature as a float > 0 and finite (a one-line UserError otherwise)."""
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        t = math.nan
    if not (math.isfinite(t) and t > 0):
        raise UserError(f"temperature must be a finite number > 0, got {temperature!r}")
    return t


def true_orderings(true_ranks, n: int, m: int) -> np.ndarray:
    """The true rankings (n, m) ranks-per-item as orderings, best first (a one-line UserError on a shape mismatch)."""
    r = check_rankings(true_ranks, what="true rankings")
    if r.shape != (n, m):
        raise UserError(f"true rankings have shape {r.shape} but the distribution covers n={n} samples of m={m} items")
    return ranks_to_orderings(r)


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
        if self._fixed_mode is not None:
            return self._fixed_mode.copy()
        return self._ranks[np.argmax(self.probs, axis=1)]

    def _temper(self, t: float) -> ExplicitDistribution:
        """probs^(1/T), renormalised over the listed rankings (the categorical's temperature; mass that the list
        lacks stays lacking)."""
        with np.errstate(divide="ignore"):
            logp = np.log(self.probs) / t
        total = self.probs.sum(axis=1, keepdims=True)
        top = np.max(logp, axis=1, keepdims=True)
        w = np.exp(logp - np.where(np.isfinite(top), top, 0.0))
        s = w.sum(axis=1, keepdims=True)
        return ExplicitDistribution(self.orderings, np.where(s > 0, w / np.where(s > 0, s, 1.0) * total, 0.0))

    def log_likelihood(self, true_ranks) -> np.ndarray:
        """log P(true ranking), -inf where it is not listed."""
        order = true_orderings(true_ranks, self.n, self.m)
        idx = row_index(self.orderings, order)
        p = np.where(idx >= 0, self.probs[np.arange(self.n), np.maximum(idx, 0)], 0.0)
        with np.errstate(divide="ignore"):
            return np.log(p)


def row_index(table: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """For each row of ``rows`` (n, m) its index in ``table`` (R, m) of distinct rows, -1 where absent."""
    both = np.concatenate([table, rows])
    _, inverse = np.unique(both, axis=0, return_inverse=True)
    inverse = inverse.ravel()
    where = np.full(inverse.max(initial=-1) + 1, -1, dtype=np.int64)
    where[inverse[: len(table)]] = np.arange(len(table))
    return where[inverse[len(table):]]
