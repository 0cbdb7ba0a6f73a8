"""BAY-LIN: a Bayesian linear reward head with a Laplace posterior (RewardUQ section 4.4, eqs. 14-15).

Stage 1 finds the MAP head ``theta`` by AdamW on the Bradley-Terry NLL + (lambda/2) ||theta||^2 (eq. 14).
Stage 2 forms the posterior precision (eq. 15)

    H = lambda * I + sum_i c_i dz_i dz_i^T,   dz_i = z_chosen_i - z_rejected_i,

with ``c_i = w_i`` (``hessian=unweighted``, the paper's setting) or ``c_i = w_i s_i (1 - s_i)``,
``s_i = sigmoid(theta^T dz_i)`` (``hessian=weighted``, the Gauss-Newton curvature of the BT likelihood); ``w_i`` is
the pair weight. The uncertainty of a response is ``u(z) = sqrt(z^T H^-1 z)``, computed row-wise through the
Cholesky factor ``H = L L^T`` as ``||L^-1 z||`` (no inverse, no pinv, and never a B x B matrix). Bounds are
reward ± beta * u with beta = 0.5.

``center_features`` (default off: the paper's ``u(z) = sqrt(z^T H^-1 z)``, with which Table 1's values were tuned)
is an ablation that evaluates ``u`` at ``z - mean(z_train)``. The Bradley-Terry likelihood sees only differences, so
the shared offset that all features of a backbone carry (|z| = 11.3 vs |z - mean| = 3.2 on the tiny model) is
constrained by the prior alone and adds nearly the same large amount of "uncertainty" to every response; centring
removes it and leaves the data-dependent part (docs/methods.md, BAY-LIN, shows the effect). The offset changes no
margin, so rewards and all accuracy metrics (win rate) are identical either way; only u, the bounds and the confidence
metrics change.

H always covers all training pairs. (The reference code, under several processes, kept rank 0's shard only; here
rank 0 fits on all cached features and broadcasts the head and H, see FeatureHeadMethod.fit.)
"""

from __future__ import annotations

import torch
from torch import nn

from rewarduq_exp.core.checks import check_positive
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.base import (
    FeatureHeadMethod,
    TrainingSchedule,
    bradley_terry_nll,
    weighted_mean,
)

HESSIAN_MODES = ("unweighted", "weighted")


def posterior_precision(dz: torch.Tensor, coef: torch.Tensor, reg_lambda: float, chunk: int = 8192) -> torch.Tensor:
    """lambda * I + sum_i coef_i dz_i dz_i^T in float64, accumulated in chunks (eq. 15)."""
    d = dz.shape[1]
    h = torch.zeros(d, d, dtype=torch.float64, device=dz.device)
    for i in range(0, len(dz), chunk):
        x = dz[i:i + chunk].double()
        h += x.T @ (x * coef[i:i + chunk].double()[:, None])
    return h + reg_lambda * torch.eye(d, dtype=torch.float64, device=dz.device)


