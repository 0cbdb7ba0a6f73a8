"""The five label-ranking learners of the calibrated-label-ranking paper (section 3, appendix C), as methods.

Every learner keeps the method contract (:class:`~rewarduq_exp.methods.base.LabelRankingMethod`): it is built with
its hyperparameters and ``seed``, ``fit(X, ranks) -> self`` (X (n, d) float features, ranks (n, m) ranks-per-item with
1 = best), ``predict_distribution(X) -> RankingDistribution`` (``predict_ranks(X)`` is its mode), and
``save(dir)`` / ``load(dir)`` in formats that never execute code on load. Fitting is deterministic given the seed
(torch initialisation and minibatch order, scikit-learn ``random_state``, the calibration split).

* ``PlackettLuceNet`` (PL): MLP d -> hidden -> m item log-weights, PL negative log-likelihood, Adam.
* ``MallowsLearner`` (MM): unconditional Mallows/Kendall model; center by best-improvement local search over swaps of
  two positions, started from the mean-rank ordering; theta by the maximum-likelihood equation given the center.
* ``RankClassifierNet`` (RC): MLP over the distinct training rankings plus a uniform remainder for the unseen
  rankings (see the class docstring for the unseen mass), optional temperature scaling on a held-out 20 %.
* ``RPCLearner`` (RPC): one Platt-calibrated decision tree per item pair; a pairwise-only distribution, Borda mode.
* ``PLRPCLearner`` (PL-RPC): RPC, then per-sample Plackett-Luce weights from the pairwise matrix: the Bradley-Terry
  maximum-likelihood weights (Newton's method), or the reference code's 100 improved-Zermelo steps (Newman 2023).

The two networks train with the one training loop of every method (:func:`~rewarduq_exp.methods.base.run_training`):
Adam (AdamW with no weight decay is the same update; a weight decay > 0 is AdamW's decoupled one), a constant
learning rate, no gradient clipping, one seeded permutation of the rows per epoch.
"""

from __future__ import annotations

import io
import logging
import math
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from joblib import Parallel, delayed
from scipy.optimize import brentq, minimize_scalar
from scipy.special import expit, logsumexp
from sklearn.calibration import CalibratedClassifierCV
from sklearn.tree import DecisionTreeClassifier
from torch import nn

from rewarduq_exp.core.atomic_write import write_atomic
from rewarduq_exp.core.checks import check_choice, check_positive
from rewarduq_exp.core.errors import UserError, first_line
from rewarduq_exp.methods.base import LabelRankingMethod, TrainingSchedule, run_training, saved_size
from rewarduq_exp.ranking.categorical import RankCategorical
from rewarduq_exp.ranking.mallows import Mallows, expected_distance
from rewarduq_exp.ranking.pairwise import PairwiseOnly
from rewarduq_exp.ranking.permutations import check_rankings, ranks_to_orderings
from rewarduq_exp.ranking.plackett_luce import PlackettLuce

log = logging.getLogger(__name__)


def _check_xy(X, ranks) -> tuple[np.ndarray, np.ndarray]:
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2:
        raise ValueError(f"X must have shape (n, d), got {X.shape}")
    ranks = check_rankings(ranks, what="training rankings")
    if len(X) != len(ranks):
        raise ValueError(f"X has {len(X)} rows but ranks has {len(ranks)}")
    return X, ranks


# ---------------------------------------------------------------------------------------------------- neural nets
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


