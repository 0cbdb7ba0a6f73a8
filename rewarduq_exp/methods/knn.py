"""k-NN: a reward head on frozen backbone features whose uncertainty is the mean Euclidean distance of a response's
features to its ``n_neighbors`` nearest training features, scaled into reward units.

The distance is the plainest rival of an ensemble's spread: in best-of-n on a world whose proxy reward can be gamed by
a shortcut, the candidates that exploit it are far from every training response, which the distance sees and the
ensembles' u need not. Here it is a method of its own (saved in the run folder, recalibrated, read by the API and the
downstream tasks like any method):

* reward r(z): one MLP head trained on the Bradley-Terry loss (:mod:`~rewarduq_exp.methods.distance_scale`);
* d(z) = mean distance to the k nearest of the reference set: the chosen and the rejected features of the pairs the
  head trained on (duplicates kept), each dimension standardised by their mean and standard deviation, at most
  ``max_reference`` rows (more: a seeded random subsample of that many, so the saved file and the distance's cost
  stay bounded);
* u = c d(z), c fitted on held-out pairs (:func:`~rewarduq_exp.methods.distance_scale.fit_distance_scale`);
  bounds reward +- beta u.

The index is scikit-learn's :class:`~sklearn.neighbors.NearestNeighbors` with the exact brute-force search (tree
indexes do not help in hundreds or thousands of dimensions); faiss is not installed in this project's environment, so
scikit-learn is what is used. The reference set is saved, standardised and float32, in ``state.safetensors``, and a
loaded model rebuilds the index from it on its first scoring call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rewarduq_exp.core.setting_bounds import Bound
from rewarduq_exp.methods.distance_scale import DistanceHeadSettings, DistanceScaledHead
from rewarduq_exp.methods.settings import setting

MAX_NEIGHBORS = 10_000
MAX_REFERENCE = 2_000_000   # 2 rows a pair: the largest generated world's 1M pairs


@dataclass(kw_only=True)
class KnnSettings(DistanceHeadSettings, config="knn"):
    """Defaults and comments: ``conf/method/knn.yaml``."""

    n_neighbors: int = setting(bound=Bound(1, MAX_NEIGHBORS, "neighbours", "each scored row keeps this many "
                                           "nearest distances to the reference set"),
                               doc="k: neighbours averaged")
    max_reference: int = setting(bound=Bound(1, MAX_REFERENCE, "rows", "two rows a pair of the largest generated "
                                             "world; each row is saved and held as d float32 numbers: 2M rows of a "
                                             "5120-wide backbone are 41 GB"),
                                 doc="training rows kept as the reference set")


class KnnHead(DistanceScaledHead):
    name = "knn"
    settings_class = KnnSettings

    def __init__(self, encoder=None, **values):
        super().__init__(encoder, **values)
        self.reference: torch.Tensor | None = None   # (n_ref, d) float32, standardised
        self._index = None

    @classmethod
    def _reference_memory(cls, ctx, feature_dim: int, rows: int) -> tuple[dict[str, float], float]:
        """The reference set (float32) and the brute-force search's FLOPs for the held-out rows the scale is fitted
        on (scikit-learn computes distances in chunks of a few hundred rows: small beside the set)."""
        m = ctx.method
        n_ref = min(rows, int(m.max_reference))
        held = 2 * (ctx.n_train - cls._fit_pairs(m, ctx.n_train))
        return ({"KNN reference set (standardised float32)": n_ref * feature_dim * 4},
                2.0 * held * n_ref * feature_dim)

    def _fit_reference(self, zc, zr, rows) -> None:
        if len(rows) > self.max_reference:
            keep = np.random.default_rng(self.seed).choice(len(rows), self.max_reference, replace=False)
            rows = rows[np.sort(keep)]
        self.reference = self.standardised(zc, zr, rows, torch.float32)
        self._index = None

    def neighbours(self):
        """The index over the reference set (built on first use: after fit and after load)."""
        if self._index is None:
            from sklearn.neighbors import NearestNeighbors

            k = min(self.n_neighbors, len(self.reference))
            self._index = NearestNeighbors(n_neighbors=k, algorithm="brute").fit(self.reference.numpy())
        return self._index

    def neighbour_distances(self, x: torch.Tensor) -> np.ndarray:
        """(B, k) distances of standardised features ``x`` to their k nearest reference rows, nearest first."""
        distances, _ = self.neighbours().kneighbors(x.to(torch.float32).numpy())
        return distances

    def _raw_distance(self, x):
        return torch.from_numpy(self.neighbour_distances(x).astype(np.float64).mean(1))

    # ------------------------------------------------------------------ saved state
    def _reference_tensors(self) -> dict[str, torch.Tensor]:
        return {"reference": self.reference}

    def _expected_reference(self, feature_dim, why: str) -> dict:
        from rewarduq_exp.core.payload_bounds import AtMost, Expected

        return {"reference": Expected((AtMost(self.max_reference), feature_dim), "f",
                                      f"max_reference={self.max_reference}, {why}", max_itemsize=4)}

    def _load_reference(self, tensors) -> None:
        reference = tensors["reference"]
        d = self.feature_mean.shape[0]
        if reference.ndim != 2 or reference.shape[1] != d or len(reference) == 0:
            raise ValueError(f"reference is {tuple(reference.shape)}, expected (rows, {d})")
        self.reference = reference.to("cpu", torch.float32).contiguous()
        self._index = None
