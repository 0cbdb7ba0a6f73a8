"""PL-RPC: RPC's pairwise probabilities turned into per-sample Plackett-Luce weights (appendix C), by the
Bradley-Terry maximum-likelihood weights or the reference code's improved-Zermelo steps."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from scipy.special import expit, logsumexp

from rewarduq_exp.core.checks import check_positive
from rewarduq_exp.core.setting_bounds import Bound
from rewarduq_exp.methods.label_ranking.rpc import PairwiseSettings, RPCLearner
from rewarduq_exp.methods.settings import one_of, positive, setting
from rewarduq_exp.ranking.plackett_luce import PlackettLuce

log = logging.getLogger("rewarduq_exp.methods.label_ranking")

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


@dataclass(kw_only=True)
class PLRPCSettings(PairwiseSettings, config="pl_rpc"):
    """Defaults and comments: ``conf/method/pl_rpc.yaml``."""

    aggregation: str = setting(check=one_of(PL_RPC_AGGREGATIONS), doc="mle | zermelo_reference")
    n_iter: int = setting(doc="Zermelo steps, or Newton steps at most",
                          bound=Bound(1, 1_000_000, "iterations", "the maximum-likelihood fit needs 5-15, the "
                                      "reference 100"))
    tol: float = setting(check=positive(cast=float), doc="mle: Newton's stopping tolerance")


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

    settings_class = PLRPCSettings

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

