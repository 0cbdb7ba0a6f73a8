"""The five label-ranking learners of the calibrated-label-ranking paper (section 3, appendix C).

Every learner has ``fit(X, ranks, seed=0) -> self`` (X (n, d) float features, ranks (n, m) ranks-per-item with
1 = best) and ``predict_distribution(X) -> RankingDistribution``; ``predict_ranks(X)`` is the distribution's mode.
Fitting is deterministic given ``seed`` (torch initialisation and minibatch order, scikit-learn ``random_state``,
the calibration split). Constructor arguments are plain keywords with defaults, as a method config passes them.

* ``PlackettLuceNet`` (PL): MLP d -> hidden -> m item log-weights, PL negative log-likelihood, Adam.
* ``MallowsLearner`` (MM): unconditional Mallows/Kendall model; center by best-improvement local search over swaps of
  two positions, started from the mean-rank ordering; theta by the maximum-likelihood equation given the center.
* ``RankClassifierNet`` (RC): MLP over the distinct training rankings plus a uniform remainder for the unseen
  rankings (see the class docstring for the unseen mass), optional temperature scaling on a held-out 20 %.
* ``RPCLearner`` (RPC): one Platt-calibrated decision tree per item pair; a pairwise-only distribution, Borda mode.
* ``PLRPCLearner`` (PL-RPC): RPC, then per-sample Plackett-Luce weights from the pairwise matrix by the improved
  Zermelo iteration (Newman 2023).

Pure numpy / torch / scikit-learn; nothing here reads configs or files.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np
import torch
from joblib import Parallel, delayed
from scipy.optimize import brentq, minimize_scalar
from scipy.special import logsumexp
from sklearn.calibration import CalibratedClassifierCV
from sklearn.tree import DecisionTreeClassifier
from torch import nn

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.ranking.categorical import RankCategorical
from rewarduq_exp.ranking.distribution import RankingDistribution
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


def _net_settings(hidden, lr, epochs, batch_size, weight_decay) -> tuple:
    """The network settings as (hidden, lr, epochs, batch_size, weight_decay), or a one-line UserError naming the
    ``method.<key>`` that is out of range."""
    try:
        hidden = tuple(int(h) for h in hidden)
    except (TypeError, ValueError):
        hidden = ()
    if not hidden or min(hidden) < 1:
        raise UserError(f"method.hidden={hidden!r} is invalid: a list of layer widths >= 1, e.g. [100, 100]")
    for key, value, low in (("lr", lr, 0.0), ("epochs", epochs, 0), ("batch_size", batch_size, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > low:
            raise UserError(f"method.{key}={value!r} is invalid: must be a number > {low:g}")
    if not weight_decay >= 0:
        raise UserError(f"method.weight_decay={weight_decay!r} is invalid: must be >= 0")
    return hidden, float(lr), int(epochs), int(batch_size), float(weight_decay)


class _Learner:
    """Shared helpers: the point prediction and the not-fitted guard."""

    task = "label_ranking"  # what the runner trains it on (dataset=label_ranking/<name>); reward models: preferences
    m: int | None = None

    def predict_distribution(self, X) -> RankingDistribution:  # pragma: no cover - overridden
        raise NotImplementedError

    def predict_ranks(self, X) -> np.ndarray:
        return self.predict_distribution(X).mode_ranks()

    def _require_fit(self):
        if self.m is None:
            raise RuntimeError(f"{type(self).__name__} is not fitted: call fit(X, ranks, seed) first")


# ---------------------------------------------------------------------------------------------------- neural nets
def _mlp(d: int, hidden, out: int) -> nn.Sequential:
    layers, width = [], d
    for h in hidden:
        layers += [nn.Linear(width, int(h)), nn.ReLU()]
        width = int(h)
    layers.append(nn.Linear(width, out))
    return nn.Sequential(*layers)


def _train_net(net: nn.Module, X: np.ndarray, target: torch.Tensor, loss_fn, *, epochs: int, batch_size: int,
               lr: float, weight_decay: float, seed: int) -> list[float]:
    """Adam over seeded reshuffled minibatches; returns the mean training loss per epoch."""
    x = torch.as_tensor(X, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(net.parameters(), lr=lr, weight_decay=weight_decay, foreach=True)  # faster on CPU
    history = []
    net.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        total = 0.0
        for start in range(0, len(x), batch_size):
            idx = perm[start:start + batch_size]
            loss = loss_fn(net(x[idx]), target[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        history.append(total / max(1, len(x)))
    net.eval()
    return history


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


def _build_net(seed: int, d: int, hidden, out: int) -> nn.Sequential:
    """The MLP initialised from ``seed`` without touching torch's global random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _mlp(d, hidden, out)