def quadratic_form_sqrt(cholesky_lower: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """sqrt(z_b^T H^-1 z_b) for every row b of ``z``, with ``H = L L^T``: the norm of ``L^-1 z_b``."""
    v = torch.linalg.solve_triangular(cholesky_lower, z.double().T, upper=False)  # (d, B)
    return v.pow(2).sum(0).sqrt()


class BayLin(FeatureHeadMethod):
    name = "bay_lin"
    POSTERIOR_SAMPLES = 64  # Laplace posterior draws for disagreement-based acquisition (BALD)

    def __init__(self, learning_rate: float = 1e-2, reg_lambda: float = 1e-2, beta: float = 0.5,
                 hessian: str = "unweighted", center_features: bool = False, batch_size: int = 64,
                 num_epochs: float = 1.0,
                 warmup_ratio: float = 0.05, weight_decay: float = 0.0, adam_betas=(0.9, 0.999),
                 adam_eps: float = 1e-8, max_grad_norm: float | None = 1.0, **common):
        super().__init__(**common)
        self.reg_lambda = check_positive(reg_lambda, "method.reg_lambda")  # > 0: H must be positive definite
        self.beta = check_positive(beta, "method.beta")
        if hessian not in HESSIAN_MODES:
            raise UserError(f"method.hessian={hessian!r} is invalid; allowed: {', '.join(HESSIAN_MODES)}")
        self.hessian = hessian
        self.center_features = bool(center_features)
        self.schedule = TrainingSchedule(learning_rate, batch_size, num_epochs, warmup_ratio, weight_decay,
                                         tuple(adam_betas), adam_eps, max_grad_norm)
        self.schedule.validate()
        self.head: nn.Linear | None = None
        self.precision: torch.Tensor | None = None
        self.cholesky: torch.Tensor | None = None
        self.feature_mean: torch.Tensor | None = None

    def hyperparameters(self) -> dict:
        return {"reg_lambda": self.reg_lambda, "beta": self.beta, "hessian": self.hessian,
                "center_features": self.center_features, **vars(self.schedule),
                "seed": self.seed}

    def _build(self, feature_dim: int) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.head = nn.Linear(feature_dim, 1, bias=False).to(self.device)

    def _fit_features(self, zc, zr, weight) -> None:
        dz = zc - zr
        self.feature_mean = (zc.mean(0) + zr.mean(0)) / 2 if self.center_features else torch.zeros_like(zc[0])

        def batch_loss(index):
            margin = self.head(dz[index]).squeeze(-1)  # linear head: r(c) - r(r) = theta^T dz
            bt = weighted_mean(bradley_terry_nll(margin), weight[index])
            prior = 0.5 * self.reg_lambda * self.head.weight.pow(2).sum()
            return bt + prior, {"loss_bt": bt.detach(), "loss_prior": prior.detach()}

        self._train_loop(self.head.parameters(), batch_loss, len(dz), self.schedule, desc=f"{self.name} MAP")
        with torch.no_grad():
            coef = weight.double()
            if self.hessian == "weighted":
                s = torch.sigmoid(self.head(dz).squeeze(-1)).double()
                coef = coef * s * (1 - s)
            self.set_precision(posterior_precision(dz, coef, self.reg_lambda))

    def set_precision(self, precision: torch.Tensor) -> None:
        self.precision = precision
        self.cholesky, info = torch.linalg.cholesky_ex(precision)
        if int(info) != 0:
            raise RuntimeError("the BAY-LIN posterior precision is not positive definite; raise method.reg_lambda")

    def _score_features(self, z):
        reward = self.head(z).squeeze(-1)
        return reward, quadratic_form_sqrt(self.cholesky, z - self.feature_mean).to(reward.dtype)

    def _sample_features(self, z: torch.Tensor) -> torch.Tensor:
        """Rewards under weights drawn from the Laplace posterior N(theta, H^-1): theta + L^-T eps with H = L L^T,
        so z^T w = r(z) + (L^-1 z)^T eps. The draws are seeded (the same eps for every call), so chosen and
        rejected, and repeated calls, share them."""
        v = torch.linalg.solve_triangular(self.cholesky, (z - self.feature_mean).double().T, upper=False)  # (d, B)
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        eps = torch.randn(self.POSTERIOR_SAMPLES, v.shape[0], generator=gen, dtype=torch.float64).to(v.device)
        return self.head(z).squeeze(-1).double()[None, :] + eps @ v

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"head.weight": self.head.weight, "precision": self.precision, "feature_mean": self.feature_mean}

    def expected_state(self, feature_dim, why: str) -> dict:
        """The MAP head (1, d), the posterior precision (d, d) and the feature mean (d,) for ``feature_dim`` = d."""
        from rewarduq_exp.core.payload_bounds import Expected

        d = feature_dim
        return {"head.weight": Expected((1, d), "f", why), "precision": Expected((d, d), "f", why),
                "feature_mean": Expected((d,), "f", why)}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self._build(tensors["head.weight"].shape[1])
        self.head.load_state_dict({"weight": tensors["head.weight"]})
        self.set_precision(tensors["precision"].double())
        self.feature_mean = tensors["feature_mean"].float()
