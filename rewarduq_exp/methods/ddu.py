"""DDU: a reward head on frozen backbone features whose uncertainty is the negative log density of a response's
features under a Gaussian mixture fitted to the training features, scaled into reward units (after Mukhoti et al.
2023, "Deep deterministic uncertainty", CVPR: one deterministic network, and a density of its feature space as the
epistemic uncertainty; here the features are the frozen backbone's, as every head of this package reads them).

* reward r(z): one MLP head trained on the Bradley-Terry loss (:mod:`~rewarduq_exp.methods.distance_scale`);
* the density: scikit-learn's :class:`~sklearn.mixture.GaussianMixture` with ``n_components`` components (1 = one
  Gaussian) and ``covariance_type`` full | diag | tied | spherical, with ``reg_covar`` added to every variance, fitted
  once after training to the chosen and rejected features of the pairs the head trained on, each dimension
  standardised by their mean and standard deviation;
* d(z) = max(0, -log p(z) - shift), shift = the smallest -log p of those training rows: d is 0 at the densest
  training response and >= 0 on every one (a new response denser than all of them is clamped to 0). The minimum
  rather than a quantile: no training row is clamped, so d keeps its order on the data it was fitted to;
* u = c d(z), c fitted on held-out pairs (:func:`~rewarduq_exp.methods.distance_scale.fit_distance_scale`);
  bounds reward +- beta u.

-log p grows as half the squared Mahalanobis distance from the nearest component: far from the data it grows
quadratically in the distance, where the k-NN distance grows linearly.

No projection (PCA) before the fit: the directions it would drop, those in which the training features barely vary,
are exactly where a response unlike the training data differs from it, and with them dropped its density would look
typical. ``reg_covar`` keeps them and bounds how much a deviation in them counts (a variance of at least reg_covar,
in units of each dimension's variance). The price is d x d covariances: 52 MB a component at d = 2560 in float64,
counted by the planner; ``covariance_type=diag`` is the choice for a very wide backbone or many components.

The fitted mixture is saved as arrays (weights, means, Cholesky factors of the precisions, float64) in
``state.safetensors``, never pickled, and scoring computes the log density from them with torch
(:func:`gmm_log_density`, the formula scikit-learn's ``score_samples`` evaluates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.setting_bounds import Bound
from rewarduq_exp.methods.distance_scale import CHUNK, DistanceHeadSettings, DistanceScaledHead
from rewarduq_exp.methods.settings import one_of, positive, setting

COVARIANCE_TYPES = ("full", "diag", "tied", "spherical")
MAX_COMPONENTS = 1024
MAX_ITER = 100              # EM iterations (scikit-learn's default); one Gaussian converges in the first two


def precision_shape(covariance_type: str, k: int, d) -> tuple:
    """The shape of scikit-learn's ``precisions_cholesky_`` for ``k`` components in ``d`` dimensions."""
    return {"full": (k, d, d), "tied": (d, d), "diag": (k, d), "spherical": (k,)}[covariance_type]


def gmm_log_density(x: torch.Tensor, weights: torch.Tensor, means: torch.Tensor, precisions_cholesky: torch.Tensor,
                    covariance_type: str) -> torch.Tensor:
    """log p(x) (B,) of rows ``x`` (B, d) under the mixture sum_k w_k N(mu_k, P_k^-1), with P_k = L_k L_k^T given by
    its Cholesky factor L_k (scikit-learn's ``precisions_cholesky_``): per component
    log N = -(d log 2 pi + ||(x - mu_k)^T L_k||^2) / 2 + log det L_k, then a log-sum-exp over components with the
    log weights. One component at a time: (B, d) tensors, never (k, B, d)."""
    x = x.double()
    d = x.shape[1]
    chol = precisions_cholesky.double()
    per_component = []
    for j in range(len(weights)):
        diff = x - means[j].double()
        if covariance_type == "full":
            y2, log_det = (diff @ chol[j]).pow(2).sum(1), torch.log(torch.diagonal(chol[j])).sum()
        elif covariance_type == "tied":
            y2, log_det = (diff @ chol).pow(2).sum(1), torch.log(torch.diagonal(chol)).sum()
        elif covariance_type == "diag":
            y2, log_det = (diff * chol[j]).pow(2).sum(1), torch.log(chol[j]).sum()
        elif covariance_type == "spherical":
            y2, log_det = diff.pow(2).sum(1) * chol[j] ** 2, d * torch.log(chol[j])
        else:
            raise ValueError(f"covariance_type {covariance_type!r}; allowed: {', '.join(COVARIANCE_TYPES)}")
        per_component.append(-0.5 * (d * math.log(2 * math.pi) + y2) + log_det + torch.log(weights[j].double()))
    return torch.logsumexp(torch.stack(per_component), dim=0)


@dataclass(kw_only=True)
class DduSettings(DistanceHeadSettings, config="ddu"):
    """Defaults and comments: ``conf/method/ddu.yaml``."""

    n_components: int = setting(bound=Bound(1, MAX_COMPONENTS, "components", "each holds a mean and (full) a d x d "
                                            "covariance, and every scored row is evaluated under each"),
                                doc="Gaussians of the mixture")
    covariance_type: str = setting(check=one_of(COVARIANCE_TYPES), doc="full | diag | tied | spherical")
    reg_covar: float = setting(check=positive(cast=float), doc="added to every variance (standardised units)")


