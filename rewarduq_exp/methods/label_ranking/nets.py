"""The two label rankers whose model is an MLP from the features (appendix C): Plackett-Luce (PL) and the
RankClassifier (RC), their shared settings, training loop and weights."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.setting_bounds import BATCH_ROWS, WIDTH, Bound
from rewarduq_exp.methods.base import LabelRankingMethod, TrainingSchedule, run_training, saved_size
from rewarduq_exp.methods.label_ranking._common import check_xy
from rewarduq_exp.methods.label_ranking.temperature import fit_temperature
from rewarduq_exp.methods.settings import LabelRankingSettings, cast, setting
from rewarduq_exp.ranking.categorical import RankCategorical
from rewarduq_exp.ranking.permutations import ranks_to_orderings
from rewarduq_exp.ranking.plackett_luce import PlackettLuce


def _mlp(d: int, hidden, out: int) -> nn.Sequential:
    layers, width = [], d
    for h in hidden:
        layers += [nn.Linear(width, int(h)), nn.ReLU()]
        width = int(h)
    layers.append(nn.Linear(width, out))
    return nn.Sequential(*layers)


@contextmanager
def _torch_threads(n: int | None):
    """Temporarily use ``n`` intra-op threads (None: leave torch's setting). Small MLPs run fastest on one thread;
    on a busy machine more threads mostly spin."""
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def plackett_luce_nll(scores: torch.Tensor, orderings: torch.Tensor) -> torch.Tensor:
    """Mean PL negative log-likelihood: scores (B, m) log-weights, orderings (B, m) best first."""
    s = scores.gather(1, orderings)
    suffix = torch.logcumsumexp(s.flip(1), dim=1).flip(1)
    return (suffix - s).sum(1).mean()


def _widths(value, key):
    """At least one layer, as a list; each width is an integer in the field's bound (checked before)."""
    if not value:
        raise UserError(f"{key}={value!r} is invalid: a list of layer widths >= 1, e.g. [100, 100]")
    return [int(h) for h in value]


@dataclass(kw_only=True)
class NetSettings(LabelRankingSettings):
    """What PL and RC share; the defaults are each learner's (``conf/method/plackett_luce.yaml``,
    ``conf/method/rank_classifier.yaml``)."""

    hidden: list = setting(check=_widths, doc="hidden layer widths",
                           bound=Bound(1, WIDTH, "units", "the paper's label rankers have two layers of 100",
                                       each=True))
    learning_rate: float = setting(doc="Adam's constant learning rate")
    num_epochs: int = setting(bound=Bound(1, 1_000_000, "epochs", "each epoch passes over every training row"),
                              doc="passes over the training rows")
    batch_size: int = setting(bound=Bound(1, BATCH_ROWS, "rows", "a batch's activations are held at once"),
                              doc="rows per step")
    weight_decay: float = setting(doc="AdamW's decoupled weight decay (0: Adam)")
    num_threads: int | None = setting(runtime=True, doc="torch threads while fitting (null: torch's default)",
                                      bound=Bound(1, 4096, "threads", "more threads than any machine has cores",
                                                  allow=(None,)))

    def schedule(self) -> TrainingSchedule:
        """Appendix C: Adam with a constant learning rate and no clipping."""
        return TrainingSchedule.of(self, warmup_ratio=0.0, max_grad_norm=None, lr_schedule="constant")

    def validate(self) -> None:
        super().validate()
        self.schedule().validate()


class _NetLearner(LabelRankingMethod):
    """A learner whose model is an MLP from the features (PL, RC): its settings, training and weights."""

    settings_class = NetSettings

    def __init__(self, **values):
        super().__init__(**values)
        self.hidden = tuple(self.settings.hidden)
        # Appendix C: Adam with a constant learning rate and no clipping.
        self.schedule = self.settings.schedule()
        self.net: nn.Sequential | None = None

    def _build_net(self, d: int, out: int) -> None:
        """The MLP initialised from the seed without touching torch's global random state."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.net = _mlp(d, self.hidden, out)

    def _train(self, X: np.ndarray, target: torch.Tensor, loss_fn) -> None:
        x = torch.as_tensor(X, dtype=torch.float32)

        def step(index: torch.Tensor) -> dict:
            loss = loss_fn(self.net(x[index]), target[index])
            loss.backward()
            return {"loss": loss.detach()}

        self.history = []
        self.net.train()
        with _torch_threads(self.num_threads):
            steps = run_training(self.net.parameters(), len(x), self.schedule, step, seed=self.seed,
                                 desc=f"{self.name} training", history=self.history,
                                 show_progress=self.show_progress, log_every=self.log_every)
        self.net.eval()
        self.fit_summary = {"train_rows": len(x), "steps": steps, "final_train_loss": self.history[-1]["loss"]}

    def _outputs(self, X, batch: int = 8192) -> np.ndarray:
        x = torch.as_tensor(np.asarray(X, dtype=np.float64), dtype=torch.float32)
        with torch.no_grad(), _torch_threads(self.num_threads):
            if not len(x):
                return np.zeros((0, self.net[-1].out_features))
            return np.concatenate([self.net(x[i:i + batch]).double().numpy() for i in range(0, len(x), batch)])

    def fitted_arrays(self) -> dict[str, np.ndarray]:
        return {f"net.{k}": v.detach().numpy() for k, v in self.net.state_dict().items()}

    def fitted_values(self) -> dict:
        return {**super().fitted_values(), "in_features": int(self.net[0].in_features),
                "out_features": int(self.net[-1].out_features)}

    def _max_outputs(self, info: dict, directory) -> int:
        """The most outputs the saved net may have (PL: the m labels; RC: its classes)."""
        return self.saved_labels(info, directory)

    def expected_arrays(self, info: dict, directory) -> dict:
        """The MLP's weights and biases, ``net.<2i>.weight`` (out, in) / ``net.<2i>.bias`` (out,), for the widths
        ``[in_features, *hidden, out_features]``: the hidden widths of the hyperparameters, the input and output
        sizes of method.json's fitted values (bounded)."""
        from rewarduq_exp.core.payload_bounds import MAX_FEATURE_DIM, Expected

        d = saved_size(info, "fitted", "in_features", MAX_FEATURE_DIM, directory)
        out = saved_size(info, "fitted", "out_features", self._max_outputs(info, directory), directory)
        if d is None or out is None:
            raise UserError(f"{Path(directory) / 'method.json'}: field \"fitted\" lacks in_features or "
                            "out_features; the run folder is damaged: copy it again or retrain")
        why = f"hidden={list(self.hidden)} and in_features={d}, out_features={out} in method.json"
        widths = [d, *self.hidden, out]
        arrays = {}
        for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
            arrays[f"net.{2 * i}.weight"] = Expected((fan_out, fan_in), "f", why)
            arrays[f"net.{2 * i}.bias"] = Expected((fan_out,), "f", why)
        return arrays

    def load_fitted(self, arrays, values) -> None:
        super().load_fitted(arrays, values)
        self._build_net(int(values["in_features"]), int(values["out_features"]))
        self.net.load_state_dict({k[len("net."):]: torch.from_numpy(v) for k, v in arrays.items()
                                  if k.startswith("net.")})
        self.net.eval()


@dataclass(kw_only=True)
class PlackettLuceSettings(NetSettings, config="plackett_luce"):
    """Defaults and comments: ``conf/method/plackett_luce.yaml``."""


class PlackettLuceNet(_NetLearner):
    """PL: an MLP from features to m item log-weights, trained by the PL negative log-likelihood.

    Defaults follow the paper (appendix C): two hidden layers of 100 units with ReLU, Adam, no weight decay, 50
    epochs, batch 64. The paper's learning rate did not survive text extraction; 1e-3 is the reference code's value.
    (The reference code used hidden layers [64, 32]: pass ``hidden=(64, 32)`` to match it.)
    """

    name = "plackett_luce"
    settings_class = PlackettLuceSettings

    def fit(self, X, ranks) -> PlackettLuceNet:
        X, ranks = check_xy(X, ranks)
        self.m = ranks.shape[1]
        self._build_net(X.shape[1], self.m)
        self._train(X, torch.as_tensor(ranks_to_orderings(ranks)), plackett_luce_nll)
        return self

    def predict_distribution(self, X) -> PlackettLuce:
        self._require_fit()
        return PlackettLuce(self._outputs(X))


def _fraction(value, key):
    if not 0 < float(value) < 1:
        raise UserError(f"{key}={value!r} is invalid: must be in (0, 1)")
    return float(value)


def _unseen_mass(value, key):
    if not (value == "good_turing" or (isinstance(value, (int, float)) and 0 <= float(value) < 1)):
        raise UserError(f"{key}={value!r} is invalid: good_turing or a number in [0, 1)")
    return value


@dataclass(kw_only=True)
class RankClassifierSettings(NetSettings, config="rank_classifier"):
    """Defaults and comments: ``conf/method/rank_classifier.yaml``."""

    calibrate: bool = setting(check=cast(bool), doc="temperature scaling on a held-out share of the fold")
    calibration_fraction: float = setting(check=_fraction, doc="that share")
    unseen_mass: str | float = setting(check=_unseen_mass, doc="good_turing or a number in [0, 1)")


class RankClassifierNet(_NetLearner):
    """RC: multi-class classification over the distinct rankings of the training fold plus a uniform remainder.

    * Classes: the distinct rankings of the training fold passed to ``fit`` (never the test fold's).
    * Unseen mass: the rankings not observed in training share a fixed total probability ``u`` uniformly; the seen
      rankings share 1 - u by softmax (``RankCategorical``). ``unseen_mass="good_turing"`` (default) estimates u as
      the Good-Turing probability that a new ranking was not seen, with add-one smoothing, (N1 + 1) / (N + 1), N1 =
      number of training rankings that occur exactly once, N = training rows (u = 0 when all m! rankings were seen).
      So u ~ 0.8 % on iris (no singletons) and ~ 0.8 on letter (almost every ranking is unique), where a test ranking
      is indeed usually unseen. A float fixes u instead. Because u is a constant, the seen-only cross-entropy that
      trains the net is exactly the model's log-likelihood up to log(1 - u): the trained and evaluated distributions
      agree (unlike the reference's per-ranking logit of -20 times m! - C, which dominates for m >= 11).
    * Temperature (``calibrate=True``): a seeded random ``calibration_fraction`` of the training fold is held out
      (not the tail of the sorted indices: several files are sorted by class), the net trains on the rest, and T
      minimises the held-out cross-entropy of logits / T by a bounded 1-D search over log T in
      [log 1/20, log 20] (to convergence, xatol 1e-6; the reference's LBFGS with lr 0.01 stopped far short). The
      classes are those of the whole training fold, so every held-out ranking is a class (the unseen mass is constant
      and does not depend on T).
    * With the label-ranking run's recalibration (``metric.ranking.recalibrate``) the two temperatures compose: this
      one is part of the learner as trained (its "raw" distribution is softmax(logits / T_rc)), and the run's T,
      fitted on its own calibration share of the fold (rows this learner never saw, whose rankings may be unseen
      classes), divides those logits again: logits / (T_rc * T). With ``calibrate=True`` the net then trains on
      64 % of the training fold (80 % of the run's 80 %); ``method.calibrate=false`` leaves the run's T the only
      one.
    """

    name = "rank_classifier"

    settings_class = RankClassifierSettings

    def __init__(self, **values):
        super().__init__(**values)
        self.temperature = 1.0

    def fit(self, X, ranks) -> RankClassifierNet:
        X, ranks = check_xy(X, ranks)
        n, self.m = ranks.shape
        orderings = ranks_to_orderings(ranks)
        self.classes, labels = np.unique(orderings, axis=0, return_inverse=True)
        labels = labels.ravel()
        counts = np.bincount(labels)
        if len(self.classes) == math.factorial(self.m):
            self.unseen_mass_ = 0.0
        elif self.unseen_mass == "good_turing":
            self.unseen_mass_ = float((np.sum(counts == 1) + 1) / (n + 1))
        else:
            self.unseen_mass_ = float(self.unseen_mass)
        rng = np.random.default_rng(self.seed)
        n_cal = int(round(self.calibration_fraction * n)) if self.calibrate else 0
        if self.calibrate and (n_cal < 1 or n - n_cal < 1):
            n_cal = 0
        perm = rng.permutation(n)
        cal_idx, train_idx = np.sort(perm[:n_cal]), np.sort(perm[n_cal:])
        self._build_net(X.shape[1], len(self.classes))
        self._train(X[train_idx], torch.as_tensor(labels[train_idx]), nn.functional.cross_entropy)
        self.temperature = fit_temperature(self._outputs(X[cal_idx]), labels[cal_idx]) if n_cal else 1.0
        self.fit_summary.update(train_rows=n, calibration_rows=n_cal, classes=len(self.classes),
                                unseen_mass=self.unseen_mass_, temperature=self.temperature)
        return self

    def predict_distribution(self, X) -> RankCategorical:
        self._require_fit()
        return RankCategorical.from_unseen_mass(self.classes, self._outputs(X) / self.temperature, self.unseen_mass_)

    def fitted_arrays(self) -> dict[str, np.ndarray]:
        return {**super().fitted_arrays(), "classes": self.classes}

    def fitted_values(self) -> dict:
        return {**super().fitted_values(), "temperature": self.temperature, "unseen_mass": self.unseen_mass_}

    def _max_outputs(self, info: dict, directory) -> int:
        """The distinct training rankings: at most the training rows (and m!)."""
        from rewarduq_exp.core.payload_bounds import MAX_ROWS

        m = self.saved_labels(info, directory)
        rows = saved_size(info, "fit_summary", "train_rows", MAX_ROWS, directory) or MAX_ROWS
        return min(rows, math.factorial(m)) if m < 20 else rows

    def expected_arrays(self, info: dict, directory) -> dict:
        from rewarduq_exp.core.payload_bounds import Expected

        arrays = super().expected_arrays(info, directory)
        classes = arrays[f"net.{2 * len(self.hidden)}.bias"].shape[0]   # the output layer's width
        m = self.saved_labels(info, directory)
        arrays["classes"] = Expected((classes, m), "iu", f"out_features={classes}, m={m} in method.json")
        return arrays

    def load_fitted(self, arrays, values) -> None:
        super().load_fitted(arrays, values)
        self.classes = arrays["classes"]
        self.temperature, self.unseen_mass_ = float(values["temperature"]), float(values["unseen_mass"])

