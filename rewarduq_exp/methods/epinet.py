"""EPINET: an epistemic neural network reward head on frozen backbone features (issue 44).

Osband et al. 2023, "Epistemic neural networks" (NeurIPS), section 3 ("Epinet"); Dwaracherla et al. 2024, "Efficient
exploration for LLMs" (ICML), which used one as the reward model on frozen LLM embeddings. An ENN's output depends on
the input and on an epistemic index xi drawn from a reference distribution P_xi; the spread of the output over xi is
the model's epistemic uncertainty. Here (Osband et al., the epinet architecture of section 3,
f(x, z) = mu(x) + sigma(sg[phi(x)], z) with sigma = sigma_L + sigma_P):

    r(z, xi) = mu(z) + sigma_L(x~, xi) + prior_scale * sigma_P(x~, xi),     x~ = sg[[z, phi(z)]] or sg[phi(z)]

* mu: the base head, Linear(d,h)-ReLU-...-Linear(h,1) (ENS-MLP's member, one of it); phi(z) its last hidden layer.
  sg[.] is the stop-gradient: the epinet reads the base head's features but never moves them.
* sigma_L(x~, xi) = g([x~, xi])^T xi: the learnable epinet, g a small MLP of output size index_dim.
* sigma_P(x~, xi) = h(x~)^T xi: the prior network, index_dim small MLPs with fixed random weights (never trained).
  Where there is data, training makes sigma_L cancel the xi-dependent part of the prior; far from it nothing does,
  so the spread over xi stays (the randomised-prior idea of Osband et al. 2018 that section 3 builds on).
* x~ (``epinet_input``): ``features_and_hidden`` (default) x~ = sg[[z, phi(z)]], the frozen features beside the
  base head's hidden layer, as the MLP epinet of the authors' ENN library feeds it (its base MLP exposes the input
  and every hidden layer); ``hidden`` x~ = sg[phi(z)] alone. phi(z) alone hides what makes a response new: phi is
  trained to separate the training responses, and responses in directions of z training never saw map into the same
  range of phi, where sigma_L has already cancelled the prior. Trained on features confined to 8 of 16 dimensions
  (tests/test_epinet.py), u on points in the other 8 is 1.9x u inside with [z, phi] and 0.64x with phi alone.

Loss (Osband et al.: the ENN loss, averaged over a batch of sampled indices, + L2; Dwaracherla et al.: the ENN reward
model's Bradley-Terry loss with one index for both responses of a pair): for each batch, num_index_samples indices xi
are drawn and every pair is scored with the SAME xi for chosen and rejected (a joint prediction: r(z_c, xi) - r(z_r, xi)
is a margin under one sampled model), then the Bradley-Terry NLL is averaged over pairs and indices + reg_lambda * mean
squared trainable parameter (the L2 term; per parameter as ENS-MLP's anchor, so lambda means the same for any width) +
center_gamma * mean over indices of (r_c + r_r)^2 (ENS-MLP's eq. 11 centring, per index). The centring matters more here
than for ENS-MLP: a shift of every reward under one xi is invisible to every Bradley-Terry margin, so without it the
prior's per-index offset would never be cancelled and would add the same "uncertainty" to every response (on
tests/test_epinet.py's problem: u inside 2.33 with center_gamma = 0, offsets over indices of std 1.99, against 0.40
with 0.01).

Prediction: a fixed set of num_eval_indices indices, drawn once from the seed and saved with the weights (so chosen and
rejected, every call and a reloaded model use the same ones; one_hot uses each of its index_dim members once). reward =
mean over these indices, u = unbiased std over them, bounds reward ± beta * u (RewardUQ eq. 9; beta = 0.4 by default:
the spread over indices is set by the prior's scale, not by a posterior, and at ENS-MLP's beta = 2 the bounds were 6x
ENS-MLP's; the paper's selection rule applied to the interval's scale on the synthetic world's calibration split, never
an eval split, picked beta * s = 0.36-0.42 over seeds 0-2). The mean rather than mu(z) (the output at xi's mean, 0, for
gaussian and sphere): training fits r(., xi) for random xi, so the ENN's prediction is the average over xi, of which mu
alone is not (E[g([phi, xi])^T xi] != 0 in general); the mean also centres the bounds on the same draws u is the spread
of, works for one_hot (whose mean index is no member) and is what ENS-MLP does with its members. The eval indices are
also the draws BALD acquisition reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.setting_bounds import WIDTH, Bound
from rewarduq_exp.methods.base import FeatureHeadMethod
from rewarduq_exp.methods.ens_mlp import mlp_parameters, xavier_uniform
from rewarduq_exp.methods.losses import bradley_terry_loss
from rewarduq_exp.methods.settings import AdamWSettings, FeatureHeadSettings, one_of, positive, setting

INDEX_DISTRIBUTIONS = ("gaussian", "sphere", "one_hot")
EPINET_INPUTS = ("features_and_hidden", "hidden")   # x~ = [z, phi(z)] | phi(z)
MAX_INDEX_DRAWS = 10_000      # num_index_samples and num_eval_indices (their bounds say why)


def sample_indices(distribution: str, n: int, dim: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` indices (n, dim) from the reference distribution (on the CPU: the same draws on every device).

    gaussian: N(0, I) (Osband et al.'s epinet index); sphere: uniform on the sphere of radius sqrt(dim), the same
    second moment E[xi xi^T] = I as the gaussian without its spread of norms; one_hot: e_k for k uniform in
    0..dim-1, under which the epinet is an ensemble of dim members sharing the base head (Osband et al.'s ensemble
    as an ENN)."""
    if distribution == "one_hot":
        return torch.eye(dim)[torch.randint(dim, (n,), generator=generator)]
    xi = torch.randn(n, dim, generator=generator)
    if distribution == "sphere":
        xi = xi / xi.norm(dim=1, keepdim=True).clamp_min(1e-12) * math.sqrt(dim)
    return xi