class DduHead(DistanceScaledHead):
    name = "ddu"
    settings_class = DduSettings

    def __init__(self, encoder=None, **values):
        super().__init__(encoder, **values)
        self.gmm_weights: torch.Tensor | None = None       # (k,) float64
        self.gmm_means: torch.Tensor | None = None         # (k, d)
        self.gmm_precisions_cholesky: torch.Tensor | None = None   # precision_shape(covariance_type, k, d)
        self.shift: float = 0.0

    @staticmethod
    def _covariance_elements(m, d: int) -> int:
        k = int(m.n_components)
        return math.prod(precision_shape(str(m.covariance_type), k, d))

    @classmethod
    def _reference_memory(cls, ctx, feature_dim: int, rows: int) -> tuple[dict[str, float], float]:
        """scikit-learn's fit: the standardised rows (float64), a centred copy of them and the responsibilities
        while it estimates a component, the covariances and their precision Cholesky factors (float64), and the
        means; FLOPs: per EM iteration, the covariances and the log densities (2 x rows x d^2 per full component),
        two iterations for one component, MAX_ITER for more."""
        m, d = ctx.method, feature_dim
        k = int(m.n_components)
        cov = cls._covariance_elements(m, d)
        parts = {"DDU mixture fit: standardised training rows (float64)": rows * d * 8,
                 "DDU mixture fit: a centred copy and the responsibilities": rows * d * 8 + rows * k * 8,
                 "DDU mixture (means, covariances, precision Cholesky factors; float64)": (k * d + 2 * cov) * 8}
        per_row = 2 * d * d * k if m.covariance_type == "full" else (2 * d * d if m.covariance_type == "tied"
                                                                      else 2 * d * k)
        return parts, 2.0 * per_row * rows * (2 if k == 1 else MAX_ITER)

    def _fit_reference(self, zc, zr, rows) -> None:
        from sklearn.mixture import GaussianMixture

        if self.n_components > len(rows):
            raise UserError(f"method.n_components={self.n_components} is more than the {len(rows)} training "
                            "features the mixture is fitted to; lower it")
        x = self.standardised(zc, zr, rows, torch.float64)
        gmm = GaussianMixture(n_components=self.n_components, covariance_type=self.covariance_type,
                              reg_covar=self.reg_covar, max_iter=MAX_ITER, random_state=self.seed).fit(x.numpy())
        self.gmm_weights = torch.from_numpy(np.asarray(gmm.weights_, np.float64))
        self.gmm_means = torch.from_numpy(np.asarray(gmm.means_, np.float64))
        self.gmm_precisions_cholesky = torch.from_numpy(np.asarray(gmm.precisions_cholesky_, np.float64))
        # d = 0 at the densest training row (module docstring)
        self.shift = float(min(self.negative_log_density(x[i:i + CHUNK]).min() for i in range(0, len(x), CHUNK)))

    def negative_log_density(self, x: torch.Tensor) -> torch.Tensor:
        """-log p (B,) of standardised features ``x`` under the fitted mixture, not shifted."""
        return -gmm_log_density(x, self.gmm_weights, self.gmm_means, self.gmm_precisions_cholesky,
                                self.covariance_type)

    def _raw_distance(self, x):
        return (self.negative_log_density(x) - self.shift).clamp_min(0.0)

    # ------------------------------------------------------------------ saved state
    def _reference_tensors(self) -> dict[str, torch.Tensor]:
        return {"gmm.weights": self.gmm_weights, "gmm.means": self.gmm_means,
                "gmm.precisions_cholesky": self.gmm_precisions_cholesky,
                "shift": torch.tensor([self.shift], dtype=torch.float64)}

    def _expected_reference(self, feature_dim, why: str) -> dict:
        from rewarduq_exp.core.payload_bounds import Expected

        k = self.n_components
        why = f"n_components={k}, covariance_type={self.covariance_type}, {why}"
        shapes = {"gmm.weights": (k,), "gmm.means": (k, feature_dim),
                  "gmm.precisions_cholesky": precision_shape(self.covariance_type, k, feature_dim), "shift": (1,)}
        return {name: Expected(shape, "f", why) for name, shape in shapes.items()}

    def _load_reference(self, tensors) -> None:
        k, d = self.n_components, self.feature_mean.shape[0]
        found = {name: tuple(tensors[f"gmm.{name}"].shape) for name in ("weights", "means", "precisions_cholesky")}
        wanted = {"weights": (k,), "means": (k, d),
                  "precisions_cholesky": precision_shape(self.covariance_type, k, d)}
        if found != wanted:
            raise ValueError(f"the mixture's arrays are {found}, expected {wanted}")
        self.gmm_weights = tensors["gmm.weights"].double()
        self.gmm_means = tensors["gmm.means"].double()
        self.gmm_precisions_cholesky = tensors["gmm.precisions_cholesky"].double()
        self.shift = float(tensors["shift"].reshape(-1)[0])
