"""The Laplace posterior API (rewarduq_exp/methods/posteriors/): FullPosterior against direct dense computations (the
precision, the predictive variance, posterior draws, the evidence and its maximiser), save and load, and the one check
of the ``prior_precision`` setting every Laplace method uses. KronPosterior's parity with laplace-torch is in
tests/test_la_lora.py, FullPosterior's (through BAY-LIN) in tests/test_bay_lin_laplace.py."""

import math

import numpy as np
import pytest
import torch

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.posteriors import FullPosterior, LaplacePosterior, prior_precision_setting
from rewarduq_exp.methods.posteriors.evidence import log_evidence

F64 = torch.float64


def rows(n=300, d=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.rand(n, generator=g, dtype=F64) * 0.25


def test_full_posterior_is_the_dense_formula_and_its_predictive_the_inverse():
    x, coef = rows()
    post = FullPosterior.fit(x, coef, prior_precision=0.7, chunk=64)   # several chunks
    assert isinstance(post, LaplacePosterior) and post.num_parameters == 7
    x64 = x.double()
    dense = 0.7 * torch.eye(7, dtype=F64) + sum(c * torch.outer(r, r) for r, c in zip(x64, coef))
    torch.testing.assert_close(post.precision, dense, rtol=1e-12, atol=1e-12)
    z = torch.randn(40, 7, generator=torch.Generator().manual_seed(1))
    by_inverse = torch.einsum("bi,ij,bj->b", z.double(), torch.linalg.inv(dense), z.double())
    torch.testing.assert_close(post.predictive_variance(z), by_inverse, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(post.predictive_sd(z), by_inverse.sqrt(), rtol=1e-10, atol=1e-12)
    # streamed in pieces: the same curvature
    pieces = FullPosterior(7)
    for i in range(0, 300, 100):
        pieces.accumulate(x[i:i + 100], coef[i:i + 100])
    pieces.set_prior_precision(0.7)
    torch.testing.assert_close(pieces.precision, post.precision, rtol=1e-12, atol=1e-12)


def test_posterior_draws_have_the_predictive_covariance():
    x, coef = rows(d=4)
    post = FullPosterior.fit(x, coef, prior_precision=2.0)
    z = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    draws = post.sample_offsets(z, 200_000, seed=0)   # (S, 3)
    assert torch.equal(draws, post.sample_offsets(z, 200_000, seed=0))   # seeded: the same on every call
    expected = z.double() @ torch.linalg.inv(post.precision) @ z.double().T
    torch.testing.assert_close(torch.cov(draws.T), expected, rtol=2e-2, atol=2e-2 * float(expected.diag().max()))


def test_optimised_prior_precision_maximises_the_evidence_and_sets_the_precision():
    x, coef = rows()
    post = FullPosterior.fit(x, coef)
    theta_sq, log_lik = 2.3, -40.0
    lam = post.optimise_prior_precision(theta_sq)
    assert post.prior_precision == lam
    g = torch.linalg.eigvalsh(post.curvature).numpy()
    grid = np.logspace(-4, 4, 4001)
    best = max(log_evidence(log_lik, theta_sq, g, v) for v in grid)
    assert post.log_evidence(log_lik, theta_sq) >= best - 1e-9
    assert post.effective_parameters() == pytest.approx(lam * theta_sq, rel=1e-9)   # MacKay's fixed point
    torch.testing.assert_close(post.precision, post.curvature + lam * torch.eye(7, dtype=F64), rtol=0, atol=0)
    assert post.apply_prior_precision("marglik", theta_sq) == lam
    assert post.apply_prior_precision(0.5, theta_sq) == 0.5 and post.prior_precision == 0.5


def test_saved_tensors_load_back_with_the_same_predictive_and_evidence():
    x, coef = rows()
    post = FullPosterior.fit(x, coef, prior_precision=0.3)
    loaded = FullPosterior.from_tensors({k: v.clone() for k, v in post.tensors().items()})
    z = torch.randn(10, 7)
    assert torch.equal(loaded.predictive_variance(z), post.predictive_variance(z))
    assert loaded.prior_precision == 0.3
    assert loaded.log_evidence(-5.0, 1.0) == pytest.approx(post.log_evidence(-5.0, 1.0), rel=1e-10)
    with pytest.raises(ValueError, match="prior_precision"):
        FullPosterior.from_tensors({**post.tensors(), "prior_precision": torch.tensor([-1.0], dtype=F64)})


def test_a_precision_that_is_not_positive_definite_says_to_raise_the_prior():
    x = torch.ones(5, 3)   # weights of the wrong sign (never from a likelihood): G negative definite on x's direction
    with pytest.raises(RuntimeError, match=r"lambda = 0\.5\) is not positive definite; raise the prior precision"):
        FullPosterior.fit(x, -torch.ones(5, dtype=F64), prior_precision=0.5)


@pytest.mark.parametrize("value, expected", [("marglik", "marglik"), (1, 1.0), (2.5, 2.5), ("fixed", "fixed")])
def test_prior_precision_setting_accepts_a_number_marglik_and_the_methods_own_words(value, expected):
    assert prior_precision_setting("fixed")(value, "method.prior_precision") == expected


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, True, "auto", "fixed", None])
def test_prior_precision_setting_refuses_in_one_line(value):
    with pytest.raises(UserError, match=r"^method.prior_precision=.* is invalid; allowed: marglik or a number > 0$"):
        prior_precision_setting()(value, "method.prior_precision")