def _net_outputs(net: nn.Module, X, batch: int = 8192) -> np.ndarray:
    x = torch.as_tensor(np.asarray(X, dtype=np.float64), dtype=torch.float32)
    with torch.no_grad():
        return np.concatenate([net(x[i:i + batch]).double().numpy() for i in range(0, len(x), batch)]) \
            if len(x) else np.zeros((0, net[-1].out_features))


def plackett_luce_nll(scores: torch.Tensor, orderings: torch.Tensor) -> torch.Tensor:
    """Mean PL negative log-likelihood: scores (B, m) log-weights, orderings (B, m) best first."""
    s = scores.gather(1, orderings)
    suffix = torch.logcumsumexp(s.flip(1), dim=1).flip(1)
    return (suffix - s).sum(1).mean()


class PlackettLuceNet(_Learner):
    """PL: an MLP from features to m item log-weights, trained by the PL negative log-likelihood.

    Defaults follow the paper (appendix C): two hidden layers of 100 units with ReLU, Adam, no weight decay, 50
    epochs, batch 64. The paper's learning rate did not survive text extraction; 1e-3 is the reference code's value.
    (The reference code used hidden layers [64, 32]: pass ``hidden=(64, 32)`` to match it.)
    """

    def __init__(self, hidden=(100, 100), lr: float = 1e-3, epochs: int = 50, batch_size: int = 64,
                 weight_decay: float = 0.0, num_threads: int | None = None):
        self.hidden, self.lr, self.epochs, self.batch_size, self.weight_decay = _net_settings(
            hidden, lr, epochs, batch_size, weight_decay)
        self.num_threads = num_threads
        self.net: nn.Sequential | None = None

    def fit(self, X, ranks, seed: int = 0) -> PlackettLuceNet:
        X, ranks = _check_xy(X, ranks)
        self.m = ranks.shape[1]
        self.net = _build_net(seed, X.shape[1], self.hidden, self.m)
        target = torch.as_tensor(ranks_to_orderings(ranks))
        with _torch_threads(self.num_threads):
            self.loss_history = _train_net(self.net, X, target, plackett_luce_nll, epochs=self.epochs,
                                           batch_size=self.batch_size, lr=self.lr, weight_decay=self.weight_decay,
                                           seed=seed)
        return self

    def predict_distribution(self, X) -> PlackettLuce:
        self._require_fit()
        with _torch_threads(self.num_threads):
            return PlackettLuce(_net_outputs(self.net, X))


