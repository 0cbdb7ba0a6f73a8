"""Distance-aware reward heads on frozen backbone features: a reward head r(z) and an uncertainty u = c * d(z), where
d is a raw distance of z from the training features (the k-NN distance of :mod:`~rewarduq_exp.methods.knn`, the
negative log density of :mod:`~rewarduq_exp.methods.ddu`) and c > 0 one scale that puts d into reward units.

**The scales** (:func:`fit_distance_scale`, written once for both methods), fitted on pairs the head never trained on:
a seeded random ``calibration_fraction`` of the training pairs is held out; the head trains on the rest, the reference
set (k-NN) or the density (DDU) is built from the rest's features, and the scales come from the held-out pairs'
margins and distances, so the head's errors and the distances there are what they are on new data. (Training on all
pairs and fitting on a fold would need a second training run for honest held-out margins, and a held-out feature
that is also in the reference set is its own nearest neighbour.)

* The reward is a r, r the head's output and a > 0 the maximiser of the held-out pairs' Bradley-Terry likelihood
  sigmoid(a (r_c - r_r)): a temperature, so the reward's probabilities are calibrated; it ranks nothing differently
  (the win rate is the head's).
* u = c d, c the smallest scale at which the bounds a r +- beta c d call at most ``cf_target`` (5 %) of the held-out
  pairs confidently wrong (their intervals apart, the wrong way round): u is in reward units by construction, and the
  distance decides which responses get the wide intervals. A pair the head ranks wrong stops being confidently wrong
  once c >= -a m / (beta (d_c + d_r)), so c is a weighted quantile of these thresholds (no search).

Our first reading fitted c by the likelihood instead (u the standard deviation of the reward's error, growing with d;
by the probit approximation P = sigmoid(a m / sqrt(1 + (pi/8) c^2 (d_c^2 + d_r^2)))). On the synthetic worlds it put c
at the bottom of its range: within the training distribution the distance does not predict where the head errs, so
the likelihood gains nothing from widening, u was about 0 and the raw bounds called 37-48 % of the filler world's
pairs confidently wrong. The bounds' own risk gives u a usable size whatever the likelihood says; whether the
distance *also* finds the far-off responses where a shortcut misleads the head is what the downstream studies ask.

Bounds are reward +- beta * u (RewardUQ eq. 9); with u a standard deviation of the reward, beta = 1 is one of them.

**The head** is one MLP Linear(d,h)-ReLU-...-Linear(h,1) (ENS-MLP's member, :class:`~rewarduq_exp.methods.ens_mlp.
BatchedMLPHeads` with one head) trained by the one training loop on the Bradley-Terry NLL + center_gamma * mean
(r_c + r_r)^2 (ENS-MLP's centring: a shift of every reward changes no margin). It reads the raw features, as ENS-MLP;
the distances read them standardised by the training features' mean and standard deviation (saved), so that a
hidden state's few huge dimensions do not decide the distance alone.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.setting_bounds import WIDTH, Bound
from rewarduq_exp.methods.base import FeatureHeadMethod
from rewarduq_exp.methods.ens_mlp import BatchedMLPHeads
from rewarduq_exp.methods.losses import bradley_terry_loss
from rewarduq_exp.methods.settings import AdamWSettings, FeatureHeadSettings, positive, setting

REWARD_DECADES = 3.0    # the reward scale a is searched in [1e-3, 1e3] (separable held-out pairs push it to the top)
CHUNK = 8192            # rows standardised at once


@dataclass(frozen=True)
class ScaleFit:
    """The fitted reward scale ``a`` and distance scale ``c`` on ``pairs`` held-out pairs: the weighted mean
    Bradley-Terry NLL with a (``nll``) and with the head as trained (``nll_as_trained``, a = 1), the share of them the
    bounds call confidently wrong at c (``cf_held_out``) against the target (``cf_target``), and ``feasible``: False
    when more than the target are wrong at distance 0 (no c can help them), c is then the largest finite threshold."""

    a: float
    c: float
    nll: float
    nll_as_trained: float
    cf_target: float
    cf_held_out: float
    feasible: bool
    pairs: int


def bt_nll(log_a: float, margin: np.ndarray, weight: np.ndarray) -> float:
    """Weighted mean of -log sigmoid(a m), a = exp(log_a): the held-out pairs' Bradley-Terry NLL at reward scale a."""
    return float(np.sum(weight * np.logaddexp(0.0, -math.exp(log_a) * margin)) / np.sum(weight))


