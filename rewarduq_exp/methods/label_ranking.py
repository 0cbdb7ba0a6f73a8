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
* ``PLRPCLearner`` (PL-RPC): RPC, then per-sample Plackett-Luce weights from the pairwise matrix by the improved
  Zermelo iteration (Newman 2023).

The two networks train with the one training loop of every method (:func:`~rewarduq_exp.methods.base.run_training`):
Adam (AdamW with no weight decay is the same update; a weight decay > 0 is AdamW's decoupled one), a constant
learning rate, no gradient clipping, one seeded permutation of the rows per epoch.
"""

from __future__ import annotations

import io
import math
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from joblib import Parallel, delayed
from scipy.optimize import brentq, minimize_scalar
from scipy.special import logsumexp
from sklearn.calibration import CalibratedClassifierCV
from sklearn.tree import DecisionTreeClassifier
from torch import nn

from rewarduq_exp.core.atomic_write import write_atomic
from rewarduq_exp.core.checks import check_positive
from rewarduq_exp.core.errors import UserError, first_line
from rewarduq_exp.methods.base import LabelRankingMethod, TrainingSchedule, run_training
from rewarduq_exp.ranking.categorical import RankCategorical
from rewarduq_exp.ranking.mallows import Mallows, expected_distance
from rewarduq_exp.ranking.pairwise import PairwiseOnly
from rewarduq_exp.ranking.permutations import check_rankings, ranks_to_orderings
from rewarduq_exp.ranking.plackett_luce import PlackettLuce


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

    def load(self, directory) -> RPCLearner:
        import skops.io

        super().load(directory)
        path = Path(directory) / RPC_MODELS_FILE
        try:
            data = path.read_bytes()
            untrusted = sorted(set(skops.io.get_untrusted_types(data=data)) - set(RPC_TRUSTED_TYPES))
        except FileNotFoundError:
            raise UserError(f"{path} is missing; the run folder is damaged: copy it again or retrain") from None
        except Exception as err:  # noqa: BLE001 (cut short, not a skops zip: skops' errors do not name the file)
            raise _damaged_models_file(path, err) from None
        if untrusted:
            raise UserError(f"{path} holds types an RPC model never has ({', '.join(untrusted)}); not loading it")
        try:
            self.models = skops.io.load(io.BytesIO(data), trusted=RPC_TRUSTED_TYPES)
        except Exception as err:  # noqa: BLE001 (a damaged member of the archive)
            raise _damaged_models_file(path, err) from None
        return self


def zermelo_log_weights(P: np.ndarray, n_iter: int = 100, tol: float = 0.0) -> np.ndarray:
    """Bradley-Terry / Plackett-Luce log-weights (n, m) from pairwise probabilities P (n, m, m), a_ij = P(i > j).

    Improved Zermelo iteration (Newman 2023), vectorised over samples:
    w_i <- [sum_{j != i} a_ij w_j / (w_i + w_j)] / [sum_{j != i} a_ji / (w_i + w_j)], renormalised to sum 1.
    Deterministic uniform initialisation; ``n_iter`` iterations (fewer if the largest relative change of a weight
    drops below ``tol`` > 0). Weights are floored at 1e-300 so their logs stay finite.
    """
    A = np.array(P, dtype=np.float64)
    n, m = A.shape[:2]
    idx = np.arange(m)
    A[:, idx, idx] = 0.0
    At = A.transpose(0, 2, 1)
    w = np.full((n, m), 1.0 / m)
    for _ in range(int(n_iter)):
        inv = 1.0 / (w[:, :, None] + w[:, None, :])  # 1 / (w_i + w_j)
        num = (A * inv * w[:, None, :]).sum(axis=2)
        den = (At * inv).sum(axis=2)
        new = np.maximum(num, 1e-300) / np.maximum(den, 1e-300)
        new = np.maximum(new / new.sum(axis=1, keepdims=True), 1e-300)
        change = np.max(np.abs(new - w) / w)
        w = new
        if tol > 0 and change < tol:
            break
    return np.log(w)


class PLRPCLearner(RPCLearner):
    """PL-RPC: RPC's pairwise probabilities per sample, read as Bradley-Terry probabilities and turned into
    Plackett-Luce weights by ``zermelo_log_weights`` (``n_iter`` iterations, 100 as in the paper)."""

    name = "pl_rpc"

    def __init__(self, n_iter: int = 100, **settings):
        super().__init__(**settings)
        self.n_iter = int(n_iter)

    def hyperparameters(self) -> dict:
        return {**super().hyperparameters(), "n_iter": self.n_iter}

    def predict_distribution(self, X) -> PlackettLuce:
        return PlackettLuce(zermelo_log_weights(self.predict_pairwise(X), self.n_iter))


LEARNERS = {cls.name: cls for cls in (PlackettLuceNet, MallowsLearner, RankClassifierNet, RPCLearner, PLRPCLearner)}
