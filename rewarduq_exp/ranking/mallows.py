"""Mallows distributions (Kendall distance) with closed-form top-k and pairwise marginals.

``P(pi) = phi^{d_K(pi, pi0)} / Z_m(phi)`` with ``phi = exp(-theta)`` and ``Z_j(phi) = prod_{i=1..j} [i]_phi``,
``[i]_phi = 1 + phi + ... + phi^{i-1} = (1 - phi^i) / (1 - phi)`` (the generating function of inversions). The model
is unconditional (the same distribution for each of the n samples), as in the paper's experiments.

Relabel the items by their position in the center, b(a) = position of item a in pi0; then d_K(pi, pi0) is the number
of inversions of the sequence b(pi_1), ..., b(pi_m).

Top-k, derived here (and checked against enumeration in the tests): fix the prefix a1..ak. The inversions of a full
ranking with that prefix split into (i) inversions inside the prefix, (ii) "cross" pairs (prefix item p, later item r)
with b(r) < b(p), which every completion has, and (iii) inversions among the m - k remaining items, whose generating
function over all (m - k)! completions is Z_{m-k}(phi). Item a_t has b(a_t) center-predecessors, of which
#{u : b(a_u) < b(a_t)} are in the prefix, so (ii) = sum_t b(a_t) - k(k-1)/2. Hence

    P(prefix) = phi^{inv(prefix) + sum_t b(a_t) - k(k-1)/2} * Z_{m-k}(phi) / Z_m(phi).

Pairwise: for items i, j with j placed d = b(j) - b(i) > 0 positions after i in the center, the probability that the
ranking reverses them depends only on d (repeated-insertion structure):

    P(j > i) = g(d) - g(d + 1),   g(n) = n / (exp(n theta) - 1),

which is 1/(1 + phi) for d = 1; near theta = 0 its Taylor expansion 1/2 - (2d+1) theta/12 + ((d+1)^4 - d^4) theta^3/720
is used instead (the exact form cancels there).

Sub-k for k >= 3 has no simple closed form: it is summed exactly over all m! rankings for m <= ``exact_max_m``
(default 7, 5,040 rankings), equals the (exact) full-ranking probability for k = m, and is otherwise a Monte-Carlo
estimate from ``mc_samples`` exact samples (repeated insertion, seeded by ``mc_seed``; the same samples for every call
of one object). ``sub_k_estimate`` returns the estimate with its binomial standard error sqrt(p(1-p)/S); after a
``sub_k`` call the errors are also in ``last_standard_error`` (zeros where the value is exact).
"""

from __future__ import annotations

import math

import numpy as np

from rewarduq_exp.ranking.distribution import RankingDistribution, true_orderings
from rewarduq_exp.ranking.permutations import all_orderings, orderings_to_ranks
from rewarduq_exp.ranking.plackett_luce import event_chunks, validate_tuples


def log_q_integer(i: np.ndarray | int, theta: float) -> np.ndarray:
    """log [i]_phi = log((1 - phi^i) / (1 - phi)) for phi = exp(-theta), i >= 1 (any real theta; log i at theta 0)."""
    i = np.asarray(i, dtype=np.float64)
    if theta == 0.0:
        return np.log(i)
    return np.log(np.abs(np.expm1(-i * theta))) - np.log(np.abs(np.expm1(-theta)))


def log_normaliser(j: int, theta: float) -> float:
    """log Z_j(phi) = sum_{i=1..j} log [i]_phi (log j! at theta = 0)."""
    if j <= 1:
        return 0.0
    return float(log_q_integer(np.arange(1, j + 1), theta).sum())


def expected_distance(theta: float, m: int) -> float:
    """E_theta[d_K(Pi, pi0)] = sum_{i=1..m} E[V_i], V_i ~ phi^v on {0..i-1} (the insertion inversions)."""
    if abs(theta) < 1e-9:
        return m * (m - 1) / 4.0
    i = np.arange(1, m + 1, dtype=np.float64)
    # E[V_i] = phi/(1-phi) - i phi^i/(1-phi^i) = 1/expm1(theta) - i/expm1(i theta) (overflow to inf gives 0)
    with np.errstate(over="ignore"):
        return float((1.0 / np.expm1(theta) - i / np.expm1(i * theta)).sum())