def cf_thresholds(margin: np.ndarray, d_sum: np.ndarray, beta: float) -> np.ndarray:
    """t_i of each held-out pair: with bounds r +- beta c d, pair i is confidently wrong (its two intervals apart,
    the wrong way round) exactly when c < t_i = -m_i / (beta (d_c + d_r)); 0 for a pair ranked right, inf for a
    wrong pair at distance 0 (no c widens it)."""
    t = np.zeros(len(margin))
    wrong = margin < 0
    with np.errstate(divide="ignore"):
        t[wrong] = np.where(d_sum[wrong] > 0, -margin[wrong] / (beta * np.where(d_sum[wrong] > 0, d_sum[wrong], 1.0)),
                            np.inf)
    return t


def fit_distance_scale(margin, d_chosen, d_rejected, weight=None, *, beta: float = 1.0,
                       cf_target: float = 0.05) -> ScaleFit:
    """The reward scale a and the distance scale c of the held-out pairs (module docstring): a > 0 maximises their
    Bradley-Terry likelihood sigmoid(a m) (bounded Brent search over log a in [1e-3, 1e3]); c is the smallest scale at
    which the bounds a r +- beta c d call at most ``cf_target`` of them (by weight) confidently wrong. ``margin``: the
    head's r_chosen - r_rejected, ``d_*``: the raw distances, ``weight``: the pair weights (a weight w counts as w
    copies)."""
    from scipy.optimize import minimize_scalar

    margin = np.asarray(margin, np.float64)
    d_sum = np.asarray(d_chosen, np.float64) + np.asarray(d_rejected, np.float64)
    weight = np.ones_like(margin) if weight is None else np.asarray(weight, np.float64)
    if not (margin.shape == d_sum.shape == weight.shape) or margin.ndim != 1 or len(margin) == 0:
        raise ValueError(f"margin {margin.shape}, distances {d_sum.shape} and weight {weight.shape} must be one "
                         "non-empty vector each")
    span = REWARD_DECADES * math.log(10.0)
    found = minimize_scalar(bt_nll, bounds=(-span, span), args=(margin, weight), method="bounded",
                            options={"xatol": 1e-8})
    a = math.exp(float(found.x))
    t = cf_thresholds(a * margin, d_sum, beta)
    order = np.argsort(-t, kind="stable")                    # descending thresholds
    lost = np.cumsum(weight[order]) / weight.sum()           # share lost at any c below the threshold at each place
    # the smallest c = t_(k) such that the pairs with t_i > c weigh at most cf_target: c is the first threshold
    # (descending) whose strictly larger ones stay within the target
    above = np.concatenate([[0.0], lost[:-1]])                # weight share of the thresholds before each place
    ok = np.flatnonzero(above <= cf_target + 1e-12)
    pick = t[order][ok[-1]]
    finite = t[np.isfinite(t)]
    feasible = bool(np.isfinite(pick))
    c = float(pick) if feasible else float(finite.max(initial=0.0))
    c = max(c, 0.0)
    cf = float(np.sum(weight[t > c]) / weight.sum())
    return ScaleFit(a, c, float(found.fun), bt_nll(0.0, margin, weight), float(cf_target), cf, feasible, len(margin))


def held_out_count(n: int, fraction: float) -> int:
    """How many of ``n`` >= 2 training pairs :func:`calibration_split` holds out: ``fraction`` of them, rounded, at
    least one and at most n - 1."""
    return min(max(int(round(fraction * n)), 1), n - 1)


