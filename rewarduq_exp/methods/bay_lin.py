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

``prior_precision=marglik`` (default ``fixed``: lambda = ``reg_lambda``, the paper's) fits lambda instead by maximising
the Laplace approximation of the log marginal likelihood (MacKay 1992; Daxberger et al. 2021, "Laplace Redux")

    log p(D | lambda) ~= sum_i w_i log s_i - lambda/2 ||theta||^2 + d/2 log lambda - 1/2 log det(G + lambda I),

with G = sum_i c_i dz_i dz_i^T the data term of eq. 15 for the chosen ``hessian`` (rewarduq_exp/methods/
laplace_evidence.py: the formula, and why one eigendecomposition of G and Brent's method in log lambda find the
maximum). By default theta stays the MAP trained with ``reg_lambda`` and only H's lambda changes (post hoc, as
laplace-torch's ``optimize_prior_precision(method="marglik")``). ``marglik_refits = k`` then alternates k times:
retrain theta (from the same initialisation and data order) as the mode of the posterior with prior precision
lambda, i.e. minimise the mean NLL + (lambda / 2W) ||theta||^2 with W = sum_i w_i (the posterior's negative log density
divided by W, so the loss keeps the scale the learning rate was tuned at), and fit lambda again at the new theta.
(Eq. 14's mean loss with the same lambda as eq. 15's sum is the MAP of prior precision lambda * W, not lambda; the
refit uses the scaling under which theta is the mode of the posterior whose evidence is maximised.) The fitted lambda,
the evidence and the effective number of parameters go to ``fit_summary`` (so to model/method.json and status.json's
"fit"); the saved precision carries lambda, so a saved run scores without refitting.

H always covers all training pairs. (The reference code, under several processes, kept rank 0's shard only; here
rank 0 fits on all cached features and broadcasts the head and H, see FeatureHeadMethod.fit.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.setting_bounds import Bound
from rewarduq_exp.methods.base import FeatureHeadMethod, bradley_terry_nll, weighted_mean
from rewarduq_exp.methods.settings import (
    AdamWSettings,
    FeatureHeadSettings,
    cast,
    listed,
    one_of,
    positive,
    setting,
)

HESSIAN_MODES = ("unweighted", "weighted")
PRIOR_PRECISION_MODES = ("fixed", "marglik")  # lambda = reg_lambda | fitted by the Laplace evidence


def posterior_precision(dz: torch.Tensor, coef: torch.Tensor, reg_lambda: float, chunk: int = 8192) -> torch.Tensor:
    """lambda * I + sum_i coef_i dz_i dz_i^T in float64, accumulated in chunks (eq. 15)."""
    d = dz.shape[1]
    h = torch.zeros(d, d, dtype=torch.float64, device=dz.device)
    for i in range(0, len(dz), chunk):
        x = dz[i:i + chunk].double()
        h += x.T @ (x * coef[i:i + chunk].double()[:, None])
    return h + reg_lambda * torch.eye(d, dtype=torch.float64, device=dz.device)


def margins_float64(dz: torch.Tensor, theta: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """theta^T dz_i in float64 (the float32 product loses ~1e-7 of s_i (1 - s_i)), chunk by chunk: a float64 copy of
    all of dz would double its memory."""
    theta = theta.double()
    return torch.cat([dz[i:i + chunk].double() @ theta for i in range(0, len(dz), chunk)])


def quadratic_form_sqrt(cholesky_lower: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """sqrt(z_b^T H^-1 z_b) for every row b of ``z``, with ``H = L L^T``: the norm of ``L^-1 z_b``."""
    v = torch.linalg.solve_triangular(cholesky_lower, z.double().T, upper=False)  # (d, B)
    return v.pow(2).sum(0).sqrt()


@dataclass(kw_only=True)
class BayLinSettings(FeatureHeadSettings, AdamWSettings, config="bay_lin"):
    """Defaults and comments: ``conf/method/bay_lin.yaml``."""

    reg_lambda: float = setting(check=positive(), doc="lambda: L2 of the MAP fit, prior precision (> 0: H must be "
                                                      "positive definite)")
    beta: float = setting(check=positive(), doc="bounds reward +- beta * u")
    hessian: str = setting(check=listed(HESSIAN_MODES), doc="unweighted (paper) | weighted (BT curvature per pair)")
    center_features: bool = setting(check=cast(bool), doc="u at z - mean(z_train) (ablation)")
    prior_precision: str = setting(check=one_of(PRIOR_PRECISION_MODES), doc="fixed | marglik")
    marglik_refits: int = setting(bound=Bound(0, 100, "refits", "each trains BAY-LIN's head again; lambda settles in "
                                              "2-4"), doc="marglik: rounds of refitting theta and lambda")

    def validate(self) -> None:
        super().validate()
        if self.marglik_refits and self.prior_precision != "marglik":
            raise UserError(f"method.marglik_refits={self.marglik_refits} needs method.prior_precision=marglik "
                            f"(with prior_precision={self.prior_precision} lambda is reg_lambda and nothing is "
                            "refitted)")


class BayLin(FeatureHeadMethod):
    name = "bay_lin"
    POSTERIOR_SAMPLES = 64  # Laplace posterior draws for disagreement-based acquisition (BALD)

    settings_class = BayLinSettings

    def __init__(self, encoder=None, **values):
        super().__init__(encoder, **values)
        self.head: nn.Linear | None = None
        self.precision: torch.Tensor | None = None
        self.cholesky: torch.Tensor | None = None
        self.feature_mean: torch.Tensor | None = None
        self.laplace_summary: dict = {}   # prior_precision=marglik: the fitted lambda and evidence (fit_summary)

    def _build(self, feature_dim: int) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.head = nn.Linear(feature_dim, 1, bias=False).to(self.device)

    def fit(self, train, eval=None):  # noqa: A002
        super().fit(train, eval)
        self.fit_summary.update(self.laplace_summary)   # set by _fit_features (the base class rebuilds fit_summary)
        return self

    def _fit_features(self, zc, zr, weight) -> None:
        dz = zc - zr
        self.feature_mean = (zc.mean(0) + zr.mean(0)) / 2 if self.center_features else torch.zeros_like(zc[0])
        self._fit_map(dz, weight, self.reg_lambda, f"{self.name} MAP")
        if self.prior_precision == "marglik":
            self._fit_marglik(dz, weight)
            return
        with torch.no_grad():
            self.set_precision(posterior_precision(dz, self._curvature_coef(dz, weight), self.reg_lambda))

    def _fit_map(self, dz, weight, reg: float, desc: str) -> None:
        """Eq. 14: AdamW on the (weighted) mean BT NLL + (reg / 2) ||theta||^2, from the seeded initialisation."""

        def batch_loss(index):
            margin = self.head(dz[index]).squeeze(-1)  # linear head: r(c) - r(r) = theta^T dz
            bt = weighted_mean(bradley_terry_nll(margin), weight[index])
            prior = 0.5 * reg * self.head.weight.pow(2).sum()
            return bt + prior, {"loss_bt": bt.detach(), "loss_prior": prior.detach()}

        self._train_loop(self.head.parameters(), batch_loss, len(dz), self.schedule, desc=desc)

    @torch.no_grad()
    def _curvature_coef(self, dz, weight) -> torch.Tensor:
        """c_i of eq. 15's data term: w_i (unweighted) or w_i s_i (1 - s_i) (weighted: the BT likelihood's GGN)."""
        coef = weight.double()
        if self.hessian == "weighted":
            s = torch.sigmoid(margins_float64(dz, self.head.weight.detach()[0]))
            coef = coef * s * (1 - s)
        return coef

    def _fit_marglik(self, dz, weight) -> None:
        """lambda by the Laplace evidence at the MAP head (post hoc), then ``marglik_refits`` rounds of: retrain the
        head as the posterior mode under that lambda, fit lambda again (module docstring). H = G + lambda I."""
        from rewarduq_exp.methods.laplace_evidence import effective_parameters, fit_prior_precision, log_evidence

        total_weight = float(weight.double().sum())
        lambdas, seconds = [], 0.0
        for k in range(self.marglik_refits + 1):
            if k:
                self._build(dz.shape[1])   # the same seeded initialisation as the first fit
                # mean NLL + (lambda / 2W) ||theta||^2 = (sum_i w_i NLL_i + (lambda / 2) ||theta||^2) / W
                self._fit_map(dz, weight, lambdas[-1] / total_weight, f"{self.name} MAP marglik refit {k}")
            t0 = time.perf_counter()
            with torch.no_grad():
                theta = self.head.weight.detach().double()[0]
                log_lik = float((weight.double() * F.logsigmoid(margins_float64(dz, theta))).sum())
                theta_sq = float(theta @ theta)
                curvature = posterior_precision(dz, self._curvature_coef(dz, weight), 0.0)
                eigenvalues = torch.linalg.eigvalsh(curvature).cpu().numpy()   # one d x d float64 eigendecomposition
            if k == 0:
                evidence_at_reg_lambda = log_evidence(log_lik, theta_sq, eigenvalues, self.reg_lambda)
            lambdas.append(fit_prior_precision(theta_sq, eigenvalues))
            seconds += time.perf_counter() - t0
        lam = lambdas[-1]
        eye = torch.eye(curvature.shape[0], dtype=curvature.dtype, device=curvature.device)
        self.set_precision(curvature + lam * eye)
        self.laplace_summary = {
            "marglik_prior_precision": lam,
            "marglik_log_evidence": log_evidence(log_lik, theta_sq, eigenvalues, lam),
            "marglik_log_evidence_at_reg_lambda": evidence_at_reg_lambda,   # the first fit's head, lambda = reg_lambda
            "marglik_effective_parameters": effective_parameters(eigenvalues, lam),
            "marglik_log_likelihood": log_lik,
            "marglik_theta_sq_norm": theta_sq,
            "seconds_marglik": seconds}
        if self.marglik_refits:
            self.laplace_summary["marglik_prior_precision_rounds"] = lambdas

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

    @classmethod
    def head_memory(cls, ctx, feature_dim: int, batch: int):
        """dz = chosen - rejected; the d x d float64 Hessian as accumulated, with lambda I added and its Cholesky
        factor; one 8192-row chunk of dz in float64 (and its weighted copy) while accumulating."""
        from rewarduq_exp.models.memory_plan import HeadMemory

        d, n = feature_dim, ctx.n_train
        parts = {"dz = chosen - rejected (float32)": n * d * 4,
                 "BAY-LIN Hessian d x d (float64: H, H + lambda I, Cholesky)": 3 * d * d * 8,
                 "Hessian chunk (8192 x d, float64, x2)": 2 * min(8192, n) * d * 8}
        return HeadMemory(d, parts, 6 * d * n * float(ctx.method.num_epochs) + 2 * n * d * d + d**3 / 3)

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self._build(tensors["head.weight"].shape[1])
        self.head.load_state_dict({"weight": tensors["head.weight"]})
        self.set_precision(tensors["precision"].double())
        self.feature_mean = tensors["feature_mean"].float()