class RankClassifierNet(_Learner):
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

    def __init__(self, hidden=(100, 100), lr: float = 1e-3, epochs: int = 50, batch_size: int = 64,
                 weight_decay: float = 0.0, calibrate: bool = True, calibration_fraction: float = 0.2,
                 unseen_mass="good_turing", num_threads: int | None = None):
        self.num_threads = num_threads
        self.hidden, self.lr, self.epochs, self.batch_size, self.weight_decay = _net_settings(
            hidden, lr, epochs, batch_size, weight_decay)
        self.calibrate, self.calibration_fraction = bool(calibrate), float(calibration_fraction)
        if not 0 < self.calibration_fraction < 1:
            raise UserError(f"method.calibration_fraction={calibration_fraction!r} is invalid: must be in (0, 1)")
        if not (unseen_mass == "good_turing" or (isinstance(unseen_mass, (int, float))
                                                 and 0 <= float(unseen_mass) < 1)):
            raise UserError(f"method.unseen_mass={unseen_mass!r} is invalid: good_turing or a number in [0, 1)")
        self.unseen_mass = unseen_mass
        self.net: nn.Sequential | None = None
        self.temperature = 1.0

    def fit(self, X, ranks, seed: int = 0) -> RankClassifierNet:
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
        rng = np.random.default_rng(seed)
        n_cal = int(round(self.calibration_fraction * n)) if self.calibrate else 0
        if self.calibrate and (n_cal < 1 or n - n_cal < 1):
            n_cal = 0
        perm = rng.permutation(n)
        cal_idx, train_idx = np.sort(perm[:n_cal]), np.sort(perm[n_cal:])
        self.net = _build_net(seed, X.shape[1], self.hidden, len(self.classes))
        target = torch.as_tensor(labels[train_idx])
        with _torch_threads(self.num_threads):
            self.loss_history = _train_net(self.net, X[train_idx], target, nn.functional.cross_entropy,
                                           epochs=self.epochs, batch_size=self.batch_size, lr=self.lr,
                                           weight_decay=self.weight_decay, seed=seed)
            cal_logits = _net_outputs(self.net, X[cal_idx]) if n_cal else None
        self.temperature = 1.0
        if n_cal:
            self.temperature = fit_temperature(cal_logits, labels[cal_idx])
        return self

    def predict_distribution(self, X) -> RankCategorical:
        self._require_fit()
        with _torch_threads(self.num_threads):
            logits = _net_outputs(self.net, X)
        logits /= self.temperature
        return RankCategorical.from_unseen_mass(self.classes, logits, self.unseen_mass_)


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
class MallowsLearner(_Learner):
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
      the fit's seed.
    """

    def __init__(self, max_iter: int = 10000, theta_max: float = 50.0, mc_samples: int = 20000,
                 exact_max_m: int = 7):
        self.max_iter, self.theta_max = int(max_iter), float(theta_max)
        self.mc_samples, self.exact_max_m = int(mc_samples), int(exact_max_m)

    def fit(self, X, ranks, seed: int = 0) -> MallowsLearner:
        _, ranks = _check_xy(X, ranks)
        n, self.m = ranks.shape
        m = self.m
        before = (ranks[:, :, None] < ranks[:, None, :]).sum(axis=0)  # N[a, b]: rankings with a before b
        rng = np.random.default_rng(seed)
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
        self.seed_ = int(seed)
        self.mean_distance_ = current / n
        self.theta = self.mle_theta(self.mean_distance_, m, self.theta_max)
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
        return Mallows(self.center, self.theta, n=len(X), mc_samples=self.mc_samples, mc_seed=self.seed_,
                       exact_max_m=self.exact_max_m)


# ---------------------------------------------------------------------------------------------------- RPC
def _fit_pair(X: np.ndarray, y: np.ndarray, seed: int, cv: int, eps: float):
    """A calibrated tree for one pair, or the clipped base rate where a class has fewer than ``cv`` rows (a stratified
    ``cv``-fold Platt scaling needs at least one row of each class per fold)."""
    counts = np.bincount(y, minlength=2)
    if counts.min() < cv:
        return float(np.clip(counts[1] / len(y), eps, 1 - eps))
    clf = CalibratedClassifierCV(estimator=DecisionTreeClassifier(random_state=seed), cv=cv, method="sigmoid")
    return clf.fit(X, y)


class RPCLearner(_Learner):
    """RPC: for each item pair a < b, a binary classifier for "a is ranked before b".

    The classifier is ``CalibratedClassifierCV(DecisionTreeClassifier(random_state=seed), cv=2, method="sigmoid")``
    (Platt scaling, ensemble of the per-fold calibrated trees). A pair whose training labels have a single class (or
    fewer than ``cv`` rows of one class) predicts its training frequency as a constant instead (the reference code
    appended an artificial training row instead). Probabilities are clipped to [eps, 1 - eps]. ``n_jobs`` fits pairs
    in parallel (joblib); results do not depend on it.
    """

    def __init__(self, cv: int = 2, eps: float = 1e-6, n_jobs: int | None = 1):
        self.cv, self.eps, self.n_jobs = int(cv), float(eps), n_jobs

    def fit(self, X, ranks, seed: int = 0) -> RPCLearner:
        X, ranks = _check_xy(X, ranks)
        self.m = ranks.shape[1]
        self.pairs = np.stack(np.triu_indices(self.m, 1), axis=1)
        labels = [(ranks[:, a] < ranks[:, b]).astype(np.int64) for a, b in self.pairs]
        self.models = Parallel(n_jobs=self.n_jobs)(
            delayed(_fit_pair)(X, y, seed, self.cv, self.eps) for y in labels)
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

    def __init__(self, cv: int = 2, eps: float = 1e-6, n_jobs: int | None = 1, n_iter: int = 100):
        super().__init__(cv=cv, eps=eps, n_jobs=n_jobs)
        self.n_iter = int(n_iter)

    def predict_distribution(self, X) -> PlackettLuce:
        return PlackettLuce(zermelo_log_weights(self.predict_pairwise(X), self.n_iter))


LEARNERS = {
    "plackett_luce": PlackettLuceNet,
    "mallows": MallowsLearner,
    "rank_classifier": RankClassifierNet,
    "rpc": RPCLearner,
    "pl_rpc": PLRPCLearner,
}
