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

The posterior's lambda is ``prior_precision`` (one meaning in every Laplace method: rewarduq_exp/methods/posteriors/):
``fixed`` (the default, the paper's) is lambda = ``reg_lambda``, the MAP fit's; a number sets it apart from the MAP's;
``marglik`` fits lambda instead by maximising the Laplace approximation of the log marginal likelihood (MacKay 1992;
Daxberger et al. 2021, "Laplace Redux")

    log p(D | lambda) ~= sum_i w_i log s_i - lambda/2 ||theta||^2 + d/2 log lambda - 1/2 log det(G + lambda I),

with G = sum_i c_i dz_i dz_i^T the data term of eq. 15 for the chosen ``hessian`` (the posterior is a
:class:`~rewarduq_exp.methods.posteriors.FullPosterior`; rewarduq_exp/methods/posteriors/evidence.py: the formula, and
why one eigendecomposition of G and Brent's method in log lambda find the maximum). By default theta stays the MAP
trained with ``reg_lambda`` and only H's lambda changes (post hoc, as laplace-torch's
``optimize_prior_precision(method="marglik")``). ``marglik_refits = k`` then alternates k times:
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

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.setting_bounds import Bound
from rewarduq_exp.methods.base import FeatureHeadMethod, bradley_terry_nll, weighted_mean
from rewarduq_exp.methods.posteriors import MARGLIK, FullPosterior, prior_precision_setting
from rewarduq_exp.methods.settings import (
    AdamWSettings,
    FeatureHeadSettings,
    cast,
    listed,
    positive,
    setting,
)

HESSIAN_MODES = ("unweighted", "weighted")
FIXED = "fixed"   # prior_precision=fixed: lambda = reg_lambda, the MAP fit's (the paper's)


def margins_float64(dz: torch.Tensor, theta: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """theta^T dz_i in float64 (the float32 product loses ~1e-7 of s_i (1 - s_i)), chunk by chunk: a float64 copy of
    all of dz would double its memory."""
    theta = theta.double()
    return torch.cat([dz[i:i + chunk].double() @ theta for i in range(0, len(dz), chunk)])


@dataclass(kw_only=True)
class BayLinSettings(FeatureHeadSettings, AdamWSettings, config="bay_lin"):
    """Defaults and comments: ``conf/method/bay_lin.yaml``."""

    reg_lambda: float = setting(check=positive(), doc="lambda: L2 of the MAP fit, and the prior precision with "
                                                      "prior_precision=fixed (> 0: H must be positive definite)")
    beta: float = setting(check=positive(), doc="bounds reward +- beta * u")
    hessian: str = setting(check=listed(HESSIAN_MODES), doc="unweighted (paper) | weighted (BT curvature per pair)")
    center_features: bool = setting(check=cast(bool), doc="u at z - mean(z_train) (ablation)")
    prior_precision: str | float = setting(check=prior_precision_setting(FIXED, meaning="= method.reg_lambda"),
                                           doc="fixed (= reg_lambda) | marglik | a number > 0")
    marglik_refits: int = setting(bound=Bound(0, 100, "refits", "each trains BAY-LIN's head again; lambda settles in "
                                              "2-4"), doc="marglik: rounds of refitting theta and lambda")

    def validate(self) -> None:
        super().validate()
        if self.marglik_refits and self.prior_precision != MARGLIK:
            held = "reg_lambda" if self.prior_precision == FIXED else "that number"
            raise UserError(f"method.marglik_refits={self.marglik_refits} needs method.prior_precision=marglik "
                            f"(with prior_precision={self.prior_precision} lambda is {held} and nothing is "
                            "refitted)")


class BayLin(FeatureHeadMethod):
    name = "bay_lin"
    POSTERIOR_SAMPLES = 64  # Laplace posterior draws for disagreement-based acquisition (BALD)

    settings_class = BayLinSettings

    def __init__(self, encoder=None, **values):
        super().__init__(encoder, **values)
        self.head: nn.Linear | None = None
        self.posterior: FullPosterior | None = None   # over the head's weights (posteriors/full.py)
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
        if self.prior_precision == MARGLIK:
            self._fit_marglik(dz, weight)
            return
        with torch.no_grad():
            self.posterior = FullPosterior.fit(dz, self._curvature_coef(dz, weight), self.fixed_prior_precision())

    def fixed_prior_precision(self) -> float | None:
        """The posterior's lambda where the settings give it: ``reg_lambda`` (``fixed``) or the number; None for
        ``marglik`` (fitted)."""
        if self.prior_precision == MARGLIK:
            return None
        return self.reg_lambda if self.prior_precision == FIXED else float(self.prior_precision)

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
                posterior = FullPosterior.fit(dz, self._curvature_coef(dz, weight))
                if k == 0:
                    evidence_at_reg_lambda = posterior.log_evidence(log_lik, theta_sq, self.reg_lambda)
                lambdas.append(posterior.optimise_prior_precision(theta_sq))   # H = G + lambda I and its factor
            seconds += time.perf_counter() - t0
        self.posterior = posterior
        lam = lambdas[-1]
        self.laplace_summary = {
            "marglik_prior_precision": lam,
            "marglik_log_evidence": posterior.log_evidence(log_lik, theta_sq),
            "marglik_log_evidence_at_reg_lambda": evidence_at_reg_lambda,   # the first fit's head, lambda = reg_lambda
            "marglik_effective_parameters": posterior.effective_parameters(),
            "marglik_log_likelihood": log_lik,
            "marglik_theta_sq_norm": theta_sq,
            "seconds_marglik": seconds}
        if self.marglik_refits:
            self.laplace_summary["marglik_prior_precision_rounds"] = lambdas

    @property
    def precision(self) -> torch.Tensor:
        """H = G + lambda I (eq. 15), float64."""
        return self.posterior.precision

    @property
    def cholesky(self) -> torch.Tensor:
        return self.posterior.cholesky

    def _score_features(self, z):
        reward = self.head(z).squeeze(-1)
        return reward, self.posterior.predictive_sd(z - self.feature_mean).to(reward.dtype)

    def _sample_features(self, z: torch.Tensor) -> torch.Tensor:
        """Rewards under weights drawn from the Laplace posterior N(theta, H^-1) (FullPosterior.sample_offsets). The
        draws are seeded (the same for every call), so chosen and rejected, and repeated calls, share them."""
        offsets = self.posterior.sample_offsets(z - self.feature_mean, self.POSTERIOR_SAMPLES, self.seed)
        return self.head(z).squeeze(-1).double()[None, :] + offsets

    def state_tensors(self) -> dict[str, torch.Tensor]:
        # BAY-LIN's file keeps the layout it always had (the precision only; lambda is in method.json: the settings,
        # or fit_summary's marglik_prior_precision), so run folders saved before the posterior API still load
        return {"head.weight": self.head.weight, "precision": self.posterior.precision,
                "feature_mean": self.feature_mean}

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
        self.posterior = FullPosterior.from_precision(tensors["precision"].double(),
                                                      self.fixed_prior_precision() or math.nan)
        self.feature_mean = tensors["feature_mean"].float()

    def load(self, directory):
        super().load(directory)
        fitted = self.fit_summary.get("marglik_prior_precision")
        if self.prior_precision == MARGLIK and isinstance(fitted, float):
            self.posterior.prior_precision = fitted   # only for the evidence of a loaded run: P is as saved
        return self
