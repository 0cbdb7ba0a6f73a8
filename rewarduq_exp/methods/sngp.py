"""SNGP: a spectral-normalised neural Gaussian process reward head on frozen backbone features (Liu et al. 2020,
"Simple and Principled Uncertainty Estimation with Deterministic Deep Learning via Distance Awareness").

The idea: u should grow with the distance of a response from the training data. Two parts give that:

* **a distance-preserving body**: the features z (d), standardised by the training features' mean and standard
  deviation, go through a fixed random projection h_0 = P x (P: hidden_dim x d, entries N(0, 1/d), drawn once from
  the seed and never trained; the SNGP paper's residual MLP has a fixed random input layer too), then
  ``num_hidden_layers`` residual layers h_{l+1} = h_l + ReLU(W_l h_l + b_l) whose weights are spectrally normalised
  with a bound c = ``spec_norm_bound``: W_l / max(1, sigma(W_l) / c) (the paper's eq. 7). Each residual branch is then
  c-Lipschitz, so with c < 1 the body is bi-Lipschitz: (1 - c)^L ||h - h'|| <= ||f(h) - f(h')|| <= (1 + c)^L ||h - h'||
  (the paper's Proposition 2): far in the input stays far in the output, which a plain MLP need not keep.
  sigma is estimated as torch does (``torch.nn.utils.parametrizations.spectral_norm``: one power iteration a training
  step, warm-started); ours multiplies torch's W / sigma by min(sigma, c), sigma recovered as ||W||_F / ||W / sigma||_F,
  so gradients flow through sigma as in the paper.
* **a Gaussian-process output layer** in its random-feature form: phi(h) = sqrt(2 / D) cos(W_rf h + b_rf) with
  W_rf ~ N(0, I / l^2), b_rf ~ U(0, 2 pi), D = ``num_random_features``, fixed after they are drawn, so that
  phi(h)^T phi(h') approximates the RBF kernel exp(-||h - h'||^2 / (2 l^2)) (Rahimi and Recht 2007). The length scale
  l is ``gp_kernel_scale`` times the median distance between training rows' h_0 (the median heuristic, so the setting
  means the same on every backbone: 1 = the typical distance between two training responses). The reward is
  r(z) = beta^T phi(f(z)), beta the trained output layer (no bias: the Bradley-Terry likelihood sees only
  differences; the centring term of ENS-MLP fixes the level).

**Training**: the body's residual layers and beta together, by the one training loop (AdamW, the cosine schedule,
clipping, checkpoints; :meth:`FeatureHeadMethod._train_loop`) on the Bradley-Terry NLL + ``center_gamma`` * mean
(r_c + r_r)^2 (ENS-MLP's loss with one member). The power iteration's vectors are state that changes every step: they
travel with the parameters through the checkpoints (as tensors without gradients, which AdamW and clipping skip), so a
killed run resumes to the same bits.

**The posterior** (the paper's Laplace approximation of the GP layer, eq. 9, done once at the end of training): the
body fixed, r = beta^T phi is linear in beta, so the posterior over beta is a
:class:`~rewarduq_exp.methods.posteriors.FullPosterior` over the D random features: P = lambda I + sum_i w_i p_i (1 -
p_i) dphi_i dphi_i^T, dphi_i = phi(chosen_i) - phi(rejected_i), p_i = sigmoid(beta^T dphi_i) (the Gauss-Newton of the
pair's Bradley-Terry likelihood, exact for a model linear in beta), accumulated in one pass over the training pairs.
lambda = ``prior_precision``: ``marglik`` (the default), the maximiser of the Laplace evidence (one D x D
eigendecomposition, about 9 D^3 FLOPs; the evidence and the effective number of parameters then go to the fit
summary), or a number (the paper's ridge penalty is 1: prior variance 1 of the reward at any point, since
phi^T phi ~= 1).
u(z) = sqrt(phi^T P^-1 phi), the predictive standard deviation of the reward; bounds reward +- beta * u (eq. 9). The
paper's mean-field logit adjustment is for a classifier's softmax; a reward model reports the standard deviation
itself. Far from the training data phi(f(z)) is nearly orthogonal to every training phi, so u tends to the prior's
sqrt(phi^T phi / lambda) ~= lambda^-1/2; near it, u shrinks.

**Saved** (``state.safetensors``): the standardisation, P, the spectral-normalised residual weights materialised as
plain tensors (W / max(1, sigma / c) with the exact sigma, ``torch.linalg.matrix_norm(ord=2)``, after training: a
loaded model needs no power-iteration state, and its hidden layers meet the bound exactly, not only to the power
iteration's lag), the biases, W_rf, b_rf, beta, and the posterior's precision and lambda. The posterior is computed
with that materialised body, so what is scored is what the covariance describes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rewarduq_exp.core.setting_bounds import WIDTH, Bound
from rewarduq_exp.methods.base import FeatureHeadMethod
from rewarduq_exp.methods.losses import bradley_terry_loss
from rewarduq_exp.methods.posteriors import MARGLIK, FullPosterior, prior_precision_setting
from rewarduq_exp.methods.settings import AdamWSettings, FeatureHeadSettings, positive, setting

MAX_RANDOM_FEATURES = 32_768   # the posterior's D x D float64 precision: 8.6 GB at the bound, three of them in a fit
CHUNK = 8192                   # pairs per block of the curvature pass
MEDIAN_ROWS = 1024             # training rows whose pairwise distances give the median for the length scale


@dataclass(kw_only=True)
class SngpSettings(FeatureHeadSettings, AdamWSettings, config="sngp"):
    """Defaults and comments: ``conf/method/sngp.yaml``."""

    hidden_dim: int = setting(bound=Bound(1, WIDTH, "units", "the body's width; each residual layer is a "
                                          "hidden_dim^2 matrix"), doc="the body's width")
    num_hidden_layers: int = setting(bound=Bound(1, 256, "layers", "each is a hidden_dim^2 matrix with its own power "
                                                 "iteration"), doc="residual layers with spectral normalisation")
    spec_norm_bound: float = setting(check=positive(), doc="c: each residual layer's spectral norm is at most c (< 1 "
                                                           "keeps the body distance-preserving)")
    num_random_features: int = setting(bound=Bound(1, MAX_RANDOM_FEATURES, "features", "the GP layer's posterior "
                                                   "precision is a D x D float64 matrix, held three times in the fit"),
                                       doc="D: random Fourier features of the GP layer")
    gp_kernel_scale: float = setting(check=positive(), doc="the RBF kernel's length scale, in units of the median "
                                                           "distance between training rows")
    prior_precision: str | float = setting(check=prior_precision_setting(), doc="lambda of the GP layer's prior: "
                                                                               "marglik or a number > 0")
    center_gamma: float = setting(check=positive(inclusive=True), doc="gamma: mean (r_c + r_r)^2")
    beta: float = setting(check=positive(), doc="bounds reward +- beta * u")


class SngpNetwork(nn.Module):
    """The body and the GP layer (module docstring). ``spectral=True`` registers torch's spectral normalisation on
    the residual layers (training); ``False`` holds them as plain weights (after :meth:`materialise`, and when
    loaded)."""

    def __init__(self, feature_dim: int, hidden_dim: int, num_hidden_layers: int, num_random_features: int,
                 spec_norm_bound: float, generator: torch.Generator, spectral: bool):
        super().__init__()
        d, h, D = feature_dim, hidden_dim, num_random_features
        self.bound = float(spec_norm_bound)
        self.register_buffer("feature_mean", torch.zeros(d))
        self.register_buffer("feature_sd", torch.ones(d))
        self.register_buffer("projection", torch.randn(h, d, generator=generator) / math.sqrt(d))
        self.layers = nn.ModuleList()
        for _ in range(num_hidden_layers):
            layer = nn.Linear(h, h)
            bound = 1.0 / math.sqrt(h)   # nn.Linear's own initialisation, drawn from our generator
            with torch.no_grad():
                layer.weight.uniform_(-bound, bound, generator=generator)
                layer.bias.uniform_(-bound, bound, generator=generator)
            self.layers.append(layer)
        self.register_buffer("rf_weight", torch.randn(D, h, generator=generator))   # / length scale: set_length_scale
        self.register_buffer("rf_bias", torch.rand(D, generator=generator) * (2 * math.pi))
        self.beta = nn.Parameter(torch.zeros(D))   # the prior's mean
        if spectral:
            from torch.nn.utils.parametrizations import spectral_norm

            for layer in self.layers:   # its power iteration's start vectors come from torch's global RNG (seeded)
                spectral_norm(layer)

    @property
    def spectral(self) -> bool:
        from torch.nn.utils import parametrize

        return any(parametrize.is_parametrized(layer, "weight") for layer in self.layers)

    def power_iteration_state(self) -> list[torch.Tensor]:
        """The power iteration's vectors (u, v of each layer): state that training changes without gradients."""
        return [t for layer in self.layers if hasattr(layer, "parametrizations")
                for t in layer.parametrizations.weight[0].buffers()]

    def bounded_weight(self, layer: nn.Linear) -> torch.Tensor:
        """W / max(1, sigma / c): torch's W / sigma (one power iteration in training mode) times min(sigma, c)."""
        if not hasattr(layer, "parametrizations"):
            return layer.weight
        normalised = layer.weight                        # W / sigma, sigma = u^T W v (torch's estimate)
        sigma = layer.parametrizations.weight.original.norm() / normalised.norm()
        return normalised * torch.clamp(sigma, max=self.bound)

    def standardise(self, z: torch.Tensor) -> torch.Tensor:
        return (z - self.feature_mean) / self.feature_sd

    def body(self, z: torch.Tensor) -> torch.Tensor:
        h = self.standardise(z) @ self.projection.T
        for layer in self.layers:
            h = h + F.relu(F.linear(h, self.bounded_weight(layer), layer.bias))
        return h

    def random_features(self, z: torch.Tensor) -> torch.Tensor:
        """phi(f(z)) (B, D)."""
        scale = math.sqrt(2.0 / self.rf_weight.shape[0])
        return scale * torch.cos(F.linear(self.body(z), self.rf_weight, self.rf_bias))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Rewards (B,) of features ``z`` (B, d)."""
        return self.random_features(z) @ self.beta

    @torch.no_grad()
    def set_length_scale(self, length_scale: float) -> None:
        self.rf_weight.div_(length_scale)

    @torch.no_grad()
    def materialise(self) -> list[float]:
        """Replace each residual layer's parametrisation by the plain weight W / max(1, sigma / c), sigma its exact
        spectral norm; returns the sigmas (of W before the bound)."""
        from torch.nn.utils import parametrize

        sigmas = []
        for layer in self.layers:
            if not hasattr(layer, "parametrizations"):
                continue
            w = layer.parametrizations.weight.original.detach().clone()
            sigma = float(torch.linalg.matrix_norm(w.double(), ord=2))
            parametrize.remove_parametrizations(layer, "weight", leave_parametrized=False)
            layer.weight.copy_(w / max(1.0, sigma / self.bound))
            sigmas.append(sigma)
        return sigmas


class Sngp(FeatureHeadMethod):
    name = "sngp"
    POSTERIOR_SAMPLES = 64   # posterior draws of the GP layer for disagreement-based acquisition (BALD)
    settings_class = SngpSettings

    def __init__(self, encoder=None, **values):
        super().__init__(encoder, **values)
        self.network: SngpNetwork | None = None
        self.posterior: FullPosterior | None = None
        self.gp_summary: dict = {}

    # ------------------------------------------------------------------ build
    def _network(self, feature_dim: int, spectral: bool) -> SngpNetwork:
        generator = torch.Generator().manual_seed(self.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)   # torch's spectral_norm draws its power iteration's start from this RNG
            return SngpNetwork(feature_dim, self.hidden_dim, self.num_hidden_layers, self.num_random_features,
                               self.spec_norm_bound, generator, spectral).to(self.device)

    def _build(self, feature_dim: int) -> None:
        self.network = self._network(feature_dim, spectral=True)
        self.posterior = None

    # ------------------------------------------------------------------ train
    def loss(self, zc: torch.Tensor, zr: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, dict]:
        n = zc.shape[0]
        r = self.network(torch.cat([zc, zr]))   # one pass for chosen and rejected (one power iteration)
        bt, center = bradley_terry_loss(r[:n], r[n:], weight, normalise=True)
        return bt + self.center_gamma * center, {"loss_bt": bt.detach(), "loss_center": center.detach()}

    @torch.no_grad()
    def _fit_standardisation(self, zc: torch.Tensor, zr: torch.Tensor) -> float:
        """The training features' mean and sd (float64 sums over chosen and rejected, chunked; a constant dimension
        gets sd 1) into the network, then the median distance between training rows after the projection."""
        net = self.network
        total = torch.zeros(zc.shape[1], dtype=torch.float64, device=zc.device)
        for z in (zc, zr):
            for i in range(0, len(z), CHUNK):
                total += z[i:i + CHUNK].double().sum(0)
        mean = total / (2 * len(zc))
        squares = torch.zeros_like(total)
        for z in (zc, zr):
            for i in range(0, len(z), CHUNK):
                squares += (z[i:i + CHUNK].double() - mean).pow(2).sum(0)
        sd = (squares / (2 * len(zc))).sqrt()
        net.feature_mean.copy_(mean)
        net.feature_sd.copy_(torch.where(sd > 0, sd, torch.ones_like(sd)))
        rows = torch.randperm(2 * len(zc), generator=torch.Generator().manual_seed(self.seed))[:MEDIAN_ROWS]
        chosen, rejected = rows[rows < len(zc)], rows[rows >= len(zc)] - len(zc)   # of [zc; zr], without the copy
        sample = torch.cat([zc[chosen.to(zc.device)], zr[rejected.to(zr.device)]])
        h0 = net.standardise(sample) @ net.projection.T
        distances = torch.cdist(h0.double(), h0.double())
        off_diagonal = distances[~torch.eye(len(h0), dtype=torch.bool, device=h0.device)]
        median = float(off_diagonal.median()) if len(off_diagonal) else 1.0
        return median if median > 0 else 1.0

    def _fit_features(self, zc, zr, weight) -> None:
        net = self.network
        median = self._fit_standardisation(zc, zr)
        length_scale = self.gp_kernel_scale * median
        net.set_length_scale(length_scale)

        def batch_loss(index):
            return self.loss(zc[index], zr[index], weight[index])

        net.train()
        params = [*net.parameters(), *net.power_iteration_state()]   # the vectors ride along for checkpoints
        self._train_loop(params, batch_loss, len(zc), self.schedule, desc=f"{self.name} training")
        net.eval()
        sigmas = net.materialise()
        t0 = time.perf_counter()
        self._fit_posterior(zc, zr, weight)
        self.gp_summary = {"gp_length_scale": length_scale, "gp_median_distance": median,
                           "spectral_norms_before_bound": sigmas, **self.gp_summary,
                           "seconds_posterior": time.perf_counter() - t0}

    @torch.no_grad()
    def _fit_posterior(self, zc, zr, weight) -> None:
        """One pass over the training pairs: the GGN of the BT likelihood on the random-feature differences, then the
        prior precision (the number, or marglik's)."""
        beta = self.network.beta.detach().double()
        posterior = FullPosterior(self.num_random_features, device=beta.device)
        log_lik = 0.0
        for i in range(0, len(zc), CHUNK):
            d_phi = self.network.random_features(zc[i:i + CHUNK]) - self.network.random_features(zr[i:i + CHUNK])
            margin = d_phi.double() @ beta
            w = weight[i:i + CHUNK].double()
            p = torch.sigmoid(margin)
            posterior.accumulate(d_phi, w * p * (1 - p))
            log_lik += float((w * F.logsigmoid(margin)).sum())
        theta_sq = float(beta @ beta)
        posterior.apply_prior_precision(self.prior_precision, theta_sq)
        self.posterior = posterior
        self.gp_summary = {"prior_precision_used": posterior.prior_precision, "train_log_likelihood": log_lik}
        if self.prior_precision == MARGLIK:   # G's spectrum is known then; with a number it would cost an eigvalsh
            self.gp_summary |= {"log_marginal_likelihood": posterior.log_evidence(log_lik, theta_sq),
                                "effective_parameters": posterior.effective_parameters()}

    def fit(self, train, eval=None):  # noqa: A002
        self.gp_summary = {}
        super().fit(train, eval)
        self.fit_summary.update(self.gp_summary)   # set by _fit_features on rank 0
        return self

    # ------------------------------------------------------------------ score
    def _score_features(self, z):
        phi = self.network.random_features(z)
        reward = phi @ self.network.beta
        return reward, self.posterior.predictive_sd(phi).to(reward.dtype)

    def _sample_features(self, z: torch.Tensor) -> torch.Tensor:
        """Rewards under S draws of beta from its Laplace posterior (the same draws on every call)."""
        phi = self.network.random_features(z)
        offsets = self.posterior.sample_offsets(phi, self.POSTERIOR_SAMPLES, self.seed)
        return (phi @ self.network.beta).double()[None, :] + offsets

    # ------------------------------------------------------------------ saved state
    def state_tensors(self) -> dict[str, torch.Tensor]:
        if self.network.spectral:
            raise RuntimeError("SNGP is saved after training (its spectral norms materialised)")
        state = {f"network.{k}": v for k, v in self.network.state_dict().items()}
        state.update({f"posterior.{k}": v for k, v in self.posterior.tensors().items()})
        return state

    def expected_state(self, feature_dim, why: str) -> dict:
        """The standardisation (d,), the projection (h, d), per residual layer a (h, h) weight and (h,) bias, W_rf
        (D, h), b_rf and beta (D,), and the posterior's (D, D) precision and prior precision (1,)."""
        from rewarduq_exp.core.payload_bounds import Expected

        d, h, D = feature_dim, self.hidden_dim, self.num_random_features
        shapes = {"network.feature_mean": (d,), "network.feature_sd": (d,), "network.projection": (h, d),
                  "network.rf_weight": (D, h), "network.rf_bias": (D,), "network.beta": (D,)}
        for i in range(self.num_hidden_layers):
            shapes |= {f"network.layers.{i}.weight": (h, h), f"network.layers.{i}.bias": (h,)}
        why = (f"hidden_dim={h}, num_hidden_layers={self.num_hidden_layers}, num_random_features={D}, {why}")
        out = {name: Expected(shape, "f", why) for name, shape in shapes.items()}
        return out | {f"posterior.{k}": v for k, v in FullPosterior.expected(D, why).items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.network = self._network(tensors["network.projection"].shape[1], spectral=False)
        self.network.load_state_dict({k[len("network."):]: v for k, v in tensors.items() if k.startswith("network.")})
        self.network.eval()
        self.posterior = FullPosterior.from_tensors({k[len("posterior."):]: v for k, v in tensors.items()
                                                     if k.startswith("posterior.")}, device=self.device)

    # ------------------------------------------------------------------ memory
    @classmethod
    def head_memory(cls, ctx, feature_dim: int, batch: int):
        """The trained parts (residual layers, beta) with gradients and two AdamW states; the fixed parts (the
        projection, the random features, the standardisation); the activations of a batch; the posterior's three D x D
        float64 matrices (G, G + lambda I, its Cholesky factor) and one block of the curvature pass."""
        from rewarduq_exp.models.memory_plan import HeadMemory

        m, d, n = ctx.method, feature_dim, ctx.n_train
        h, layers, D = int(m.hidden_dim), int(m.num_hidden_layers), int(m.num_random_features)
        trainable = layers * (h * h + h) + D
        chunk = min(CHUNK, n)
        parts = {"SNGP residual layers and GP layer (weights, grads, AdamW x2)": 4 * trainable * 4,
                 "SNGP fixed projection and random features (float32)": (h * d + D * h + D + 2 * d) * 4,
                 "head activations": 2 * batch * (2 * d + h * (2 * layers + 1) + 2 * D) * 4,
                 "GP layer posterior D x D (float64: G, G + lambda I, Cholesky)": 3 * D * D * 8,
                 "curvature block (random features of 8192 pairs, float32 x2, float64 x2)":
                     chunk * D * (2 * 4 + 2 * 8)}
        forward = 2 * (d * h + layers * h * h + h * D + D)   # FLOPs a row
        flops = (3 * forward * 2 * n * float(m.num_epochs)   # training: forward and backward, two rows a pair
                 + forward * 2 * n + 2 * n * D * D           # the curvature pass
                 + D**3 / 3 + (9 * D**3 if m.prior_precision == MARGLIK else 0))   # Cholesky (+ eigvalsh)
        return HeadMemory(trainable, parts, flops)