class _NetLearner(LabelRankingMethod):
    """A learner whose model is an MLP from the features (PL, RC): its settings, training and weights."""

    def __init__(self, hidden=(100, 100), learning_rate: float = 1e-3, num_epochs: int = 50, batch_size: int = 64,
                 weight_decay: float = 0.0, num_threads: int | None = 1, **common):
        super().__init__(**common)
        try:
            self.hidden = tuple(int(h) for h in hidden)
        except (TypeError, ValueError):
            self.hidden = ()
        if not self.hidden or min(self.hidden) < 1:
            raise UserError(f"method.hidden={hidden!r} is invalid: a list of layer widths >= 1, e.g. [100, 100]")
        check_positive(num_epochs, "method.num_epochs", integer=True)
        # Appendix C: Adam with a constant learning rate and no clipping.
        self.schedule = TrainingSchedule(learning_rate, batch_size, int(num_epochs), warmup_ratio=0.0,
                                         weight_decay=weight_decay, max_grad_norm=None, lr_schedule="constant")
        self.schedule.validate()
        self.num_threads = num_threads
        self.net: nn.Sequential | None = None

    def hyperparameters(self) -> dict:
        s = self.schedule
        return {"hidden": list(self.hidden), "learning_rate": s.learning_rate, "num_epochs": s.num_epochs,
                "batch_size": s.batch_size, "weight_decay": s.weight_decay, "seed": self.seed}

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