class EpinetHead(nn.Module):
    """mu, sigma_L (parameters) and sigma_P (buffers) for features of size ``d``; every index of a call at once."""

    def __init__(self, d: int, hidden: int, layers: int, index_dim: int, epi_hidden: int, epi_layers: int,
                 prior_hidden: int, with_features: bool, generator: torch.Generator):
        super().__init__()
        self.with_features = with_features
        width = hidden + d if with_features else hidden     # the epinet's input x~: [z, phi(z)] or phi(z)
        # mu: one ENS-MLP head, built (and drawn from the generator) as ENS-MLP builds each of its heads; kept as 2-D
        # tensors and run with plain matrix products (``base``), whose rounding the epinet's numbers have always had
        weights, biases = mlp_parameters([d] + [hidden] * layers + [1], generator)
        self.base_w = nn.ParameterList([nn.Parameter(w) for w in weights[:-1]])
        self.base_b = nn.ParameterList([nn.Parameter(b) for b in biases])
        self.base_out = nn.Parameter(weights[-1])
        # g([phi, xi]): the first layer split into its phi and xi blocks, so that phi's product is computed once per
        # row and xi's once per index, and their sum broadcast to (S, B, e) (no (S, B, h + D) concatenation).
        weights, biases = mlp_parameters([width + index_dim] + [epi_hidden] * epi_layers + [index_dim], generator)
        self.epi_phi, self.epi_xi = nn.Parameter(weights[0][:width].clone()), nn.Parameter(weights[0][width:].clone())
        self.epi_w = nn.ParameterList([nn.Parameter(w) for w in weights[1:-1]])
        self.epi_b = nn.ParameterList([nn.Parameter(b) for b in biases])
        self.epi_out = nn.Parameter(weights[-1])
        # sigma_P: index_dim MLPs Linear(h, p)-ReLU-Linear(p, 1), stacked, fixed (buffers: no gradient, no optimizer)
        self.register_buffer("prior_w0", xavier_uniform(width, prior_hidden, generator, index_dim))
        self.register_buffer("prior_b0", (torch.rand(index_dim, prior_hidden, generator=generator) * 2 - 1)
                             / math.sqrt(width))   # random biases: a ReLU prior through the origin would vanish at 0
        self.register_buffer("prior_w1", xavier_uniform(prior_hidden, 1, generator, index_dim))

    def base(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu (B,), phi (B, h)) of features z (B, d)."""
        phi = z
        for w, b in zip(self.base_w, self.base_b):
            phi = torch.relu(torch.addmm(b, phi, w))
        return (phi @ self.base_out).squeeze(-1), phi

    def forward(self, z: torch.Tensor, xi: torch.Tensor, prior_scale: float) -> torch.Tensor:
        """Rewards (S, B) of features z (B, d) under each of the indices xi (S, D)."""
        mu, phi = self.base(z)
        x = torch.cat([z, phi.detach()], dim=1) if self.with_features else phi.detach()   # x~ = sg[...]
        h = torch.relu((x @ self.epi_phi)[None] + (xi @ self.epi_xi + self.epi_b[0])[:, None])   # (S, B, e)
        for w, b in zip(self.epi_w, self.epi_b[1:]):
            h = torch.relu(h @ w + b)
        sigma_learn = torch.einsum("sbd,sd->sb", h @ self.epi_out, xi)            # g([x~, xi])^T xi
        prior = torch.relu(torch.einsum("bh,khp->kbp", x, self.prior_w0) + self.prior_b0[:, None])
        prior = torch.bmm(prior, self.prior_w1).squeeze(-1)                        # h(x~): (D, B), once per row
        return mu[None] + sigma_learn + prior_scale * (xi @ prior)                 # + h(x~)^T xi


@dataclass(kw_only=True)
class EpinetSettings(FeatureHeadSettings, AdamWSettings, config="epinet"):
    """Defaults and comments: ``conf/method/epinet.yaml``."""

    hidden_dim: int = setting(bound=Bound(1, WIDTH, "units", "the base head is an ENS-MLP head; 128 by default"),
                              doc="base head mu's width")
    num_hidden_layers: int = setting(bound=Bound(1, 256, "layers", "each layer is a hidden_dim^2 matrix"),
                                     doc="base head mu's depth")
    index_dim: int = setting(bound=Bound(1, 1024, "dimensions", "the epinet papers use 8-30; g's output, "
                                         "the prior ensemble and each index grow with it"),
                             doc="D: size of the epistemic index xi")
    index_distribution: str = setting(check=one_of(INDEX_DISTRIBUTIONS), doc="reference distribution of xi")
    epinet_hidden_dim: int = setting(bound=Bound(1, WIDTH, "units", "the epinet is a small MLP; 64 by default"),
                                     doc="width of the learnable epinet g")
    epinet_num_hidden_layers: int = setting(bound=Bound(1, 256, "layers", "each layer is an epinet_hidden_dim^2 "
                                                        "matrix"), doc="hidden layers of g")
    prior_hidden_dim: int = setting(bound=Bound(1, WIDTH, "units", "index_dim prior MLPs of this width"),
                                    doc="width of each fixed prior MLP")
    prior_scale: float = setting(check=positive(inclusive=True), doc="weight of the prior network (0: none)")
    epinet_input: str = setting(check=one_of(EPINET_INPUTS), doc="what the epinet and the prior read")
    num_index_samples: int = setting(bound=Bound(1, MAX_INDEX_DRAWS, "indices", "each is one more copy of the "
                                                 "epinet's activations of every training row"),
                                     doc="indices drawn per training batch")
    num_eval_indices: int = setting(bound=Bound(2, MAX_INDEX_DRAWS, "indices", "each is one more copy of the "
                                                "epinet's activations of every scored row"),
                                    doc="fixed indices for prediction")
    reg_lambda: float = setting(check=positive(inclusive=True), doc="L2 x mean squared trainable parameter")
    center_gamma: float = setting(check=positive(inclusive=True), doc="gamma: mean (r_c + r_r)^2 over indices")
    beta: float = setting(check=positive(), doc="bounds reward +- beta * u")

    def validate(self) -> None:
        super().validate()
        if self.index_distribution == "one_hot" and self.index_dim < 2:
            raise UserError("method.index_dim=1 with method.index_distribution=one_hot is one member, which has no "
                            "spread: use index_dim >= 2")


class Epinet(FeatureHeadMethod):
    name = "epinet"
    settings_class = EpinetSettings

    def __init__(self, encoder=None, **values):
        super().__init__(encoder, **values)
        self.net: EpinetHead | None = None

    @property
    def eval_draws(self) -> int:
        """How many indices prediction averages over: every member once for one_hot, else num_eval_indices."""
        return self.index_dim if self.index_distribution == "one_hot" else self.num_eval_indices

    # ------------------------------------------------------------------ sizes
    @staticmethod
    def _sizes(m, d: int) -> tuple[int, int]:
        """(trainable parameters, prior buffer elements) for settings ``m`` and features of size ``d``."""
        h, nh, k = int(m.hidden_dim), int(m.num_hidden_layers), int(m.index_dim)
        e, ne, p = int(m.epinet_hidden_dim), int(m.epinet_num_hidden_layers), int(m.prior_hidden_dim)
        width = h + d if m.epinet_input == "features_and_hidden" else h
        base = d * h + (nh - 1) * h * h + nh * h + h
        epinet = (width + k) * e + (ne - 1) * e * e + ne * e + e * k
        return base + epinet, k * (width * p + p + p)

    @classmethod
    def head_memory(cls, ctx, feature_dim: int, batch: int):
        """Base head and epinet with gradients and two AdamW states (4 x 4 bytes a parameter), the fixed prior and
        the eval indices, and the larger of two activation peaks (they never coexist; each is counted in (S, rows, e)
        tensors of the epinet, the rest is small beside them):

        * a training step on 2B rows and S = num_index_samples: the base head's pre-activation and ReLU output per
          layer, the epinet's ReLU output per hidden layer kept for backward plus two more alive at the peak (as
          ENS-MLP's K heads), its (S, 2B, D) output, the prior's (D, 2B, p) twice. Measured: 0.92 of this at the
          tiny model with S = 64, e = 512 (tests/test_plan_memory.py).
        * scoring a chunk of score_batch_size rows (at most the eval pairs) under the S_eval fixed indices, without
          gradients: min(layers, 2) + 1 tensors alive (3.1 measured with 2 layers, 2.1 with 1, 3.1 with 3), while
          fit still holds the train features (the eval set is scored inside fit).
        """
        from rewarduq_exp.models.memory_plan import HeadMemory

        m = ctx.method
        trainable, prior = cls._sizes(m, feature_dim)
        h, nh, k = int(m.hidden_dim), int(m.num_hidden_layers), int(m.index_dim)
        e, ne, p, s = (int(m.epinet_hidden_dim), int(m.epinet_num_hidden_layers), int(m.prior_hidden_dim),
                       int(m.num_index_samples))
        parts = {"EPINET base head and epinet (weights, grads, AdamW x2)": 4 * trainable * 4,
                 "EPINET prior networks (fixed) and eval indices": (prior + cls._eval_count(m) * k) * 4}
        if float(m.reg_lambda) > 0:
            parts["L2 penalty (p^2, kept for backward)"] = trainable * 4
        rows = 2 * batch
        train = (rows * (feature_dim + 2 * h * nh) + s * rows * ((ne + 2) * e + 2 * k) + 2 * k * rows * p) * 4
        chunk = int(m.score_batch_size)
        chunk = min(chunk, ctx.n_eval) if ctx.n_eval else chunk
        score = (chunk * (feature_dim + 2 * h) + cls._eval_count(m) * chunk * ((min(ne, 2) + 1) * e + 2 * k)
                 + 2 * k * chunk * p) * 4
        if train >= score:
            parts[f"head activations (training step: {rows} rows x {s} indices)"] = train
        else:
            parts[f"head activations (scoring: {chunk} rows x {cls._eval_count(m)} indices)"] = score
        # forward + backward ~ 3 x 2 FLOPs a weight a row: the base head once per row, the epinet's g once per row
        # and index; the prior (forward only) once per row.
        base = feature_dim * h + (nh - 1) * h * h + h
        g = trainable - base - nh * h
        flops = (6 * base + 6 * s * g + 2 * prior) * 2 * ctx.n_train * float(m.num_epochs)
        return HeadMemory(trainable, parts, flops)

    @staticmethod
    def _eval_count(m) -> int:
        return int(m.index_dim) if m.index_distribution == "one_hot" else int(m.num_eval_indices)

    # ------------------------------------------------------------------ build, train, score
    def _build(self, feature_dim: int) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        self.net = EpinetHead(feature_dim, self.hidden_dim, self.num_hidden_layers, self.index_dim,
                              self.epinet_hidden_dim, self.epinet_num_hidden_layers, self.prior_hidden_dim,
                              self.epinet_input == "features_and_hidden", generator).to(self.device)
        # The fixed eval indices, drawn from the seed after the weights (a second generator would repeat the first's
        # numbers); for one_hot every member once, in order (the exact mean over the uniform reference distribution).
        if self.index_distribution == "one_hot":
            index = torch.eye(self.index_dim)
        else:
            index = sample_indices(self.index_distribution, self.num_eval_indices, self.index_dim, generator)
        self.eval_index = index.to(self.device)

    def rewards(self, z: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
        """Rewards (S, B) of features z (B, d) under indices xi (S, index_dim)."""
        return self.net(z, xi, self.prior_scale)

    def l2_penalty(self) -> torch.Tensor:
        """Mean squared trainable parameter (the ENN loss's L2 term, per parameter)."""
        params = list(self.net.parameters())
        return sum(p.pow(2).sum() for p in params) / sum(p.numel() for p in params)

    def loss(self, zc: torch.Tensor, zr: torch.Tensor, weight: torch.Tensor,
             xi: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        if xi is None:
            # From torch's global CPU generator: seeded by fit, saved and restored by the training checkpoints, so a
            # resumed run draws the indices an uninterrupted one would.
            xi = sample_indices(self.index_distribution, self.num_index_samples, self.index_dim).to(zc.device)
        n = zc.shape[0]
        rewards = self.rewards(torch.cat([zc, zr]), xi)   # (S, 2B): chosen and rejected under the same xi
        bt, center = bradley_terry_loss(rewards[:, :n], rewards[:, n:], weight, normalise=True,
                                        mean_over_members=True)   # the mean over the S indices
        l2 = self.l2_penalty() if self.reg_lambda > 0 else torch.zeros((), device=zc.device)
        total = bt + self.reg_lambda * l2 + self.center_gamma * center
        return total, {"loss_bt": bt.detach(), "loss_l2": l2.detach(), "loss_center": center.detach()}

    def _fit_features(self, zc, zr, weight) -> None:
        def batch_loss(index):
            return self.loss(zc[index], zr[index], weight[index])

        self._train_loop(self.net.parameters(), batch_loss, len(zc), self.schedule, desc=f"{self.name} training")

    def _score_features(self, z):
        rewards = self.rewards(z, self.eval_index)
        return rewards.mean(0), rewards.std(0, unbiased=True)

    def _sample_features(self, z: torch.Tensor) -> torch.Tensor:
        return self.rewards(z, self.eval_index)   # the same fixed indices for every row: joint draws

    # ------------------------------------------------------------------ saved state
    def state_tensors(self) -> dict[str, torch.Tensor]:
        # The prior and the eval indices are saved although the seed rebuilds them: a reloaded model scores with the
        # very same numbers whatever generator a later torch has.
        return {**{f"net.{k}": v for k, v in self.net.state_dict().items()}, "eval_index": self.eval_index}

    def expected_state(self, feature_dim, why: str) -> dict:
        """The tensors of :meth:`state_tensors` for features of ``feature_dim`` and these hyperparameters."""
        from rewarduq_exp.core.payload_bounds import Expected

        h, k, e, p = self.hidden_dim, self.index_dim, self.epinet_hidden_dim, self.prior_hidden_dim
        why = (f"hidden_dim={h}, num_hidden_layers={self.num_hidden_layers}, index_dim={k}, epinet_hidden_dim={e}, "
               f"epinet_num_hidden_layers={self.epinet_num_hidden_layers}, prior_hidden_dim={p}, "
               f"epinet_input={self.epinet_input}, index_distribution={self.index_distribution}, "
               f"num_eval_indices={self.num_eval_indices}, {why}")
        dims = [feature_dim] + [h] * self.num_hidden_layers
        shapes = {f"net.base_w.{i}": (a, b) for i, (a, b) in enumerate(zip(dims[:-1], dims[1:]))}
        shapes |= {f"net.base_b.{i}": (h,) for i in range(self.num_hidden_layers)}
        width = h
        if self.epinet_input == "features_and_hidden":   # an AtMost feature dimension bounds the sum
            width = h + feature_dim if isinstance(feature_dim, int) else type(feature_dim)(h + feature_dim.n)
        shapes |= {"net.base_out": (h, 1), "net.epi_phi": (width, e), "net.epi_xi": (k, e), "net.epi_out": (e, k)}
        shapes |= {f"net.epi_w.{i}": (e, e) for i in range(self.epinet_num_hidden_layers - 1)}
        shapes |= {f"net.epi_b.{i}": (e,) for i in range(self.epinet_num_hidden_layers)}
        shapes |= {"net.prior_w0": (k, width, p), "net.prior_b0": (k, p), "net.prior_w1": (k, p, 1),
                   "eval_index": (self.eval_draws, k)}
        return {name: Expected(shape, "f", why) for name, shape in shapes.items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self._build(tensors["net.base_w.0"].shape[0])
        self.net.load_state_dict({k[len("net."):]: v for k, v in tensors.items() if k.startswith("net.")})
        index = tensors["eval_index"]
        if tuple(index.shape) != tuple(self.eval_index.shape):
            raise ValueError(f"eval_index is {tuple(index.shape)}, expected {tuple(self.eval_index.shape)}")
        self.eval_index = index.to(self.device, torch.float32)
