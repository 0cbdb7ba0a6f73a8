"""Distance-aware reward heads on frozen backbone features: a reward head r(z) and an uncertainty u = c * d(z), where
d is a raw distance of z from the training features (the k-NN distance of :mod:`~rewarduq_exp.methods.knn`, the
negative log density of :mod:`~rewarduq_exp.methods.ddu`) and c > 0 one scale that puts d into reward units.

**The scale** (:func:`fit_distance_scale`, written once for both methods). Our reading of "u in reward units": u is
the standard deviation of the error of the head's reward, growing in proportion to d. If the head's reward of a
response is its true reward plus an error of standard deviation c * d, independent between the two responses of a
pair, the Bradley-Terry probability that the chosen one wins, averaged over the errors, is by the probit
approximation of the logistic-normal integral (MacKay 1992)

    P(chosen wins) = sigmoid((r_c - r_r) / sqrt(1 + (pi / 8) c^2 (d_c^2 + d_r^2))).

c is the maximiser of this likelihood on pairs the head never trained on: a seeded random ``calibration_fraction`` of
the training pairs is held out; the head trains on the rest, the reference set (k-NN) or the density (DDU) is built
from the rest's features, and c is fitted on the held-out pairs' margins and distances, so both the head's errors
and the distances there are what they are on new data. (Training the head on all pairs and fitting c on a fold would
need a second training run for honest held-out margins, and a held-out feature that is also in the reference set is
its own nearest neighbour.) The search is over log c: a grid over twelve decades around the held-out pairs' typical
sqrt(d_c^2 + d_r^2), then Brent's method between the best grid point's neighbours (scipy's bounded
``minimize_scalar``), so c > 0 always; c at the bottom of the range means the held-out margins gain nothing from
widening (the head is not over-confident where it is far from its data), and u is then near 0.

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
from rewarduq_exp.methods.base import FeatureHeadMethod, bradley_terry_nll, weighted_mean
from rewarduq_exp.methods.ens_mlp import BatchedMLPHeads
from rewarduq_exp.methods.settings import AdamWSettings, FeatureHeadSettings, positive, setting

PROBIT = math.pi / 8.0
SCALE_DECADES = 6.0     # c * typical sqrt(d_c^2 + d_r^2) is searched in [1e-6, 1e6]
GRID_POINTS = 97        # 8 a decade
CHUNK = 8192            # rows standardised at once


@dataclass(frozen=True)
class ScaleFit:
    """The fitted scale ``c`` and the held-out pairs' weighted mean NLL with it and with c -> 0 (plain
    Bradley-Terry on the head's margins)."""

    c: float
    nll: float
    nll_at_zero: float
    pairs: int


def probit_nll(log_c: float, margin: np.ndarray, d2: np.ndarray, weight: np.ndarray) -> float:
    """Weighted mean of -log sigmoid(margin / sqrt(1 + (pi/8) c^2 d2)), c = exp(log_c) (the module docstring)."""
    z = margin / np.sqrt(1.0 + PROBIT * math.exp(2.0 * log_c) * d2)
    return float(np.sum(weight * np.logaddexp(0.0, -z)) / np.sum(weight))


def fit_distance_scale(margin, d_chosen, d_rejected, weight=None) -> ScaleFit:
    """The scale c > 0 that maximises the held-out pairs' likelihood
    sigmoid(m / sqrt(1 + (pi/8) c^2 (d_c^2 + d_r^2))) (module docstring), m = r_chosen - r_rejected of the head,
    d the raw distances of the two responses, ``weight`` the pair weights (a weight w counts as w copies)."""
    from scipy.optimize import minimize_scalar

    margin = np.asarray(margin, np.float64)
    d2 = np.asarray(d_chosen, np.float64) ** 2 + np.asarray(d_rejected, np.float64) ** 2
    weight = np.ones_like(margin) if weight is None else np.asarray(weight, np.float64)
    if not (margin.shape == d2.shape == weight.shape) or margin.ndim != 1 or len(margin) == 0:
        raise ValueError(f"margin {margin.shape}, distances {d2.shape} and weight {weight.shape} must be one "
                         "non-empty vector each")
    at_zero = float(np.sum(weight * np.logaddexp(0.0, -margin)) / np.sum(weight))   # c -> 0: plain Bradley-Terry
    positive_d = np.sqrt(d2[d2 > 0])
    if len(positive_d) == 0:   # every held-out response at distance 0: u is 0 whatever c is
        return ScaleFit(1.0, at_zero, at_zero, len(margin))
    centre = -math.log(float(np.median(positive_d)))
    span = SCALE_DECADES * math.log(10.0)
    grid = np.linspace(centre - span, centre + span, GRID_POINTS)
    values = [probit_nll(g, margin, d2, weight) for g in grid]
    best = int(np.argmin(values))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    found = minimize_scalar(probit_nll, bounds=(lo, hi), args=(margin, d2, weight), method="bounded",
                            options={"xatol": 1e-6})
    log_c, nll = (float(found.x), float(found.fun)) if found.fun <= values[best] else (float(grid[best]),
                                                                                         float(values[best]))
    return ScaleFit(math.exp(log_c), nll, at_zero, len(margin))


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
        self.scale: float = 1.0
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
        bt = weighted_mean(bradley_terry_nll(rc - rr), weight)
        center = weighted_mean((rc + rr).pow(2), weight)
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
                                            self.distance(zr[held_t]).numpy(), weight[held_t].double().cpu().numpy())
        self.scale = self.scale_fit.c

    def fit(self, train, eval=None):  # noqa: A002
        self.scale_fit = None
        super().fit(train, eval)
        self.fit_summary["u_scale"] = self.scale
        if self.scale_fit is not None:   # rank 0 (the others took its tensors)
            self.fit_summary.update({"scale_pairs": self.scale_fit.pairs, "scale_nll": self.scale_fit.nll,
                                     "scale_nll_at_zero": self.scale_fit.nll_at_zero})
        return self

    def _score_features(self, z):
        reward = self.rewards(z)
        u = self.scale * self.distance(z)
        return reward, u.to(reward.device)

    # ------------------------------------------------------------------ saved state
    def state_tensors(self) -> dict[str, torch.Tensor]:
        state = {f"head.{k}": v for k, v in self.head.state_dict().items()}
        state.update({"feature_mean": self.feature_mean, "feature_sd": self.feature_sd,
                      "scale": torch.tensor([self.scale], dtype=torch.float64)})
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
        shapes |= {"feature_mean": (feature_dim,), "feature_sd": (feature_dim,), "scale": (1,)}
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
        self._load_reference({k: v.to("cpu") for k, v in tensors.items()})
