"""PL-RPC's pairwise-to-Plackett-Luce aggregation: the default (``mle``) reaches the Bradley-Terry maximum-likelihood
weights, checked against a general optimiser and on near-degenerate inputs; ``zermelo_reference`` reproduces the
reference code's 100 simultaneous improved-Zermelo steps (values recorded from that code), including the 2-cycle it
ends on for some inputs; the option is checked, saved and reloaded."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.optimize import minimize
from scipy.special import expit, logsumexp

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.label_ranking import (
    PL_RPC_AGGREGATIONS,
    PLRPCLearner,
    bradley_terry_log_likelihood,
    bradley_terry_log_weights,
    zermelo_reference_log_weights,
)
from rewarduq_exp.ranking.permutations import orderings_to_ranks
from rewarduq_exp.ranking.plackett_luce import PlackettLuce

# The input on which the simultaneous Zermelo step alternates between two points after 100 and 101 steps.
OSCILLATING = np.array([[[0.0, 0.9697, 0.8261], [0.0303, 0.0, 0.9517], [0.1739, 0.0483, 0.0]]])


def pairwise(rng, n: int, m: int, low: float = 0.0, high: float = 1.0) -> np.ndarray:
    """n random (m, m) matrices with P_ij + P_ji = 1 off the diagonal, P_ij uniform in [low, high] for i < j."""
    P = np.zeros((n, m, m))
    i, j = np.triu_indices(m, 1)
    p = rng.uniform(low, high, size=(n, len(i)))
    P[:, i, j], P[:, j, i] = p, 1 - p
    return P


def gradient(theta: np.ndarray, A: np.ndarray) -> np.ndarray:
    """dL/dtheta_i = sum_{j != i} [a_ij (1 - p_ij) - a_ji p_ij], p_ij = sigmoid(theta_i - theta_j); one sample."""
    A = A.copy()
    np.fill_diagonal(A, 0.0)
    p = expit(theta[:, None] - theta[None, :])
    return (A * (1 - p) - A.T * p).sum(axis=1)


def scipy_mle(A: np.ndarray) -> np.ndarray:
    """Normalised log-weights maximising L for one sample, by BFGS over theta_0..theta_{m-2} with theta_{m-1} = 0."""
    m = len(A)

    def negative(x):
        theta = np.append(x, 0.0)
        return -bradley_terry_log_likelihood(theta[None], A[None])[0], -gradient(theta, A)[:-1]

    x = minimize(negative, np.zeros(m - 1), jac=True, method="BFGS", options={"gtol": 1e-11, "maxiter": 5000}).x
    theta = np.append(x, 0.0)
    return theta - logsumexp(theta)


# ---------------------------------------------------------------------------------------------------- mle
def test_the_oscillating_example_converges_to_the_mle_and_stays_there():
    log_w, iterations, converged = bradley_terry_log_weights(OSCILLATING, return_iterations=True)
    assert converged.all() and iterations[0] < 20
    np.testing.assert_allclose(np.exp(log_w[0]), [0.808, 0.157, 0.035], atol=1e-3)
    np.testing.assert_allclose(np.exp(log_w).sum(axis=1), 1.0, rtol=1e-12)
    assert np.abs(gradient(log_w[0], OSCILLATING[0])).max() < 1e-12
    more = bradley_terry_log_weights(OSCILLATING, tol=1e-300, max_iter=300)  # keeps stepping: a fixed point
    np.testing.assert_allclose(more, log_w, atol=1e-12)
    np.testing.assert_allclose(log_w[0], scipy_mle(OSCILLATING[0]), atol=1e-6)
    # the reference's simultaneous step does not get there: it alternates between two points far from the MLE
    a, b = (np.exp(zermelo_reference_log_weights(OSCILLATING, n)) for n in (100, 101))
    np.testing.assert_allclose(a, np.exp(zermelo_reference_log_weights(OSCILLATING, 102)), atol=1e-9)
    assert np.abs(a - b).max() > 0.4 and np.abs(a - np.exp(log_w)).max() > 0.1


@pytest.mark.parametrize("m", [2, 3, 6, 10])
def test_mle_equals_a_general_optimiser_on_random_inputs(m):
    rng = np.random.default_rng(m)
    P = pairwise(rng, 6, m)
    counts = rng.uniform(0.1, 3.0, size=(2, m, m))  # general soft counts: a_ij + a_ji need not be 1
    A = np.concatenate([P, counts])
    log_w = bradley_terry_log_weights(A)
    for k in range(len(A)):
        reference = scipy_mle(A[k])
        np.testing.assert_allclose(np.exp(log_w[k]), np.exp(reference), atol=1e-6)
        assert np.abs(gradient(log_w[k], A[k])).max() < 1e-9
        ours, theirs = (bradley_terry_log_likelihood(x[None], A[k][None])[0] for x in (log_w[k], reference))
        assert ours >= theirs - 1e-9


@pytest.mark.parametrize("m", [2, 3, 6, 15, 26])
def test_mle_on_near_degenerate_inputs(m):
    """Clipped extremes (1e-6, 1 - 1e-6) in a consistent order and at random, and all 0.5: finite, converged,
    zero gradient, and (for the smaller m) the same optimum as the general optimiser."""
    rng = np.random.default_rng(100 + m)
    order = np.full((1, m, m), 1e-6)
    order[0][np.triu_indices(m, 1)] = 1 - 1e-6
    extreme = np.where(pairwise(rng, 3, m) > 0.5, 1 - 1e-6, 1e-6)
    i, j = np.triu_indices(m, 1)
    extreme[:, j, i] = 1 - extreme[:, i, j]
    half = np.full((1, m, m), 0.5)
    A = np.concatenate([order, extreme, half])
    log_w, _, converged = bradley_terry_log_weights(A, return_iterations=True)
    assert np.isfinite(log_w).all() and converged.all()
    np.testing.assert_allclose(log_w[-1], -np.log(m), atol=1e-12)
    for k in range(len(A)):
        assert np.abs(gradient(log_w[k], A[k])).max() < 1e-9
        if m <= 6:
            np.testing.assert_allclose(np.exp(log_w[k]), np.exp(scipy_mle(A[k])), atol=1e-6)
    assert (np.diff(log_w[0]) < 0).all()  # the consistent order is kept


def test_mle_is_vectorised_and_each_sample_is_independent():
    rng = np.random.default_rng(0)
    P = np.concatenate([pairwise(rng, 5, 4), np.where(pairwise(rng, 3, 4) > 0.5, 1 - 1e-6, 1e-6)])
    i, j = np.triu_indices(4, 1)
    P[:, j, i] = 1 - P[:, i, j]
    together = bradley_terry_log_weights(P)
    alone = np.concatenate([bradley_terry_log_weights(P[k:k + 1]) for k in range(len(P))])
    np.testing.assert_allclose(together, alone, atol=1e-12)
    assert bradley_terry_log_weights(P[:0]).shape == (0, 4)
    np.testing.assert_array_equal(bradley_terry_log_weights(np.zeros((2, 1, 1))), np.zeros((2, 1)))


def test_mle_without_a_maximiser_stays_finite():
    """Exact 0/1 probabilities of a strict order have no maximiser (the weights run off); the result is finite."""
    P = np.zeros((1, 4, 4))
    P[0][np.triu_indices(4, 1)] = 1.0
    log_w = bradley_terry_log_weights(P, max_iter=30)
    assert np.isfinite(log_w).all() and (np.diff(log_w[0]) < 0).all()


# ---------------------------------------------------------------------------------------------------- reference
# Inputs and the weights the reference code's vectorised improved-Zermelo function returned for them, called as
# the reference experiment calls it (a fresh numpy default_rng(42), 100 iterations; float64).
REFERENCE_CASES = [
    (OSCILLATING, 100, [[0.9280644472798113, 0.031183036317180748, 0.04075251640300797]]),
    (OSCILLATING, 101, [[0.47199236187880544, 0.507989136434446, 0.020018501686748503]]),
    ([[[0.0, 0.793, 0.796, 0.515], [0.207, 0.0, 0.294, 0.072], [0.204, 0.706, 0.0, 0.388],
       [0.485, 0.928, 0.612, 0.0]],
      [[0.0, 0.412, 0.063, 0.067], [0.588, 0.0, 0.979, 0.646], [0.937, 0.021, 0.0, 0.245],
       [0.933, 0.354, 0.755, 0.0]]], 100,
     [[0.4061515156815491, 0.06451088799964257, 0.16010489892817809, 0.3692326973906302],
      [0.05620073375811969, 0.4486508237115601, 0.1335656214842009, 0.3615828210461192]]),
    # m = 2: the simultaneous step maps the ratio r of the weights to (a_12 / a_21)^2 / r, so it never converges
    ([[[0.0, 0.999999], [1e-06, 0.0]], [[0.0, 0.5], [0.5, 0.0]], [[0.0, 0.3], [0.7, 0.0]]], 100,
     [[0.6381382257756006, 0.36186177422439936], [0.5518102246832358, 0.4481897753167641],
      [0.08803269248618315, 0.9119673075138168]]),
]


@pytest.mark.parametrize("case", range(len(REFERENCE_CASES)))
def test_zermelo_reference_equals_the_reference_code(case):
    P, n_iter, expected = REFERENCE_CASES[case]
    np.testing.assert_allclose(np.exp(zermelo_reference_log_weights(np.array(P), n_iter)), expected,
                               rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------------------------------------- learner
def _toy(n=80, m=4, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3))
    orderings = PlackettLuce(X @ rng.normal(size=(3, m)) * 2).sample(rng, 1)[:, 0]
    return X, orderings_to_ranks(orderings)


def test_learner_aggregations_on_a_small_dataset():
    X, ranks = _toy()
    mle = PLRPCLearner(seed=0).fit(X[:60], ranks[:60])
    assert mle.aggregation == "mle" and PL_RPC_AGGREGATIONS == ("mle", "zermelo_reference")
    reference = PLRPCLearner(seed=0, aggregation="zermelo_reference")
    reference.__dict__.update({k: v for k, v in mle.__dict__.items() if k in ("m", "pairs", "models")})
    P = mle.predict_pairwise(X[60:])
    a, b = mle.plackett_luce_log_weights(X[60:]), reference.plackett_luce_log_weights(X[60:])
    np.testing.assert_array_equal(a, bradley_terry_log_weights(P, tol=1e-10, max_iter=100))
    np.testing.assert_array_equal(b, zermelo_reference_log_weights(P, 100))
    assert max(np.abs(gradient(a[k], P[k])).max() for k in range(len(P))) < 1e-9
    assert (bradley_terry_log_likelihood(a, P) >= bradley_terry_log_likelihood(b, P) - 1e-9).all()
    dist = mle.predict_distribution(X[60:])
    assert isinstance(dist, PlackettLuce) and (dist.n, dist.m) == (20, 4)


def test_bad_aggregation_is_one_user_error_line():
    with pytest.raises(UserError) as err:
        PLRPCLearner(aggregation="zermelo")
    message = str(err.value)
    assert "\n" not in message and "method.aggregation='zermelo'" in message
    assert "mle, zermelo_reference" in message
    with pytest.raises(UserError, match="method.n_iter"):
        PLRPCLearner(n_iter=0)
    with pytest.raises(UserError, match="method.tol"):
        PLRPCLearner(tol=0)


@pytest.mark.parametrize("aggregation", PL_RPC_AGGREGATIONS)
def test_save_and_load_keep_the_aggregation(aggregation, tmp_path):
    from rewarduq_exp.methods.base import load_method

    X, ranks = _toy()
    fitted = PLRPCLearner(seed=1, aggregation=aggregation).fit(X, ranks)
    fitted.save(tmp_path)
    info = json.loads((tmp_path / "method.json").read_text())
    assert info["hyperparameters"]["aggregation"] == aggregation
    loaded = load_method(tmp_path)
    assert loaded.aggregation == aggregation and loaded.hyperparameters() == fitted.hyperparameters()
    np.testing.assert_array_equal(loaded.plackett_luce_log_weights(X[:10]), fitted.plackett_luce_log_weights(X[:10]))


def test_a_method_json_without_the_aggregation_loads_as_mle(tmp_path):
    """Folders saved before the option existed (hyperparameters cv, eps, seed, n_iter) load with the default."""
    from rewarduq_exp.methods.base import load_method

    X, ranks = _toy()
    PLRPCLearner(seed=1).fit(X, ranks).save(tmp_path)
    info = json.loads((tmp_path / "method.json").read_text())
    info["hyperparameters"] = {k: info["hyperparameters"][k] for k in ("cv", "eps", "seed", "n_iter")}
    (tmp_path / "method.json").write_text(json.dumps(info))
    loaded = load_method(tmp_path)
    assert loaded.aggregation == "mle" and loaded.tol == 1e-10
