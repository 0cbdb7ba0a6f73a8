"""MM: the unconditional Mallows/Kendall learner (appendix C)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq

from rewarduq_exp.core.setting_bounds import Bound
from rewarduq_exp.methods.base import LabelRankingMethod
from rewarduq_exp.methods.label_ranking._common import check_xy
from rewarduq_exp.methods.settings import LabelRankingSettings, cast, setting
from rewarduq_exp.ranking.mallows import Mallows, expected_distance


@dataclass(kw_only=True)
class MallowsSettings(LabelRankingSettings, config="mallows"):
    """Defaults and comments: ``conf/method/mallows.yaml``."""

    max_iter: int = setting(bound=Bound(1, 10_000_000, "steps", "a local search that has not converged by then will "
                                        "not"), doc="local-search steps at most")
    theta_max: float = setting(check=cast(float), doc="upper bound of theta")
    mc_samples: int = setting(bound=Bound(1, 10_000_000, "samples", "each is a ranking held in memory; the default "
                                          "is 20,000"), doc="Monte-Carlo samples of sub-k marginals")
    exact_max_m: int = setting(bound=Bound(1, 10, "items", "exact enumeration holds all m! rankings: 10! is 3.6M, 11! "
                                           "is 40M"), doc="up to this many items, exact enumeration")


class MallowsLearner(LabelRankingMethod):
    """MM: unconditional Mallows model with Kendall distance (ignores X, as in the paper).

    * Total Kendall distance of the training rankings to a center c is sum_{t < u} N[c_u, c_t], where N[a, b] is the
      number of training rankings that put a before b: one vectorised (m x m) count matrix replaces per-ranking
      distance loops, and every neighbour of the local search costs O(m^2).
    * Center: start from the items sorted by mean rank (ties broken by a seeded random key), then move to the best
      swap of two positions (all m(m-1)/2 "Cayley" neighbours) while that strictly lowers the total distance
      (``max_iter`` moves at most). For theta > 0 the center's likelihood depends on theta only through this total,
      so alternating with theta updates (paper, appendix C) reaches the same center.
    * Theta: the MLE given the final center solves E_theta[d] = mean training distance (brentq on the monotone
      expectation), restricted to [0, ``theta_max``] (0 = uniform when the data are no closer than uniform; theta_max
      when every training ranking equals the center).
    * The predicted ``Mallows`` distribution draws its Monte-Carlo samples (sub-k, k >= 3, m > ``exact_max_m``) with
      the seed.
    """

    name = "mallows"

    settings_class = MallowsSettings

    def fit(self, X, ranks) -> MallowsLearner:
        _, ranks = check_xy(X, ranks)
        n, self.m = ranks.shape
        m = self.m
        before = (ranks[:, :, None] < ranks[:, None, :]).sum(axis=0)  # N[a, b]: rankings with a before b
        rng = np.random.default_rng(self.seed)
        center = np.lexsort((rng.random(m), ranks.mean(axis=0)))
        t_idx, u_idx = np.triu_indices(m, 1)

        def total(cands: np.ndarray) -> np.ndarray:  # (S, m) centers -> (S,) total distance
            return before[cands[:, u_idx], cands[:, t_idx]].sum(axis=1)

        swaps = np.tile(np.arange(m), (len(t_idx), 1))
        swaps[np.arange(len(t_idx)), t_idx], swaps[np.arange(len(t_idx)), u_idx] = u_idx, t_idx
        current = int(total(center[None])[0])
        self.n_moves_ = 0
        for _ in range(self.max_iter):
            cands = center[swaps]  # every swap of two positions
            costs = total(cands)
            best = int(np.argmin(costs))
            if costs[best] >= current:
                break
            center, current = cands[best], int(costs[best])
            self.n_moves_ += 1
        self.center = center
        self.mean_distance_ = current / n
        self.theta = self.mle_theta(self.mean_distance_, m, self.theta_max)
        self.fit_summary = {"train_rows": n, "theta": self.theta, "mean_distance": self.mean_distance_,
                            "local_search_moves": self.n_moves_}
        return self

    @staticmethod
    def mle_theta(mean_distance: float, m: int, theta_max: float = 50.0) -> float:
        """theta >= 0 with E_theta[d_K] = mean_distance (clipped to [0, theta_max])."""
        if mean_distance >= expected_distance(0.0, m) - 1e-12:
            return 0.0
        if mean_distance <= expected_distance(theta_max, m):
            return theta_max
        return float(brentq(lambda th: expected_distance(th, m) - mean_distance, 0.0, theta_max, xtol=1e-12))

    def predict_distribution(self, X) -> Mallows:
        self._require_fit()
        return Mallows(self.center, self.theta, n=len(X), mc_samples=self.mc_samples, mc_seed=self.seed,
                       exact_max_m=self.exact_max_m)

    def fitted_arrays(self) -> dict[str, np.ndarray]:
        return {"center": self.center}

    def fitted_values(self) -> dict:
        return {**super().fitted_values(), "theta": self.theta, "mean_distance": self.mean_distance_}

    def expected_arrays(self, info: dict, directory) -> dict:
        """The center ranking: one entry per label (``fitted.m`` of method.json)."""
        from rewarduq_exp.core.payload_bounds import Expected

        m = self.saved_labels(info, directory)
        return {"center": Expected((m,), "iu", f"m={m} in method.json")}

    def load_fitted(self, arrays, values) -> None:
        super().load_fitted(arrays, values)
        self.center, self.theta, self.mean_distance_ = arrays["center"], float(values["theta"]), values["mean_distance"]

