"""RPC's distribution: pairwise preference probabilities only (no distribution over full rankings).

``PairwiseOnly(P)`` holds P[s, i, j] = P(i > j) for each sample. Its sub-2 marginals read the matrix (sub-1 events are
certain); it has no top-k marginals and no sub-k marginals for k >= 3, and asking for them is a one-line UserError
(``check_k``), as the paper notes that RPC's calibration can only be investigated for sub-2. The point prediction is
Borda: items sorted by sum_j P(i > j), ties broken by the lower item id.

Temperature: P_T(i > j) = sigmoid(logit P(i > j) / T), the pairwise classifiers' logits divided by T (Platt scaling's
slope). Its likelihood is that of the pairwise events, the Bernoulli log-likelihood of every pair of the true
ranking (the pairs are not independent, so it is a composite likelihood; RPC models nothing else).
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit, log_expit, logit

from rewarduq_exp.ranking.distribution import RankingDistribution, true_orderings
from rewarduq_exp.ranking.permutations import orderings_to_ranks
from rewarduq_exp.ranking.plackett_luce import validate_tuples


class PairwiseOnly(RankingDistribution):
    """Pairwise probabilities ``P`` (n, m, m) with P[s,i,j] + P[s,j,i] = 1 off the diagonal (diagonal ignored)."""

    def __init__(self, P, atol: float = 1e-6):
        P = np.array(P, dtype=np.float64)
        if P.ndim == 2:
            P = P[None]
        if P.ndim != 3 or P.shape[1] != P.shape[2] or P.shape[1] < 2:
            raise ValueError(f"P must have shape (n, m, m) with m >= 2, got {P.shape}")
        self.n, self.m = P.shape[0], P.shape[1]
        idx = np.arange(self.m)
        P[:, idx, idx] = 0.0
        off = ~np.eye(self.m, dtype=bool)
        if not np.isfinite(P).all() or (P < -atol).any() or (P > 1 + atol).any():
            raise ValueError("pairwise probabilities must lie in [0, 1]")
        if (np.abs(P + P.transpose(0, 2, 1) - 1.0)[:, off] > atol).any():
            raise ValueError("pairwise probabilities must be complementary: P[i, j] + P[j, i] = 1")
        self.P = np.clip(P, 0.0, 1.0)
        self.max_sub_k, self.max_top_k = 2, 0

    def sub_k(self, tuples) -> np.ndarray:
        t = validate_tuples(tuples, self.m)
        self.check_k("sub", t.shape[1])
        if t.shape[1] == 1:
            return np.ones((self.n, len(t)))
        return self.P[:, t[:, 0], t[:, 1]]

    def top_k(self, tuples) -> np.ndarray:
        t = validate_tuples(tuples, self.m)
        self.check_k("top", t.shape[1])  # always raises: there are no top-k marginals
        raise AssertionError("unreachable")

    def pairwise(self) -> np.ndarray:
        return self.P.copy()

    def borda_scores(self) -> np.ndarray:
        """sum_j P(i > j): (n, m)."""
        return self.P.sum(axis=2)

    # ------------------------------------------------------------------------------------------------ temperature
    def _pair_logits(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(i, j) for i < j and the logits of P(i > j), (n, m(m-1)/2) (+-inf where P is 0 or 1)."""
        i, j = np.triu_indices(self.m, k=1)
        with np.errstate(divide="ignore"):
            return i, j, logit(self.P[:, i, j])

    def _temper(self, t: float) -> PairwiseOnly:
        i, j, z = self._pair_logits()
        p = expit(z / t)
        P = np.zeros_like(self.P)
        P[:, i, j], P[:, j, i] = p, 1.0 - p
        return PairwiseOnly(P)

    def log_likelihood(self, true_ranks) -> np.ndarray:
        """Pairwise log-likelihood per sample: sum over pairs i < j of log P(the true order of i and j): (n,)."""
        return self.temperature_log_likelihood(true_ranks)(1.0)

    def temperature_log_likelihood(self, true_ranks):
        """T -> per-sample pairwise log-likelihood (n,) under temperature T, all pairs at once."""
        r = orderings_to_ranks(true_orderings(true_ranks, self.n, self.m))
        i, j, z = self._pair_logits()
        sign = np.where(r[:, i] < r[:, j], 1.0, -1.0)  # +1 where i is truly before j
        signed = sign * z

        def loglik(t: float) -> np.ndarray:
            return log_expit(signed / t).sum(axis=1)
        return loglik

    def temperature_nll(self, true_ranks):
        loglik = self.temperature_log_likelihood(true_ranks)
        return lambda t: -float(np.mean(loglik(t)))

    def mode_ranks(self) -> np.ndarray:
        if self._fixed_mode is not None:
            return self._fixed_mode.copy()
        order = np.argsort(-self.borda_scores(), axis=1, kind="stable")
        return orderings_to_ranks(order)