class PlackettLuceNet(_NetLearner):
    """PL: an MLP from features to m item log-weights, trained by the PL negative log-likelihood.

    Defaults follow the paper (appendix C): two hidden layers of 100 units with ReLU, Adam, no weight decay, 50
    epochs, batch 64. The paper's learning rate did not survive text extraction; 1e-3 is the reference code's value.
    (The reference code used hidden layers [64, 32]: pass ``hidden=(64, 32)`` to match it.)
    """

    name = "plackett_luce"

    def fit(self, X, ranks) -> PlackettLuceNet:
        X, ranks = _check_xy(X, ranks)
        self.m = ranks.shape[1]
        self._build_net(X.shape[1], self.m)
        self._train(X, torch.as_tensor(ranks_to_orderings(ranks)), plackett_luce_nll)
        return self

    def predict_distribution(self, X) -> PlackettLuce:
        self._require_fit()
        return PlackettLuce(self._outputs(X))


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
    """

    name = "rank_classifier"

    def __init__(self, calibrate: bool = True, calibration_fraction: float = 0.2, unseen_mass="good_turing",
                 **settings):
        super().__init__(**settings)
        self.calibrate, self.calibration_fraction = bool(calibrate), float(calibration_fraction)
        if not 0 < self.calibration_fraction < 1:
            raise UserError(f"method.calibration_fraction={calibration_fraction!r} is invalid: must be in (0, 1)")
        if not (unseen_mass == "good_turing" or (isinstance(unseen_mass, (int, float))
                                                 and 0 <= float(unseen_mass) < 1)):
            raise UserError(f"method.unseen_mass={unseen_mass!r} is invalid: good_turing or a number in [0, 1)")
        self.unseen_mass = unseen_mass
        self.temperature = 1.0

    def hyperparameters(self) -> dict:
        return {**super().hyperparameters(), "calibrate": self.calibrate,
                "calibration_fraction": self.calibration_fraction, "unseen_mass": self.unseen_mass}

    def fit(self, X, ranks) -> RankClassifierNet:
        X, ranks = _check_xy(X, ranks)
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


def fit_temperature(logits: np.ndarray, labels: np.ndarray, bounds=(math.log(1 / 20), math.log(20))) -> float:
    """T minimising the mean cross-entropy of softmax(logits / T) (bounded search over log T)."""
    logits = np.asarray(logits, dtype=np.float64)
    picked = logits[np.arange(len(labels)), labels]

    def nll(log_t: float) -> float:
        t = math.exp(log_t)
        return float(np.mean(logsumexp(logits / t, axis=1) - picked / t))

    res = minimize_scalar(nll, bounds=bounds, method="bounded", options={"xatol": 1e-6})
    return float(math.exp(res.x))


# ---------------------------------------------------------------------------------------------------- Mallows
class MallowsLearner(LabelRankingMethod):
    """MM: unconditional Mallows model with Kendall distance (ignores X, as in the paper).

    * Total Kendall distance of the training rankings to a center c is sum_{t < u} N[c_u, c_t], where N[a, b] is the
      number of training rankings that put a before b: one vectorised (m x m) count matrix replaces per-ranking
      distance loops, and every neighbour of the local search costs O(m^2).
    * Center: start from the items sorted by mean rank (ties broken by a seeded random key), then move to the best
      swap of two positions (all m(m-1)/2 "Cayley" neighbours) while that strictly lowers the total distance
      (``max_iter`` moves at most). For theta > 0 the center's likelihood depends on theta only through this total,
      so alternating with theta updates (paper, appendix C) reaches the same center.
    * Theta: the MLE given the final center solves E_theta[d] = mean training distance (brentq on the monotone
      expectation), restricted to [0, ``theta_max``] (0 = uniform when the data are no closer than uniform; theta_max
      when every training ranking equals the center).
    * The predicted ``Mallows`` distribution draws its Monte-Carlo samples (sub-k, k >= 3, m > ``exact_max_m``) with
      the seed.
    """

    name = "mallows"

    def __init__(self, max_iter: int = 10000, theta_max: float = 50.0, mc_samples: int = 20000,
                 exact_max_m: int = 7, **common):
        super().__init__(**common)
        self.max_iter, self.theta_max = int(max_iter), float(theta_max)
        self.mc_samples, self.exact_max_m = int(mc_samples), int(exact_max_m)

    def hyperparameters(self) -> dict:
        return {"max_iter": self.max_iter, "theta_max": self.theta_max, "mc_samples": self.mc_samples,
                "exact_max_m": self.exact_max_m, "seed": self.seed}

    def fit(self, X, ranks) -> MallowsLearner:
        _, ranks = _check_xy(X, ranks)
        n, self.m = ranks.shape
        m = self.m
        before = (ranks[:, :, None] < ranks[:, None, :]).sum(axis=0)  # N[a, b]: rankings with a before b
        rng = np.random.default_rng(self.seed)
        center = np.lexsort((rng.random(m), ranks.mean(axis=0)))
        t_idx, u_idx = np.triu_indices(m, 1)

        def total(cands: np.ndarray) -> np.ndarray:  # (S, m) centers -> (S,) total distance
            return before[cands[:, u_idx], cands[:, t_idx]].sum(axis=1)

        swaps = np.tile(np.arange(m), (len(t_idx), 1))
        swaps[np.arange(len(t_idx)), t_idx], swaps[np.arange(len(t_idx)), u_idx] = u_idx, t_idx
        current = int(total(center[None])[0])
        self.n_moves_ = 0
        for _ in range(self.max_iter):
            cands = center[swaps]  # every swap of two positions
            costs = total(cands)
            best = int(np.argmin(costs))
            if costs[best] >= current:
                break
            center, current = cands[best], int(costs[best])
            self.n_moves_ += 1
        self.center = center
        self.mean_distance_ = current / n
        self.theta = self.mle_theta(self.mean_distance_, m, self.theta_max)
        self.fit_summary = {"train_rows": n, "theta": self.theta, "mean_distance": self.mean_distance_,
                            "local_search_moves": self.n_moves_}
        return self

    @staticmethod
    def mle_theta(mean_distance: float, m: int, theta_max: float = 50.0) -> float:
        """theta >= 0 with E_theta[d_K] = mean_distance (clipped to [0, theta_max])."""
        if mean_distance >= expected_distance(0.0, m) - 1e-12:
            return 0.0
        if mean_distance <= expected_distance(theta_max, m):
            return theta_max
        return float(brentq(lambda th: expected_distance(th, m) - mean_distance, 0.0, theta_max, xtol=1e-12))

    def predict_distribution(self, X) -> Mallows:
        self._require_fit()
        return Mallows(self.center, self.theta, n=len(X), mc_samples=self.mc_samples, mc_seed=self.seed,
                       exact_max_m=self.exact_max_m)

    def fitted_arrays(self) -> dict[str, np.ndarray]:
        return {"center": self.center}

    def fitted_values(self) -> dict:
        return {**super().fitted_values(), "theta": self.theta, "mean_distance": self.mean_distance_}

    def expected_arrays(self, info: dict, directory) -> dict:
        """The center ranking: one entry per label (``fitted.m`` of method.json)."""
        from rewarduq_exp.core.payload_bounds import Expected

        m = self.saved_labels(info, directory)
        return {"center": Expected((m,), "iu", f"m={m} in method.json")}

    def load_fitted(self, arrays, values) -> None:
        super().load_fitted(arrays, values)
        self.center, self.theta, self.mean_distance_ = arrays["center"], float(values["theta"]), values["mean_distance"]


# ---------------------------------------------------------------------------------------------------- RPC
# What an RPC model file may hold besides plain containers and numpy arrays: the fitted calibrated trees. skops
# refuses any other type on load, so reading a model file never runs code it names (unlike a pickle).
RPC_TRUSTED_TYPES = ["sklearn.calibration._CalibratedClassifier", "sklearn.calibration._SigmoidCalibration",
                     "sklearn.tree._tree.Tree"]
RPC_MODELS_FILE = "pairs.skops"


def _fit_pair(X: np.ndarray, y: np.ndarray, seed: int, cv: int, eps: float):
    """A calibrated tree for one pair, or the clipped base rate where a class has fewer than ``cv`` rows (a stratified
    ``cv``-fold Platt scaling needs at least one row of each class per fold)."""
    counts = np.bincount(y, minlength=2)
    if counts.min() < cv:
        return float(np.clip(counts[1] / len(y), eps, 1 - eps))
    clf = CalibratedClassifierCV(estimator=DecisionTreeClassifier(random_state=seed), cv=cv, method="sigmoid")
    return clf.fit(X, y)


def _damaged_models_file(path: Path, err: Exception) -> UserError:
    first = first_line(err)
    return UserError(f"{path} could not be read as an RPC model file ({type(err).__name__}: {first}); the run "
                     "folder is damaged: copy it again or retrain")


class RPCLearner(LabelRankingMethod):
    """RPC: for each item pair a < b, a binary classifier for "a is ranked before b".

    The classifier is ``CalibratedClassifierCV(DecisionTreeClassifier(random_state=seed), cv=2, method="sigmoid")``
    (Platt scaling, ensemble of the per-fold calibrated trees). A pair whose training labels have a single class (or
    fewer than ``cv`` rows of one class) predicts its training frequency as a constant instead (the reference code
    appended an artificial training row instead). Probabilities are clipped to [eps, 1 - eps]. ``n_jobs`` fits pairs
    in parallel (joblib); results do not depend on it. The fitted trees are saved with skops (``pairs.skops``), which
    loads only the types in ``RPC_TRUSTED_TYPES``.
    """

    name = "rpc"

    def __init__(self, cv: int = 2, eps: float = 1e-6, n_jobs: int | None = 1, **common):
        super().__init__(**common)
        self.cv, self.eps, self.n_jobs = int(cv), float(eps), n_jobs

    def hyperparameters(self) -> dict:
        return {"cv": self.cv, "eps": self.eps, "seed": self.seed}

    def fit(self, X, ranks) -> RPCLearner:
        X, ranks = _check_xy(X, ranks)
        self.m = ranks.shape[1]
        self.pairs = np.stack(np.triu_indices(self.m, 1), axis=1)
        labels = [(ranks[:, a] < ranks[:, b]).astype(np.int64) for a, b in self.pairs]
        self.models = Parallel(n_jobs=self.n_jobs)(
            delayed(_fit_pair)(X, y, self.seed, self.cv, self.eps) for y in labels)
        self.fit_summary = {"train_rows": len(X), "pairs": len(self.pairs),
                            "constant_pairs": sum(isinstance(model, float) for model in self.models)}
        return self

    def predict_pairwise(self, X) -> np.ndarray:
        """P(a > b) as an (n, m, m) matrix with zero diagonal."""
        self._require_fit()
        X = np.asarray(X, dtype=np.float64)
        out = np.zeros((len(X), self.m, self.m))
        for (a, b), model in zip(self.pairs, self.models):
            if isinstance(model, float):
                p = np.full(len(X), model)
            else:
                p = model.predict_proba(X)[:, list(model.classes_).index(1)]
            p = np.clip(p, self.eps, 1 - self.eps)
            out[:, a, b], out[:, b, a] = p, 1.0 - p
        return out

    def predict_distribution(self, X) -> PairwiseOnly:
        return PairwiseOnly(self.predict_pairwise(X))

    def fitted_arrays(self) -> dict[str, np.ndarray]:
        return {"pairs": self.pairs}

    def save(self, directory) -> None:
        import skops.io

        super().save(directory)
        write_atomic(Path(directory) / RPC_MODELS_FILE, skops.io.dumps(list(self.models)))

    def load_fitted(self, arrays, values) -> None:
        super().load_fitted(arrays, values)
        self.pairs = arrays["pairs"]

    def expected_arrays(self, info: dict, directory) -> dict:
        """The item pairs a < b: m (m - 1) / 2 rows of two labels (``fitted.m`` of method.json)."""
        from rewarduq_exp.core.payload_bounds import Expected

        m = self.saved_labels(info, directory)
        return {"pairs": Expected((m * (m - 1) // 2, 2), "iu", f"m={m} in method.json")}

    def models_file_bound(self, info: dict, directory) -> tuple[int, str]:
        """(bytes, where the bound comes from) of ``pairs.skops``, unpacked: per pair, ``cv`` calibrated trees of at
        most 2 n - 1 nodes each for n training rows (a node: 64 bytes of tree plus 16 of class values), plus 64 KiB
        of per-object bookkeeping, plus 1 MiB."""
        from rewarduq_exp.core.payload_bounds import MAX_ROWS

        m = self.saved_labels(info, directory)
        rows = saved_size(info, "fit_summary", "train_rows", MAX_ROWS, directory) or MAX_ROWS
        pairs = m * (m - 1) // 2
        bound = pairs * max(1, self.cv) * (2 * rows * 80 + (64 << 10)) + (1 << 20)
        return bound, f"m={m}, train_rows={rows} in method.json, cv={self.cv}"

    def load(self, directory) -> RPCLearner:
        import skops.io

        from rewarduq_exp.core.payload_bounds import check_zip_total
        from rewarduq_exp.core.saved_files import read_bounded
        from rewarduq_exp.methods.base import read_method_info

        super().load(directory)
        path = Path(directory) / RPC_MODELS_FILE
        bound, why = self.models_file_bound(read_method_info(directory, self.name), directory)
        if not path.exists():
            raise UserError(f"{path} is missing; the run folder is damaged: copy it again or retrain")
        # The file, and what its zip members unpack to, are bounded by the run's settings before skops reads it.
        data = read_bounded(path, bound, f"{path} (an RPC model file of {why})")
        check_zip_total(data, path, bound, why)
        try:
            untrusted = sorted(set(skops.io.get_untrusted_types(data=data)) - set(RPC_TRUSTED_TYPES))
        except Exception as err:  # noqa: BLE001 (cut short, not a skops zip: skops' errors do not name the file)
            raise _damaged_models_file(path, err) from None
        if untrusted:
            raise UserError(f"{path} holds types an RPC model never has ({', '.join(untrusted)}); not loading it")
        try:
            self.models = skops.io.load(io.BytesIO(data), trusted=RPC_TRUSTED_TYPES)
        except Exception as err:  # noqa: BLE001 (a damaged member of the archive)
            raise _damaged_models_file(path, err) from None
        return self


# ---------------------------------------------------------------------------------------------------- PL-RPC
PL_RPC_AGGREGATIONS = ("mle", "zermelo_reference")
"""How PL-RPC turns a pairwise matrix into Plackett-Luce weights: ``mle`` (:func:`bradley_terry_log_weights`, the
converged maximum-likelihood weights) or ``zermelo_reference`` (:func:`zermelo_reference_log_weights`, the reference
code's 100 simultaneous improved-Zermelo steps, which need not converge)."""
ZERMELO_REFERENCE_SEED = 42
"""The reference code starts its Zermelo iteration from ``np.random.default_rng(42)``, made anew for every test fold."""


def _comparison_counts(P) -> np.ndarray:
    """P (n, m, m) as float64 soft counts a_ij = P(i > j), a copy with a zero diagonal."""
    A = np.array(P, dtype=np.float64)
    if A.ndim != 3 or A.shape[1] != A.shape[2]:
        raise ValueError(f"pairwise probabilities must have shape (n, m, m), got {A.shape}")
    idx = np.arange(A.shape[1])
    A[:, idx, idx] = 0.0
    return A


def bradley_terry_log_likelihood(theta: np.ndarray, P: np.ndarray) -> np.ndarray:
    """Per-sample L(theta) = sum_{i != j} a_ij [theta_i - log(exp(theta_i) + exp(theta_j))], a_ij = P[:, i, j]
    (the diagonal of P is ignored); theta (n, m), result (n,)."""
    A = _comparison_counts(P)
    return _log_likelihood(np.asarray(theta, dtype=np.float64), A)


def _log_likelihood(theta: np.ndarray, A: np.ndarray) -> np.ndarray:
    # theta_i - log(exp(theta_i) + exp(theta_j)) = -log(1 + exp(theta_j - theta_i)); zero where a_ij = 0 (diagonal).
    return -(A * np.logaddexp(0.0, theta[:, None, :] - theta[:, :, None])).sum(axis=(1, 2))


def bradley_terry_log_weights(P, tol: float = 1e-10, max_iter: int = 100, return_iterations: bool = False):
    """Bradley-Terry maximum-likelihood log-weights (n, m) from pairwise probabilities P (n, m, m) read as soft
    counts a_ij = P[:, i, j] = P(i > j); the log-weights are those of weights summing to 1 (a PL model's weights).

    Maximises the concave L(theta) = sum_{i != j} a_ij [theta_i - log(exp(theta_i) + exp(theta_j))] per sample by
    Newton's method, all samples at once (batched m x m systems, a loop over iterations only). With n_ij = a_ij + a_ji
    and p_ij = sigmoid(theta_i - theta_j), the gradient is g_i = sum_j (a_ij - n_ij p_ij) and minus the Hessian is
    the graph Laplacian with edge weights n_ij p_ij p_ji; its null space is the constant vector (the gauge), so the
    step solves (Laplacian + 1 1^T) d = g, whose solution has sum d = 0 and is the Newton step within sum theta = 0.
    A backtracking line search (step halving, Armijo condition, up to rounding of L) makes every accepted step
    increase L, so the iteration converges to the maximiser wherever it exists, quadratically near it. It starts at
    theta_i = mean_j logit(a_ij / n_ij) (exact when P is itself Bradley-Terry). A sample stops once the largest
    component of its Newton step is <= ``tol`` (that step is still taken), or when no step increases L beyond
    rounding; ``max_iter`` caps the iterations (samples still running then are returned as they are).

    The maximiser exists (and is unique given the gauge) when the directed graph with an edge i -> j wherever
    a_ij > 0 is strongly connected, e.g. when every a_ij lies in (0, 1) as RPC's clipped probabilities do; without
    it the weights run off and the result is merely finite. With ``return_iterations``
    the result is (log_weights, iterations per sample (n,), converged per sample (n,)).
    """
    check_positive(tol, "tol")
    check_positive(max_iter, "max_iter", integer=True)
    A = _comparison_counts(P)
    n, m = A.shape[:2]
    N = A + A.transpose(0, 2, 1)  # n_ij, symmetric
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(N > 0, A / N, 0.5)
    share = np.clip(share, 1e-12, 1 - 1e-12)
    theta = np.log(share / (1 - share)).sum(axis=2) / max(m - 1, 1)
    theta -= theta.mean(axis=1, keepdims=True)
    iterations = np.zeros(n, dtype=np.int64)
    done = np.full(n, m < 2)
    eye = np.eye(m)
    for _ in range(int(max_iter)):
        active = np.flatnonzero(~done)
        if active.size == 0:
            break
        th, a, nn = theta[active], A[active], N[active]
        p = expit(th[:, :, None] - th[:, None, :])  # p_ij
        grad = (a - nn * p).sum(axis=2)
        w = nn * p * p.transpose(0, 2, 1)  # Laplacian edge weights n_ij p_ij p_ji
        system = -w + eye * w.sum(axis=2)[:, :, None] + 1.0 + 1e-14 * eye
        step = np.linalg.solve(system, grad[:, :, None])[:, :, 0]
        step -= step.mean(axis=1, keepdims=True)
        rise = (grad * step).sum(axis=1)  # directional derivative g.d >= 0 (the system is positive definite)
        base = _log_likelihood(th, a)
        slack = 1e-12 * (1.0 + np.abs(base))  # rounding of L near its maximum
        t = np.ones(len(active))
        pending = np.ones(len(active), dtype=bool)
        for _ in range(60):
            idx = np.flatnonzero(pending)
            if idx.size == 0:
                break
            cand = th[idx] + t[idx, None] * step[idx]
            ok = _log_likelihood(cand, a[idx]) >= base[idx] + 1e-4 * t[idx] * rise[idx] - slack[idx]
            th[idx[ok]] = cand[ok]
            pending[idx[ok]] = False
            t[idx[~ok]] *= 0.5
        theta[active] = th - th.mean(axis=1, keepdims=True)
        iterations[active] += 1
        small = np.abs(step).max(axis=1) <= tol
        done[active[small | pending]] = True
    log_w = theta - logsumexp(theta, axis=1, keepdims=True) if m else theta
    if return_iterations:
        return log_w, iterations, done
    return log_w


def zermelo_reference_log_weights(P, n_iter: int = 100, seed: int = ZERMELO_REFERENCE_SEED) -> np.ndarray:
    """The reference code's aggregation: log of the weights after ``n_iter`` simultaneous improved-Zermelo steps
    (Newman 2023) from a random start, vectorised over samples, P (n, m, m) -> (n, m).

    Start: u = default_rng(seed).random((n, m)) + 1e-10 (one generator per call, its draws in row order), normalised
    to sum 1 per row. Step, for all i at once with e = 1e-10:
    w_i <- [sum_{j != i} a_ij w_j / (w_i + w_j + e)] / ([sum_{j != i} a_ji / (w_i + w_j + e)] + e), then normalised to
    sum 1 (uniform where the sum is not positive). This is the fixed-point form of the Bradley-Terry likelihood
    equations, but updating every weight at once need not converge: on some inputs it settles into a cycle of period 2
    (e.g. P = [[0, .9697, .8261], [.0303, 0, .9517], [.1739, .0483, 0]] alternates between [.928 .031 .041] and
    [.472 .508 .020], while the maximum-likelihood weights are [.808 .157 .035]; for m = 2 it maps the weight ratio r
    to (a_12 / a_21)^2 / r and never converges). Kept to reproduce the reference
    numbers (``method.aggregation=zermelo_reference``); :func:`bradley_terry_log_weights` is the converged answer.

    What matches the reference: the start (a fresh generator seeded 42 for each matrix handed over, as the reference
    does once per test fold, and PL-RPC calls this once per ``predict_distribution``), the step, the 1e-10 guards, the
    iteration count and float64 arithmetic; the weights agree with the reference function on the same input to
    rounding. What cannot match: the input (RPC is fitted on other folds and rows, without the reference's
    artificial training row, and clipped to [eps, 1 - eps]); a row's start depends on its position in the matrix, so
    predicting rows in other batches or order changes their results; the reference then uses the weights in float32.
    Weights are floored at 1e-300 before the log so it stays finite.
    """
    check_positive(n_iter, "n_iter", integer=True, minimum=0, inclusive=True)
    A = _comparison_counts(P)
    n, m = A.shape[:2]
    guard = 1e-10
    At = A.transpose(0, 2, 1)
    w = np.random.default_rng(seed).random((n, m)) + guard
    w = _normalise_rows(w)
    for _ in range(int(n_iter)):
        denom = w[:, :, None] + w[:, None, :] + guard
        num = (A * w[:, None, :] / denom).sum(axis=2)
        den = (At / denom).sum(axis=2)
        w = _normalise_rows(num / (den + guard))
    return np.log(np.maximum(w, 1e-300))


def _normalise_rows(w: np.ndarray) -> np.ndarray:
    s = w.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(s > 0.0, w / s, 1.0 / max(w.shape[1], 1))


class PLRPCLearner(RPCLearner):
    """PL-RPC: RPC's pairwise probabilities per sample, read as Bradley-Terry probabilities and turned into
    Plackett-Luce weights.

    ``aggregation`` (one of ``PL_RPC_AGGREGATIONS``): ``mle`` (default) takes the Bradley-Terry maximum-likelihood
    weights with the pairwise probabilities as soft counts (:func:`bradley_terry_log_weights`: Newton's method, at
    most ``n_iter`` steps, stopping once every log-weight moves by <= ``tol``); ``zermelo_reference`` runs exactly
    ``n_iter`` simultaneous improved-Zermelo steps from the reference code's random start
    (:func:`zermelo_reference_log_weights`), which reproduces the reference numbers but can stop on a 2-cycle far
    from the maximum-likelihood weights. A ``method.json`` saved before ``aggregation`` existed loads with ``mle``.
    """

    name = "pl_rpc"

    def __init__(self, aggregation: str = "mle", n_iter: int = 100, tol: float = 1e-10, **settings):
        super().__init__(**settings)
        self.aggregation = check_choice("method.aggregation", aggregation, PL_RPC_AGGREGATIONS)
        self.n_iter = int(check_positive(n_iter, "method.n_iter", integer=True))
        self.tol = float(check_positive(tol, "method.tol"))

    def hyperparameters(self) -> dict:
        return {**super().hyperparameters(), "aggregation": self.aggregation, "n_iter": self.n_iter, "tol": self.tol}

    def plackett_luce_log_weights(self, X) -> np.ndarray:
        """Per-sample PL log-weights (n, m) by the configured aggregation of ``predict_pairwise(X)``."""
        P = self.predict_pairwise(X)
        if self.aggregation == "zermelo_reference":
            return zermelo_reference_log_weights(P, self.n_iter)
        log_w, _, converged = bradley_terry_log_weights(P, tol=self.tol, max_iter=self.n_iter, return_iterations=True)
        if not converged.all():
            log.warning("PL-RPC: %d of %d samples did not reach tol=%g within n_iter=%d Newton steps",
                        int((~converged).sum()), len(converged), self.tol, self.n_iter)
        return log_w

    def predict_distribution(self, X) -> PlackettLuce:
        return PlackettLuce(self.plackett_luce_log_weights(X))


LEARNERS = {cls.name: cls for cls in (PlackettLuceNet, MallowsLearner, RankClassifierNet, RPCLearner, PLRPCLearner)}