def reversal_probability(d: np.ndarray, theta: float) -> np.ndarray:
    """P(the ranking reverses two items that are d >= 1 positions apart in the center), vectorised over d."""
    d = np.asarray(d, dtype=np.float64)
    small = np.abs(theta) * (d + 1) < 1e-2
    taylor = 0.5 - (2 * d + 1) * theta / 12 + ((d + 1) ** 4 - d**4) * theta**3 / 720
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        exact = d / np.expm1(d * theta) - (d + 1) / np.expm1((d + 1) * theta)
    return np.clip(np.where(small, taylor, np.nan_to_num(exact)), 0.0, 1.0)


def inversions(seq: np.ndarray) -> np.ndarray:
    """Number of inversions of each row of an (..., k) integer array (pairs u < t with seq_u > seq_t)."""
    seq = np.asarray(seq)
    k = seq.shape[-1]
    upper = np.triu(np.ones((k, k), dtype=bool), 1)
    return ((seq[..., :, None] > seq[..., None, :]) & upper).sum(axis=(-2, -1))


class Mallows(RankingDistribution):
    """Mallows/Kendall distribution with modal ranking ``center`` (an ordering, best first) and dispersion ``theta``,
    the same for each of ``n`` samples.

    ``theta`` may be any real number (theta = 0 is uniform; theta < 0 favours rankings far from the center).
    """

    def __init__(self, center, theta: float, n: int = 1, *, mc_samples: int = 20000, mc_seed: int = 0,
                 exact_max_m: int = 7):
        center = np.asarray(center, dtype=np.int64)
        m = center.shape[-1] if center.ndim == 1 else -1
        if center.ndim != 1 or m < 2 or not np.array_equal(np.sort(center), np.arange(m)):
            raise ValueError(f"center must be an ordering of 0..m-1 (m >= 2), got {center.tolist()}")
        if not np.isfinite(theta):
            raise ValueError(f"theta must be finite, got {theta}")
        if exact_max_m > 9:
            raise ValueError("exact_max_m above 9 would enumerate more than 9! rankings")
        self.center = center
        self.theta = float(theta)
        self.n, self.m = int(n), m
        self.max_sub_k = self.max_top_k = m
        self.mc_samples, self.mc_seed, self.exact_max_m = int(mc_samples), int(mc_seed), int(exact_max_m)
        self.position = np.empty(m, dtype=np.int64)  # b(a): position of item a in the center
        self.position[center] = np.arange(m)
        self._log_z = np.array([log_normaliser(j, self.theta) for j in range(m + 1)])
        self._exact_probs = None  # (m!,) for m <= exact_max_m, computed on first use
        self._mc_ranks = None  # (S, m) ranks of the Monte-Carlo samples, drawn on first use
        self.last_standard_error: np.ndarray | None = None

    @property
    def phi(self) -> float:
        return math.exp(-self.theta)

    def _broadcast(self, p: np.ndarray) -> np.ndarray:
        return np.repeat(np.asarray(p, dtype=np.float64)[None, :], self.n, axis=0)

    # ------------------------------------------------------------------------------------------------ exact pieces
    def log_prob(self, orderings) -> np.ndarray:
        """Log-probabilities of full rankings ``orderings`` (R, m) -> (R,) (identical for every sample)."""
        t = validate_tuples(orderings, self.m)
        return -self.theta * inversions(self.position[t]) - self._log_z[self.m]

    def top_k(self, tuples) -> np.ndarray:
        t = validate_tuples(tuples, self.m)
        k = t.shape[1]
        self.check_k("top", k)
        b = self.position[t]  # (E, k)
        exponent = inversions(b) + b.sum(axis=1) - k * (k - 1) // 2
        return self._broadcast(np.exp(-self.theta * exponent + self._log_z[self.m - k] - self._log_z[self.m]))

    def _pair_probs(self, first: np.ndarray, second: np.ndarray) -> np.ndarray:
        d = self.position[second] - self.position[first]  # > 0: the center agrees with "first > second"
        rev = reversal_probability(np.abs(d), self.theta)
        return np.where(d > 0, 1.0 - rev, rev)

    def pairwise(self) -> np.ndarray:
        i, j = np.meshgrid(np.arange(self.m), np.arange(self.m), indexing="ij")
        p = self._pair_probs(i.ravel(), np.where(i == j, (j + 1) % self.m, j).ravel()).reshape(self.m, self.m)
        np.fill_diagonal(p, 0.0)
        return np.repeat(p[None], self.n, axis=0)

    # ------------------------------------------------------------------------------------------------ sub-k
    def sub_k(self, tuples) -> np.ndarray:
        p, se = self.sub_k_estimate(tuples)
        self.last_standard_error = se
        return self._broadcast(p)

    def sub_k_estimate(self, tuples) -> tuple[np.ndarray, np.ndarray]:
        """Sub-k marginals (E,) and their standard errors (E,): zero where exact (k <= 2, k = m, m <= exact_max_m),
        the Monte-Carlo standard error sqrt(p(1-p)/S) otherwise."""
        t = validate_tuples(tuples, self.m)
        k = t.shape[1]
        self.check_k("sub", k)
        zeros = np.zeros(len(t))
        if k == 1:
            return np.ones(len(t)), zeros
        if k == 2:
            return self._pair_probs(t[:, 0], t[:, 1]), zeros
        if k == self.m:  # a sub-m event is one full ranking
            return np.exp(self.log_prob(t)), zeros
        if self.m <= self.exact_max_m:
            if self._exact_probs is None:
                orderings = all_orderings(self.m)
                self._exact_ranks = orderings_to_ranks(orderings).astype(np.int8)
                self._exact_probs = np.exp(self.log_prob(orderings))
            return _masked_sums(self._exact_ranks, self._exact_probs, t), zeros
        if self._mc_ranks is None:
            rng = np.random.default_rng(self.mc_seed)
            self._mc_ranks = orderings_to_ranks(self.sample(rng, self.mc_samples)).astype(np.int8)
        s = len(self._mc_ranks)
        p = _masked_sums(self._mc_ranks, np.full(s, 1.0 / s), t)
        return p, np.sqrt(np.clip(p * (1 - p), 0, None) / s)

    # ------------------------------------------------------------------------------------------------ temperature
    def _temper(self, t: float) -> Mallows:
        """Dispersion theta / T (phi^(1/T)): T > 1 spreads the mass away from the center, T < 1 concentrates it."""
        return Mallows(self.center, self.theta / t, n=self.n, mc_samples=self.mc_samples, mc_seed=self.mc_seed,
                       exact_max_m=self.exact_max_m)

    def log_likelihood(self, true_ranks) -> np.ndarray:
        """log P(true ranking) = -theta d_K(pi, center) - log Z_m(theta) per sample: (n,)."""
        return self.log_prob(true_orderings(true_ranks, self.n, self.m))

    def temperature_nll(self, true_ranks):
        # the mean distance is all the data say: nll(T) = (theta / T) mean(d) + log Z_m(theta / T)
        d = float(inversions(self.position[true_orderings(true_ranks, self.n, self.m)]).mean())

        def nll(t: float) -> float:
            return self.theta / t * d + log_normaliser(self.m, self.theta / t)
        return nll

    # ------------------------------------------------------------------------------------------------ point, sampling
    def mode_ranks(self) -> np.ndarray:
        return np.repeat(orderings_to_ranks(self.center[None]), self.n, axis=0)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` exact samples by repeated insertion: orderings (size, m), best first.

        The center's items are inserted in center order; the t-th (0-based) goes V_t places before the end of the
        current list, creating V_t inversions, with P(V_t = v) proportional to phi^v on {0..t}. The V_t are
        independent and sum to the Kendall distance, which gives exactly phi^d / Z_m.
        """
        cur = np.zeros((size, self.m), dtype=np.int64)  # center positions, best first
        for t in range(self.m):
            logw = -self.theta * np.arange(t + 1)
            w = np.exp(logw - logw.max())
            cdf = np.cumsum(w) / w.sum()
            v = np.minimum(np.searchsorted(cdf, rng.random(size), side="right"), t)
            ins = (t - v)[:, None]  # insertion index in the current list of t items
            cols = np.arange(t + 1)[None, :]
            src = np.clip(cols - (cols > ins), 0, max(t - 1, 0))
            shifted = np.take_along_axis(cur[:, : max(t, 1)], src, axis=1)
            cur[:, : t + 1] = np.where(cols == ins, t, shifted)
        return self.center[cur]


def _masked_sums(ranks: np.ndarray, weights: np.ndarray, tuples: np.ndarray) -> np.ndarray:
    """sum_r weights[r] * [ranking r orders a1 > ... > ak] for each tuple: (R, m) ranks, (R,), (E, k) -> (E,)."""
    out = np.empty(len(tuples))
    for sl in event_chunks(len(tuples), len(ranks) * tuples.shape[1]):
        r = ranks[:, tuples[sl]]  # (R, Ec, k)
        mask = (np.diff(r, axis=-1) > 0).all(axis=-1)
        out[sl] = weights @ mask
    return out
