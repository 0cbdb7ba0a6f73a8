"""Plackett-Luce ranking distributions with closed-form marginals (no enumeration of rankings).

Per sample s the model has positive weights w_s (given as log-weights, any scale: only ratios matter). The Luce choice
axiom gives every marginal in closed form:

* sub-k (a1 > ... > ak, other items anywhere): the PL model restricted to the tuple's items,
  ``prod_t w_{a_t} / sum_{u >= t} w_{a_u}``;
* top-k (the first k positions are a1..ak): ``prod_{t <= k} w_{a_t} / (W - sum_{u < t} w_{a_u})`` with W the total
  weight;
* pairwise: ``P(i > j) = w_i / (w_i + w_j) = sigmoid(log w_i - log w_j)``.

Numerics: log-weights are normalised per sample (weights sum to 1). Sub-k products are evaluated in linear space with
the weights rescaled by the tuple's largest one (all sums are of positive terms, so exact to rounding), and in log
space (running log-sum-exps over suffixes) for the entries where a rescaled weight would underflow. Top-k
denominators are 1 - S for the normalised prefix mass S, recomputed exactly as a log-sum-exp over the items outside
the prefix wherever the prefix holds nearly all the weight (there 1 - S would cancel). Events are processed in chunks
so that memory stays bounded for large event sets (e.g. all 15,600 top-3 events of m = 26 items).

This module also holds the small helpers that the other distributions of this package share (tuple validation and
event chunking).
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit, logsumexp

from rewarduq_exp.ranking.distribution import RankingDistribution, true_orderings
from rewarduq_exp.ranking.permutations import orderings_to_ranks

# Work arrays of at most this many elements per chunk of events (float64: 8 bytes each, ~64 MB).
CHUNK_ELEMENTS = 8_000_000
# Where the remaining (normalised) weight of a top-k denominator is below this, 1 - S has lost too many digits:
# recompute it exactly over the items outside the prefix.
_CANCELLATION_GUARD = 1e-6
# Rescaled log-weights below this underflow towards subnormals in linear space: such sub-k entries use log space.
_UNDERFLOW_GAP = -600.0


def validate_tuples(tuples, m: int) -> np.ndarray:
    """Events as an (E, k) int64 array of distinct item ids in 0..m-1 (ValueError otherwise: a programming error)."""
    t = np.asarray(tuples)
    if t.ndim != 2:
        raise ValueError(f"events must be an (E, k) array of item ids, got shape {t.shape}")
    if t.size and not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"events must hold integer item ids, got dtype {t.dtype}")
    t = t.astype(np.int64, copy=False)
    if t.size:
        if t.min() < 0 or t.max() >= m:
            raise ValueError(f"event item ids must lie in 0..{m - 1}")
        if t.shape[1] > 1 and (np.diff(np.sort(t, axis=1), axis=1) == 0).any():
            raise ValueError("an event lists the same item twice")
    return t


def event_chunks(n_events: int, per_event: int):
    """Slices over events such that one chunk's work array has at most ``CHUNK_ELEMENTS`` elements."""
    step = max(1, CHUNK_ELEMENTS // max(1, per_event))
    for start in range(0, n_events, step):
        yield slice(start, min(start + step, n_events))


class PlackettLuce(RankingDistribution):
    """Plackett-Luce distributions, one per sample: ``log_weights`` (n, m) (or (m,) for a single sample).

    The log-weights are normalised per row (log-sum-exp = 0, i.e. weights summing to 1) for storage; that changes no
    probability.
    """

    def __init__(self, log_weights):
        lw = np.asarray(log_weights, dtype=np.float64)
        if lw.ndim == 1:
            lw = lw[None, :]
        if lw.ndim != 2 or lw.shape[1] < 2:
            raise ValueError(f"log_weights must have shape (n, m) with m >= 2, got {lw.shape}")
        if not np.isfinite(lw).all():
            raise ValueError("log_weights must be finite (a weight of exactly 0 has no PL ranking semantics)")
        self.log_weights = lw - logsumexp(lw, axis=1, keepdims=True)
        self._weights = np.exp(self.log_weights)
        self.n, self.m = lw.shape
        self.max_sub_k = self.max_top_k = self.m

    @property
    def weights(self) -> np.ndarray:
        """Normalised weights (n, m), each row summing to 1."""
        return self._weights.copy()

    # ------------------------------------------------------------------------------------------------ marginals
    def sub_k(self, tuples) -> np.ndarray:
        t = validate_tuples(tuples, self.m)
        k = t.shape[1]
        self.check_k("sub", k)
        out = np.empty((self.n, len(t)))
        for sl in event_chunks(len(t), self.n * k):
            out[:, sl] = self._sub_k_chunk(t[sl])
        return out

    def _sub_k_chunk(self, t: np.ndarray) -> np.ndarray:
        g = self.log_weights[:, t]  # (n, E, k) log-weights of the tuple's items
        # linear space, rescaled by the tuple's largest weight: sums of positive terms, no cancellation; exact to
        # rounding unless a rescaled weight underflows (a log-weight gap above ~700), where a suffix of tiny items
        # can still have order-one ratios among themselves: those entries are redone in log space
        g -= g.max(axis=-1, keepdims=True)
        w = np.exp(g)
        suffix = np.cumsum(w[..., ::-1], axis=-1)[..., ::-1]
        with np.errstate(divide="ignore", invalid="ignore"):
            p = np.prod(w / suffix, axis=-1)
        bad = (g < _UNDERFLOW_GAP).any(axis=-1)
        if bad.any():
            gb = g[bad]  # (F, k)
            suffix_log = np.logaddexp.accumulate(gb[:, ::-1], axis=-1)[:, ::-1]
            p[bad] = np.exp((gb - suffix_log).sum(axis=-1))
        return p

    def top_k(self, tuples) -> np.ndarray:
        t = validate_tuples(tuples, self.m)
        k = t.shape[1]
        self.check_k("top", k)
        out = np.empty((self.n, len(t)))
        for sl in event_chunks(len(t), self.n * k):
            out[:, sl] = self._top_k_chunk(t[sl])
        return out

    def _top_k_chunk(self, t: np.ndarray) -> np.ndarray:
        # weights are normalised (W = 1): P = prod_t w_{a_t} / (1 - S_t), S_t = sum_{u < t} w_{a_u}
        w = self._weights[:, t]  # (n, E, k)
        before = np.cumsum(w, axis=-1)
        before[..., 1:] = before[..., :-1]
        before[..., 0] = 0.0
        remaining = 1.0 - before
        # where the prefix holds nearly all the weight, 1 - S has lost its digits: redo those entries in log space
        # with the remaining weight as an exact log-sum-exp over the items outside the prefix
        bad = (remaining < _CANCELLATION_GUARD).any(axis=-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            p = np.prod(w / remaining, axis=-1)
        if bad.any():
            s_idx, e_idx = np.nonzero(bad)
            p[s_idx, e_idx] = np.exp(self._top_k_log_exact(s_idx, t[e_idx]))
        return p

    def _top_k_log_exact(self, s_idx: np.ndarray, prefix: np.ndarray) -> np.ndarray:
        """log P(prefix) for F (sample, prefix) pairs, every denominator an exact log-sum-exp: (F,), (F, k) -> (F,)."""
        f, k = prefix.shape
        rows = self.log_weights[s_idx].copy()  # (F, m)
        total = np.zeros(f)
        for pos in range(k):
            total += rows[np.arange(f), prefix[:, pos]] - logsumexp(rows, axis=1)
            rows[np.arange(f), prefix[:, pos]] = -np.inf  # chosen: out of every later denominator
        return total

    def pairwise(self) -> np.ndarray:
        lw = self.log_weights
        p = expit(lw[:, :, None] - lw[:, None, :])
        idx = np.arange(self.m)
        p[:, idx, idx] = 0.0
        return p

    def log_prob(self, orderings) -> np.ndarray:
        """Log-probabilities of full rankings: ``orderings`` (R, m) best first -> (n, R)."""
        t = validate_tuples(orderings, self.m)
        if t.shape[1] != self.m:
            raise ValueError(f"full rankings need all {self.m} items, got {t.shape[1]}")
        out = np.empty((self.n, len(t)))
        for sl in event_chunks(len(t), self.n * self.m):
            g = self.log_weights[:, t[sl]]
            suffix = np.logaddexp.accumulate(g[..., ::-1], axis=-1)[..., ::-1]
            out[:, sl] = (g - suffix).sum(axis=-1)
        return out

    # ------------------------------------------------------------------------------------------------ temperature
    def _temper(self, t: float) -> PlackettLuce:
        """Log-weights / T (utilities / T): T > 1 flattens every choice, T < 1 sharpens it."""
        return PlackettLuce(self.log_weights / t)

    def log_likelihood(self, true_ranks) -> np.ndarray:
        """log P(true ranking) per sample: sum_t [g_t - log sum_{u >= t} exp(g_u)], g the log-weights in the true
        order: (n,)."""
        order = true_orderings(true_ranks, self.n, self.m)
        return _ordered_log_likelihood(np.take_along_axis(self.log_weights, order, axis=1))

    def temperature_nll(self, true_ranks):
        # log P_T(pi) = sum_t [g_t / T - lse(g_{t:} / T)]: the per-row normalisation of log-weights / T cancels
        g = np.take_along_axis(self.log_weights, true_orderings(true_ranks, self.n, self.m), axis=1)

        def nll(t: float) -> float:
            return -float(np.mean(_ordered_log_likelihood(g / t)))
        return nll

    # ------------------------------------------------------------------------------------------------ point, sampling
    def mode_ranks(self) -> np.ndarray:
        """The most probable ranking: items sorted by weight (ties: lower item id first)."""
        if self._fixed_mode is not None:
            return self._fixed_mode.copy()
        order = np.argsort(-self.log_weights, axis=1, kind="stable")
        return orderings_to_ranks(order)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` rankings per sample by the Gumbel trick: orderings (n, size, m), best first."""
        gumbel = rng.gumbel(size=(self.n, size, self.m))
        return np.argsort(-(self.log_weights[:, None, :] + gumbel), axis=-1, kind="stable")


def _ordered_log_likelihood(g: np.ndarray) -> np.ndarray:
    """PL log-likelihood of each row's ordering from its log-weights in that order, (n, m) -> (n,)."""
    suffix = np.logaddexp.accumulate(g[:, ::-1], axis=1)[:, ::-1]
    return (g - suffix).sum(axis=1)