def calibration_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, held-out rows) of ``n`` pairs: a seeded random ``fraction`` held out (at least one pair each
    side), both sorted."""
    if n < 2:
        raise UserError(f"a distance-aware head needs at least 2 training pairs (one to train on, one to fit the "
                        f"scale of u on); got {n}")
    held = held_out_count(n, fraction)
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[held:]), np.sort(order[:held])


def _fraction(value, key):
    from rewarduq_exp.core.checks import check_positive

    value = float(check_positive(value, key))
    if not value < 1:
        raise UserError(f"{key}={value!r} is invalid: must be in (0, 1)")
    return value


@dataclass(kw_only=True)
class DistanceHeadSettings(FeatureHeadSettings, AdamWSettings):
    """What the k-NN and DDU heads share (each names its own config)."""

    hidden_dim: int = setting(bound=Bound(1, WIDTH, "units", "one ENS-MLP head; 128 by default"),
                              doc="the reward head's width")
    num_hidden_layers: int = setting(bound=Bound(1, 256, "layers", "each layer is a hidden_dim^2 matrix"),
                                     doc="the reward head's depth")
    center_gamma: float = setting(check=positive(inclusive=True), doc="gamma: mean (r_c + r_r)^2")
    calibration_fraction: float = setting(check=_fraction, doc="share of the training pairs held out to fit u's "
                                                                "scale")
    cf_target: float = setting(check=_fraction, doc="u's scale: the held-out pairs' bounds are confidently wrong "
                                                    "on at most this share")
    beta: float = setting(check=positive(), doc="bounds reward +- beta * u")


class DistanceScaledHead(FeatureHeadMethod):
    """A reward head plus u = c * d(z) (module docstring). A subclass implements the raw distance: ``_fit_reference``
    (from the standardised training features), ``_raw_distance`` (of standardised features), and the tensors, shapes
    and memory of what it keeps."""

    name = "distance_head"
    settings_class = DistanceHeadSettings

    def __init__(self, encoder=None, **values):
        super().__init__(encoder, **values)
        self.head: BatchedMLPHeads | None = None
        self.feature_mean: torch.Tensor | None = None   # float64 (d,), of the reference features
        self.feature_sd: torch.Tensor | None = None
        self.scale: float = 1.0          # c: u = c * d
        self.reward_scale: float = 1.0   # a: reward = a * the head's output
        self.scale_fit: ScaleFit | None = None

    # ------------------------------------------------------------------ what a subclass implements
    @abstractmethod
    def _fit_reference(self, zc: torch.Tensor, zr: torch.Tensor, rows: np.ndarray) -> None:
        """Build the distance from the training features ``rows`` (sorted indices into the stacked [zc; zr]: chosen
        and rejected of the pairs the head trains on); :meth:`standardised` gives them standardised."""

    @abstractmethod
    def _raw_distance(self, x: torch.Tensor) -> torch.Tensor:
        """The raw distance d (B,) float64 of standardised features ``x`` (B, d) float64, on the CPU."""

    @abstractmethod
    def _reference_tensors(self) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def _load_reference(self, tensors: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def _expected_reference(self, feature_dim, why: str) -> dict: ...

    @classmethod
    @abstractmethod
    def _reference_memory(cls, ctx, feature_dim: int, rows: int) -> tuple[dict[str, float], float]:
        """({part: bytes}, FLOPs) of building and using the distance on ``rows`` standardised training features."""

    # ------------------------------------------------------------------ sizes
    @staticmethod
    def _head_params(m, d: int) -> int:
        h, nh = int(m.hidden_dim), int(m.num_hidden_layers)
        return d * h + (nh - 1) * h * h + h + nh * h

    @staticmethod
    def _fit_pairs(m, n: int) -> int:
        """Pairs the head trains on, of ``n`` training pairs (the rest fit the scale: :func:`calibration_split`)."""
        return n if n < 2 else n - held_out_count(n, float(m.calibration_fraction))

    @classmethod
    def head_memory(cls, ctx, feature_dim: int, batch: int):
        """The head with gradients and two AdamW states, its activations (ENS-MLP's count for one head), and what
        the distance keeps (:meth:`_reference_memory`, on the training part's rows). The distance lives in host
        memory (scikit-learn) whatever the device: counted in the peak all the same, an overestimate on a GPU."""
        from rewarduq_exp.models.memory_plan import HeadMemory

        m, d = ctx.method, feature_dim
        h, nh = int(m.hidden_dim), int(m.num_hidden_layers)
        trainable = cls._head_params(m, d)
        parts = {f"{cls.name.upper()} reward head (weights, grads, AdamW x2)": 4 * trainable * 4,
                 "head activations": 2 * batch * (d + h * (nh + 2)) * 4}
        extra, flops = cls._reference_memory(ctx, d, 2 * cls._fit_pairs(m, ctx.n_train))
        parts.update(extra)
        return HeadMemory(trainable, parts, 6 * trainable * 2 * ctx.n_train * float(m.num_epochs) + flops)

    # ------------------------------------------------------------------ build, train, score
    def _build(self, feature_dim: int) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        self.head = BatchedMLPHeads(1, feature_dim, self.hidden_dim, self.num_hidden_layers, 1.0,
                                    generator).to(self.device)

    def rewards(self, z: torch.Tensor) -> torch.Tensor:
        return self.head(z)[0]

    def loss(self, zc: torch.Tensor, zr: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, dict]:
        n = zc.shape[0]
        r = self.rewards(torch.cat([zc, zr]))   # one pass for chosen and rejected
        rc, rr = r[:n], r[n:]
        bt, center = bradley_terry_loss(rc, rr, weight, normalise=True)
        return bt + self.center_gamma * center, {"loss_bt": bt.detach(), "loss_center": center.detach()}

    def standardise(self, z: torch.Tensor) -> torch.Tensor:
        """(z - mean) / sd of the training features, float64 on the CPU."""
        return (z.detach().to("cpu", torch.float64) - self.feature_mean) / self.feature_sd

    def distance(self, z: torch.Tensor) -> torch.Tensor:
        """The raw distance d (B,) float64 of features ``z`` (B, d), before the scale, ``CHUNK`` rows at a time."""
        if len(z) == 0:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([self._raw_distance(self.standardise(z[i:i + CHUNK])) for i in range(0, len(z), CHUNK)])

    def _chunks(self, zc: torch.Tensor, zr: torch.Tensor, rows: np.ndarray):
        """The features of ``rows`` (sorted indices into the stacked [zc; zr]) in chunks of ``CHUNK`` rows, in order,
        without a copy of all of them."""
        n = len(zc)
        for start in range(0, len(rows), CHUNK):
            r = rows[start:start + CHUNK]
            c, q = r[r < n], r[r >= n] - n   # sorted: a chunk's chosen rows come before its rejected ones
            yield torch.cat([zc[torch.as_tensor(c, device=zc.device)], zr[torch.as_tensor(q, device=zr.device)]])

    def standardised(self, zc: torch.Tensor, zr: torch.Tensor, rows: np.ndarray,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The standardised features of ``rows`` (sorted indices into [zc; zr]) as one (len(rows), d) CPU tensor of
        ``dtype``, filled chunk by chunk."""
        out = torch.empty(len(rows), zc.shape[1], dtype=dtype)
        at = 0
        for chunk in self._chunks(zc, zr, rows):
            out[at:at + len(chunk)] = self.standardise(chunk).to(dtype)
            at += len(chunk)
        return out

    def _fit_moments(self, zc: torch.Tensor, zr: torch.Tensor, rows: np.ndarray) -> None:
        """Mean and standard deviation (float64, two passes, chunked) of the features of ``rows``; a constant
        dimension gets sd 1."""
        total = torch.zeros(zc.shape[1], dtype=torch.float64)
        for chunk in self._chunks(zc, zr, rows):
            total += chunk.to("cpu", torch.float64).sum(0)
        self.feature_mean = total / len(rows)
        squares = torch.zeros_like(total)
        for chunk in self._chunks(zc, zr, rows):
            squares += (chunk.to("cpu", torch.float64) - self.feature_mean).pow(2).sum(0)
        sd = (squares / len(rows)).sqrt()
        self.feature_sd = torch.where(sd > 0, sd, torch.ones_like(sd))

    def _fit_features(self, zc, zr, weight) -> None:
        train, held = calibration_split(len(zc), self.calibration_fraction, self.seed)
        train_t = torch.as_tensor(train, device=zc.device)

        def batch_loss(index):
            rows = train_t[index]   # no copy of the training part: its rows are picked per batch
            return self.loss(zc[rows], zr[rows], weight[rows])

        self._train_loop(self.head.parameters(), batch_loss, len(train), self.schedule, desc=f"{self.name} training")
        # the standardisation and the distance: from the features the head trained on, chosen and rejected
        rows = np.concatenate([train, train + len(zc)])
        self._fit_moments(zc, zr, rows)
        self._fit_reference(zc, zr, rows)
        # the scale, on the held-out pairs
        held_t = torch.as_tensor(held, device=zc.device)
        with torch.no_grad():
            margin = (self.rewards(zc[held_t]) - self.rewards(zr[held_t])).double().cpu().numpy()
        self.scale_fit = fit_distance_scale(margin, self.distance(zc[held_t]).numpy(),
                                            self.distance(zr[held_t]).numpy(), weight[held_t].double().cpu().numpy(),
                                            beta=self.beta, cf_target=self.cf_target)
        self.scale, self.reward_scale = self.scale_fit.c, self.scale_fit.a

    def fit(self, train, eval=None):  # noqa: A002
        self.scale_fit = None
        super().fit(train, eval)
        self.fit_summary["u_scale"] = self.scale
        self.fit_summary["reward_scale"] = self.reward_scale
        if self.scale_fit is not None:   # rank 0 (the others took its tensors)
            self.fit_summary.update({"scale_pairs": self.scale_fit.pairs, "scale_nll": self.scale_fit.nll,
                                     "scale_nll_as_trained": self.scale_fit.nll_as_trained,
                                     "scale_cf_held_out": self.scale_fit.cf_held_out,
                                     "scale_feasible": self.scale_fit.feasible})
        return self

    def _score_features(self, z):
        reward = self.reward_scale * self.rewards(z)
        u = self.scale * self.distance(z)
        return reward, u.to(reward.device)

    # ------------------------------------------------------------------ saved state
    def state_tensors(self) -> dict[str, torch.Tensor]:
        state = {f"head.{k}": v for k, v in self.head.state_dict().items()}
        state.update({"feature_mean": self.feature_mean, "feature_sd": self.feature_sd,
                      "scale": torch.tensor([self.scale], dtype=torch.float64),
                      "reward_scale": torch.tensor([self.reward_scale], dtype=torch.float64)})
        state.update(self._reference_tensors())
        return state

    def expected_state(self, feature_dim, why: str) -> dict:
        """The head's (1, fan_in, fan_out) weights and (1, hidden) biases, the standardisation's (d,) mean and sd, the
        scale (1,), and the distance's own tensors (:meth:`_expected_reference`)."""
        from rewarduq_exp.core.payload_bounds import Expected

        h = self.hidden_dim
        head_why = f"hidden_dim={h}, num_hidden_layers={self.num_hidden_layers}, {why}"
        dims = [feature_dim] + [h] * self.num_hidden_layers + [1]
        shapes = {f"head.weights.{i}": (1, a, b) for i, (a, b) in enumerate(zip(dims[:-1], dims[1:]))}
        shapes |= {f"head.biases.{i}": (1, h) for i in range(self.num_hidden_layers)}
        shapes |= {"feature_mean": (feature_dim,), "feature_sd": (feature_dim,), "scale": (1,), "reward_scale": (1,)}
        out = {name: Expected(shape, "f", head_why) for name, shape in shapes.items()}
        return out | self._expected_reference(feature_dim, why)

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self._build(tensors["head.weights.0"].shape[1])
        self.head.load_state_dict({k[len("head."):]: v for k, v in tensors.items() if k.startswith("head.")})
        self.feature_mean = tensors["feature_mean"].to("cpu", torch.float64)
        self.feature_sd = tensors["feature_sd"].to("cpu", torch.float64)
        d = self.head.weights[0].shape[1]
        if self.feature_mean.shape != (d,) or self.feature_sd.shape != (d,):
            raise ValueError(f"feature_mean / feature_sd are {tuple(self.feature_mean.shape)} / "
                             f"{tuple(self.feature_sd.shape)}, expected ({d},)")
        self.scale = float(tensors["scale"].reshape(-1)[0])
        self.reward_scale = float(tensors["reward_scale"].reshape(-1)[0])
        self._load_reference({k: v.to("cpu") for k, v in tensors.items()})
