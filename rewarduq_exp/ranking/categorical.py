"""RankClassifier's distribution: a categorical over the C observed rankings plus a uniform remainder.

Paper, appendix C: the classifier learns logits only for the rankings observed in training; "all remaining rankings"
share the rest of the mass uniformly, implemented by modifying the softmax normalisation to account for additional
logits sharing a constant value. Here the m! - C unseen rankings are represented by ONE logit for their *total* mass,
``rest_logit`` (per sample, on the scale of the seen logits):

    P(seen c)          = exp(z_c) / (sum_c' exp(z_c') + exp(z_rest))
    P(an unseen pi)    = exp(z_rest) / (sum_c' exp(z_c') + exp(z_rest)) / (m! - C)

which is the paper's construction with the shared per-ranking logit z_rest - log(m! - C). Parametrising the total
rather than the per-ranking logit is what avoids the reference code's pathology: there a fixed per-ranking logit of
-20 is multiplied by m! - C, so for m = 15 the unseen rankings hold almost all the mass (ln-mass -20 + ln 1.3e12 =
+7.9) and the trained (seen-only) and evaluated distributions differ. How the learner sets ``rest_logit`` is its
choice (``from_unseen_mass`` builds the distribution from a total unseen probability directly).

Marginals without enumeration: an event E (sub-k or top-k) contains N_E rankings in all, N_E = m!/k! (sub-k) or
(m-k)! (top-k), of which n_E are observed, so

    P(E) = sum_{observed c in E} P(c) + P(unseen total) * (N_E - n_E) / (m! - C),

with the ratio computed exactly in integer arithmetic (m! is ~4e26 for m = 26) and the observed part as a sparse
(C x E) membership matrix times the (n x C) probabilities (dense chunks for sub-k, where each observed ranking
is in a 1/k! share of the events; sparse for top-k, where it is in at most one).

Temperature: every logit divided by T. Built ``from_unseen_mass`` (RankClassifier's construction: the unseen mass u
is a constant, not a logit), the seen rankings share 1 - u by softmax(logits / T) and u stays; built from a
``rest_logit``, each unseen ranking's own logit z_rest - log(m! - C) is divided by T as the seen ones are (the
paper's construction, one shared logit per unseen ranking). The distribution keeps its logits for this (an (n, C)
array beside the probabilities).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from scipy import sparse
from scipy.special import logsumexp

from rewarduq_exp.ranking.distribution import RankingDistribution, row_index, true_orderings
from rewarduq_exp.ranking.permutations import orderings_to_ranks
from rewarduq_exp.ranking.plackett_luce import event_chunks, validate_tuples


class RankCategorical(RankingDistribution):
    """Categorical over observed ``orderings`` (C, m) with ``logits`` (n, C), plus ``rest_logit`` (scalar or (n,))
    for the total mass of the m! - C unseen rankings (-inf: none; forced to -inf when C = m!)."""

    def __init__(self, orderings, logits, rest_logit=-np.inf):
        logits = self._setup(orderings, logits)
        rest = np.broadcast_to(np.asarray(rest_logit, dtype=np.float64), (self.n,)).copy()
        if self.n_unseen == 0:
            rest[:] = -np.inf
        self._logits, self._rest_logit, self._fixed_unseen = logits, rest, None
        top = np.maximum(logits.max(axis=1, initial=-np.inf), rest)
        top = np.where(np.isfinite(top), top, 0.0)
        probs = np.exp(logits - top[:, None])  # (n, C), the one large temporary
        rest_e = np.exp(rest - top)
        norm = probs.sum(axis=1) + rest_e
        probs /= norm[:, None]
        self.seen_probs = probs
        self.unseen_mass = rest_e / norm  # (n,) total over all unseen rankings

    def _setup(self, orderings, logits) -> np.ndarray:
        orderings = np.asarray(orderings, dtype=np.int64)
        logits = np.asarray(logits, dtype=np.float64)
        if logits.ndim == 1:
            logits = logits[None, :]
        if orderings.ndim != 2 or orderings.shape[1] < 2:
            raise ValueError(f"orderings must have shape (C, m) with m >= 2, got {orderings.shape}")
        c, m = orderings.shape
        if logits.ndim != 2 or logits.shape[1] != c:
            raise ValueError(f"logits must have shape (n, {c}), got {logits.shape}")
        if not (np.sort(orderings, axis=1) == np.arange(m)).all():
            raise ValueError("every observed ordering must be a permutation of 0..m-1")
        if len(np.unique(orderings, axis=0)) != c:
            raise ValueError("the observed orderings must be distinct")
        self.orderings = orderings
        self.n, self.m = logits.shape[0], m
        self.max_sub_k = self.max_top_k = m
        self.n_rankings = math.factorial(m)  # exact Python int
        self.n_unseen = self.n_rankings - c
        self._ranks = orderings_to_ranks(orderings)
        self._ranks_small = self._ranks.astype(np.int8 if m < 128 else np.int16)
        return logits

    @classmethod
    def from_unseen_mass(cls, orderings, logits, unseen_mass) -> RankCategorical:
        """The seen rankings share 1 - unseen_mass in proportion to softmax(logits); unseen_mass in [0, 1) (per
        sample or one value; ignored when every ranking is observed)."""
        self = cls.__new__(cls)
        logits = self._setup(orderings, logits)
        u = np.broadcast_to(np.asarray(unseen_mass, dtype=np.float64), (self.n,)).copy()
        if ((u < 0) | (u >= 1)).any():
            raise ValueError("unseen_mass must lie in [0, 1)")
        if self.n_unseen == 0:
            u[:] = 0.0
        self._logits, self._rest_logit, self._fixed_unseen = logits, None, u
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs *= ((1.0 - u) / probs.sum(axis=1))[:, None]
        self.seen_probs, self.unseen_mass = probs, u
        return self

    @property
    def unseen_probability(self) -> np.ndarray:
        """The probability of each single unseen ranking (n,) (0 when every ranking is observed)."""
        if self.n_unseen == 0:
            return np.zeros(self.n)
        return self.unseen_mass * float(Fraction(1, self.n_unseen))

    # ------------------------------------------------------------------------------------------------ marginals
    def sub_k(self, tuples) -> np.ndarray:
        t = validate_tuples(tuples, self.m)
        k = t.shape[1]
        self.check_k("sub", k)
        # each observed ranking lies in a 1/k! share of the sub-k events: dense (BLAS) products of the (n x C)
        # probabilities with chunks of the membership matrix beat sparse ones here
        seen = np.empty((self.n, len(t)))
        n_obs = np.empty(len(t), dtype=np.int64)
        c = len(self.orderings)
        for sl in event_chunks(len(t), c * k):
            r = self._ranks_small[:, t[sl]]  # (C, Ec, k)
            member = (np.diff(r, axis=-1) > 0).all(axis=-1)  # (C, Ec)
            n_obs[sl] = member.sum(axis=0)
            seen[:, sl] = self.seen_probs @ member.astype(np.float64)
        return self._add_unseen(seen, n_obs, self.n_rankings // math.factorial(k))

    def top_k(self, tuples) -> np.ndarray:
        t = validate_tuples(tuples, self.m)
        k = t.shape[1]
        self.check_k("top", k)
        # match the observed prefixes with the events: ids of the distinct rows of both, then equal ids
        both = np.concatenate([t, self.orderings[:, :k]])
        _, inverse = np.unique(both, axis=0, return_inverse=True)
        inverse = inverse.ravel()
        ev, ob = inverse[: len(t)], inverse[len(t):]
        order = np.argsort(ev, kind="stable")
        lo = np.searchsorted(ev[order], ob, side="left")
        counts = np.searchsorted(ev[order], ob, side="right") - lo
        rows = np.repeat(np.arange(len(ob)), counts)
        starts = np.repeat(lo - (np.cumsum(counts) - counts), counts)
        cols = order[starts + np.arange(counts.sum())] if counts.sum() else np.zeros(0, dtype=np.int64)
        # each observed ranking lies in at most one top-k event: a sparse (E x C) membership matrix
        member = sparse.csr_matrix((np.ones(len(rows)), (cols, rows)), shape=(len(t), len(self.orderings)))
        seen = np.asarray(member @ self.seen_probs.T).T  # (n, E)
        n_obs = np.asarray(member.sum(axis=1)).ravel().astype(np.int64)
        return self._add_unseen(seen, n_obs, math.factorial(self.m - k))

    def _add_unseen(self, seen: np.ndarray, n_obs: np.ndarray, n_in_event: int) -> np.ndarray:
        """Add the unseen rankings' share: unseen mass * (N_E - n_E) / (m! - C), the ratio exact from integers."""
        if self.n_unseen == 0:
            return seen
        values, inverse = np.unique(n_obs, return_inverse=True)
        ratio = np.array([float(Fraction(n_in_event - int(v), self.n_unseen)) for v in values])[inverse.ravel()]
        return seen + self.unseen_mass[:, None] * ratio[None, :]

    # ------------------------------------------------------------------------------------------------ temperature
    def _temper(self, t: float) -> RankCategorical:
        if self._fixed_unseen is not None:
            return RankCategorical.from_unseen_mass(self.orderings, self._logits / t, self._fixed_unseen)
        # total rest logit = per-ranking logit + log(m! - C); the per-ranking logit is what T divides
        log_n = math.log(self.n_unseen) if self.n_unseen else 0.0
        return RankCategorical(self.orderings, self._logits / t, (self._rest_logit - log_n) / t + log_n)

    def class_index(self, true_ranks) -> np.ndarray:
        """For each sample its true ranking's index among the observed orderings, -1 where it is unseen: (n,)."""
        return row_index(self.orderings, true_orderings(true_ranks, self.n, self.m))

    def log_likelihood(self, true_ranks) -> np.ndarray:
        """log P(true ranking) per sample: the seen class's probability, or one unseen ranking's share: (n,)."""
        c = self.class_index(true_ranks)
        seen = self.seen_probs[np.arange(self.n), np.maximum(c, 0)]
        with np.errstate(divide="ignore"):
            return np.log(np.where(c >= 0, seen, self.unseen_probability))

    def temperature_nll(self, true_ranks):
        if self._fixed_unseen is None:
            return super().temperature_nll(true_ranks)
        # seen rows: log(1 - u) + z_c / T - lse(z / T); unseen rows: log(u / (m! - C)), the same for every T
        c = self.class_index(true_ranks)
        seen = np.flatnonzero(c >= 0)
        z = self._logits[seen]
        picked = z[np.arange(len(seen)), c[seen]]
        with np.errstate(divide="ignore"):
            const = (np.log1p(-self._fixed_unseen[seen]).sum()
                     + np.log(self.unseen_probability[c < 0]).sum())
        n = self.n

        def nll(t: float) -> float:
            return -float((const + (picked / t - logsumexp(z / t, axis=1)).sum()) / n)
        return nll

    # ------------------------------------------------------------------------------------------------ point
    def mode_ranks(self) -> np.ndarray:
        """The most probable observed ranking (the unseen rankings share their mass uniformly, so none of them is a
        meaningful point prediction; each has less probability than any seen one unless the seen logits are tiny)."""
        if self._fixed_mode is not None:
            return self._fixed_mode.copy()
        return self._ranks[np.argmax(self.seen_probs, axis=1)]
