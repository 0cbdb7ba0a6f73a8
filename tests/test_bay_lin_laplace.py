"""BAY-LIN's Laplace side: the evidence (rewarduq_exp/methods/posteriors/evidence.py) against closed forms, the
fitted prior precision (``method.prior_precision=marglik``), the GGN posterior against autograd, and parity with
laplace-torch (skipped where it is not installed: it is the extra ``laplace``)."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_bay_lin import make_method, pairs
from test_cli import NO_FIGURES, run
from torch import nn

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.base import load_method
from rewarduq_exp.methods.posteriors.evidence import effective_parameters, fit_prior_precision, log_evidence
from rewarduq_exp.methods.posteriors.full import posterior_precision, quadratic_form_sqrt

F64 = torch.float64


def fitted(n=200, d=8, weight=None, **kw):
    zc, zr, w = pairs(n=n, d=d)
    if weight is not None:
        w = weight
    m = make_method(**kw)
    m._build(d)
    m._fit_features(zc, zr, w)
    return m, zc, zr, w


def curvature(m, zc, zr, w) -> torch.Tensor:
    """G = sum_i c_i dz_i dz_i^T at the head of ``m`` (its precision without the prior)."""
    return posterior_precision(zc - zr, m._curvature_coef(zc - zr, w), 0.0)


# ------------------------------------------------------------------------------------------- the evidence itself
def gaussian_world(n, d, seed=0, sigma2=0.7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=F64), torch.randn(n, generator=g, dtype=F64), sigma2


def gaussian_mode(x, y, sigma2, lam):
    """The exact posterior mean of y = X theta + N(0, sigma2 I), theta ~ N(0, I / lam)."""
    a = x.T @ x / sigma2
    return torch.linalg.solve(a + lam * torch.eye(x.shape[1], dtype=F64), x.T @ y / sigma2)


def exact_gaussian_evidence(x, y, sigma2, lam) -> float:
    """log N(y; 0, sigma2 I + X X^T / lam): the marginal likelihood in closed form."""
    cov = sigma2 * torch.eye(len(y), dtype=F64) + x @ x.T / lam
    return float(torch.distributions.MultivariateNormal(torch.zeros(len(y), dtype=F64), cov).log_prob(y))


def laplace_gaussian_evidence(x, y, sigma2, lam) -> float:
    """The module's evidence, given the Gaussian likelihood: log N(y; X theta*, sigma2 I) and the eigenvalues of its
    curvature X^T X / sigma2."""
    theta = gaussian_mode(x, y, sigma2, lam)
    log_lik = float(torch.distributions.Normal(x @ theta, math.sqrt(sigma2)).log_prob(y).sum())
    eigenvalues = torch.linalg.eigvalsh(x.T @ x / sigma2).numpy()
    return log_evidence(log_lik, float(theta @ theta), eigenvalues, lam)


@pytest.mark.parametrize("n", [30, 4])   # 4 < d: G has zero eigenvalues, the prior alone holds those directions
@pytest.mark.parametrize("lam", [1e-2, 1.0, 30.0])
def test_evidence_is_exact_for_the_linear_gaussian_model(n, lam):
    x, y, sigma2 = gaussian_world(n, d=6)
    exact = exact_gaussian_evidence(x, y, sigma2, lam)
    assert laplace_gaussian_evidence(x, y, sigma2, lam) == pytest.approx(exact, rel=1e-10, abs=1e-8)


def test_fitted_prior_precision_maximises_the_evidence_over_a_dense_grid():
    rng = np.random.default_rng(0)
    eigenvalues = np.concatenate([rng.gamma(0.5, 40.0, size=37), np.zeros(3)])   # spread out, some directions empty
    theta_sq, log_lik = 3.7, -123.4
    lam = fit_prior_precision(theta_sq, eigenvalues)
    grid = np.logspace(-8, 8, 16001)   # 1000 points a decade
    values = np.array([log_evidence(log_lik, theta_sq, eigenvalues, v) for v in grid])
    best = log_evidence(log_lik, theta_sq, eigenvalues, lam)
    assert best >= values.max() - 1e-12 * abs(best)
    assert abs(math.log10(lam / grid[values.argmax()])) <= 1e-3   # within a grid step of the grid's best
    # the stationarity condition (MacKay): effective parameters = lambda ||theta||^2
    assert effective_parameters(eigenvalues, lam) == pytest.approx(lam * theta_sq, rel=1e-9)


def test_fitted_prior_precision_at_the_edges():
    assert fit_prior_precision(0.0, [1.0, 2.0]) == 1e10   # theta* = 0: the evidence rises with lambda without end
    assert fit_prior_precision(1.0, [0.0, 0.0]) == 1e-10  # no curvature: it falls with lambda
    assert fit_prior_precision(1.0, [5.0, 5.0], lower=10.0) == 10.0   # the root is below the range
    assert fit_prior_precision(1e-6, [1e3] * 4, upper=100.0) == 100.0  # and above it


def test_alternating_refits_reach_the_exact_type_2_maximum_in_the_gaussian_model():
    """``marglik_refits``' scheme: refit theta* at the fitted lambda, fit lambda again. Its fixed point is the maximum
    of the exact evidence (for the linear-Gaussian model, where theta*(lambda) is known in closed form)."""
    x, y, sigma2 = gaussian_world(60, d=5, seed=1)
    eigenvalues = torch.linalg.eigvalsh(x.T @ x / sigma2).numpy()
    lam = 1.0
    for _ in range(300):
        theta = gaussian_mode(x, y, sigma2, lam)
        lam = fit_prior_precision(float(theta @ theta), eigenvalues)
    grid = np.logspace(-4, 4, 801)
    values = np.array([exact_gaussian_evidence(x, y, sigma2, v) for v in grid])
    assert exact_gaussian_evidence(x, y, sigma2, lam) >= values.max() - 1e-9
    assert abs(math.log10(lam / grid[values.argmax()])) <= 1e-2   # within a grid step of the grid's best


# ------------------------------------------------------------------------------------------- BAY-LIN with marglik
def test_marglik_fit_records_a_lambda_that_maximises_the_evidence_at_its_head():
    for hessian in ("unweighted", "weighted"):
        m, zc, zr, w = fitted(hessian=hessian, prior_precision="marglik")
        s = m.laplace_summary
        g = curvature(m, zc, zr, w)
        lam = s["marglik_prior_precision"]
        torch.testing.assert_close(m.precision, g + lam * torch.eye(8, dtype=F64), rtol=1e-12, atol=1e-12)
        eigenvalues = torch.linalg.eigvalsh(g).numpy()
        theta = m.head.weight.detach().double()[0]
        log_lik = float((w.double() * F.logsigmoid((zc - zr).double() @ theta)).sum())
        assert s["marglik_log_likelihood"] == pytest.approx(log_lik, rel=1e-12)
        grid = np.logspace(-6, 6, 1201)
        values = [log_evidence(log_lik, float(theta @ theta), eigenvalues, v) for v in grid]
        assert s["marglik_log_evidence"] >= max(values) - 1e-9
        assert s["marglik_log_evidence"] >= s["marglik_log_evidence_at_reg_lambda"]


def bt_world(lam_true, d=20, n=4000, seed=0):
    """Pairs of a Bradley-Terry world whose true head is drawn from the prior N(0, I / lam_true)."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(d, generator=g) / math.sqrt(lam_true)
    dz = torch.randn(n, d, generator=g) * math.sqrt(2)   # z_c - z_r of two N(0, I) features
    first_wins = torch.rand(n, generator=g) < torch.sigmoid(dz @ theta)
    dz = torch.where(first_wins[:, None], dz, -dz)       # chosen minus rejected
    return dz, torch.zeros_like(dz), torch.ones(n), theta


@pytest.mark.parametrize("lam_true", [2.0, 20.0])
def test_marglik_recovers_the_prior_scale_of_a_simulated_world(lam_true):
    """theta ~ N(0, I / lam_true), BT labels. The first MAP is over-regularised on purpose (reg_lambda = 0.1 on the
    mean loss is a prior precision of 0.1 * 4000 = 400), so the post-hoc lambda at its head is far too large; the
    refits (head retrained at lambda / W, lambda fitted again) settle within a factor 1.5 of d / ||theta_true||^2,
    and of lam_true within 2. A mis-scaled refit (lambda instead of lambda / W on the mean loss) runs away."""
    zc, zr, w, theta_true = bt_world(lam_true)
    oracle = theta_true.numel() / float(theta_true @ theta_true)
    m = make_method(hessian="weighted", prior_precision="marglik", marglik_refits=3, reg_lambda=0.1,
                    learning_rate=5e-2, batch_size=64, num_epochs=3)
    m._build(zc.shape[1])
    m._fit_features(zc, zr, w)
    rounds = m.laplace_summary["marglik_prior_precision_rounds"]
    assert rounds[0] > 1.5 * oracle, rounds                       # post hoc at the over-regularised head
    assert abs(math.log(rounds[-1] / rounds[-2])) < 0.01, rounds  # the alternation has settled
    assert oracle / 1.5 < rounds[-1] < oracle * 1.5, (rounds, oracle)
    assert lam_true / 2 < rounds[-1] < lam_true * 2


def test_weighted_precision_is_the_autograd_hessian_of_the_negative_log_posterior():
    """H (hessian=weighted) = the Hessian of sum_i w_i (-log sigmoid(theta^T dz_i)) + lambda/2 ||theta||^2 at the
    fitted head: for a linear head the GGN of the BT likelihood is its exact Hessian. Pair weights other than 1."""
    w = torch.rand(60, generator=torch.Generator().manual_seed(3)) * 1.5 + 0.5
    for prior in ("fixed", "marglik"):
        m, zc, zr, _ = fitted(n=60, d=5, weight=w, hessian="weighted", prior_precision=prior)
        lam = m.laplace_summary.get("marglik_prior_precision", m.reg_lambda)
        dz, w64 = (zc - zr).double(), w.double()

        def neg_log_posterior(theta, dz=dz, w64=w64, lam=lam):
            return (w64 * F.softplus(-(dz @ theta))).sum() + 0.5 * lam * theta @ theta

        h = torch.autograd.functional.hessian(neg_log_posterior, m.head.weight.detach().double()[0])
        torch.testing.assert_close(m.precision, h, rtol=1e-8, atol=1e-8 * float(h.abs().max()))


def test_marglik_run_saves_and_loads_back_identically(tmp_path):
    m, zc, zr, _ = fitted(n=64, prior_precision="marglik", marglik_refits=1, hessian="weighted")
    m.fit_summary = dict(m.laplace_summary)   # what fit() adds to the base class's summary
    m.save(tmp_path)
    loaded = load_method(tmp_path, device="cpu", show_progress=False)   # settings from method.json
    assert (loaded.prior_precision, loaded.marglik_refits, loaded.hessian) == ("marglik", 1, "weighted")
    assert loaded.fit_summary["marglik_prior_precision"] == m.laplace_summary["marglik_prior_precision"]
    assert len(loaded.fit_summary["marglik_prior_precision_rounds"]) == 2
    torch.testing.assert_close(loaded.precision, m.precision, rtol=0, atol=0)
    a, b = m.score_features(zc), loaded.score_features(zc)
    for field in ("reward", "lower", "upper"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_a_number_sets_the_posteriors_lambda_apart_from_the_maps_and_fixed_is_reg_lambda(tmp_path):
    """prior_precision: fixed is the number reg_lambda (the same head and precision to the bit); another number changes
    H = G + lambda I only (the MAP is reg_lambda's). The saved file keeps BAY-LIN's layout; lambda comes back from the
    settings."""
    fixed, zc, zr, w = fitted(hessian="weighted")
    same, *_ = fitted(hessian="weighted", prior_precision=0.1)   # make_method's reg_lambda
    other, *_ = fitted(hessian="weighted", prior_precision=3.0)
    assert torch.equal(fixed.precision, same.precision) and torch.equal(fixed.head.weight, other.head.weight)
    torch.testing.assert_close(other.precision, curvature(fixed, zc, zr, w) + 3.0 * torch.eye(8, dtype=F64),
                               rtol=0, atol=0)
    other.save(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "state.safetensors"), framework="pt") as fh:
        assert set(fh.keys()) == {"head.weight", "precision", "feature_mean"}
    loaded = load_method(tmp_path, device="cpu", show_progress=False)
    assert loaded.prior_precision == 3.0 and loaded.posterior.prior_precision == 3.0
    assert loaded.posterior.log_evidence(-1.0, 1.0) == pytest.approx(other.posterior.log_evidence(-1.0, 1.0),
                                                                     rel=1e-9)


@pytest.mark.parametrize("kw, message", [
    (dict(prior_precision="evidence"), "method.prior_precision='evidence' is invalid; allowed: marglik or a number "
                                       r"> 0, or fixed \(= method.reg_lambda\)$"),
    (dict(prior_precision=0), "method.prior_precision=0 is invalid"),
    (dict(marglik_refits=-1), "method.marglik_refits=-1 is invalid"),
    (dict(marglik_refits=2), "method.marglik_refits=2 needs method.prior_precision=marglik"),
    (dict(marglik_refits=2, prior_precision=1.0), "method.marglik_refits=2 needs method.prior_precision=marglik "
                                                  r"\(with prior_precision=1.0 lambda is that number"),
])
def test_bad_marglik_settings(kw, message):
    with pytest.raises(UserError, match=message):
        make_method(**kw)


def test_train_py_with_marglik(tmp_path, shared_cache):
    """``python train.py method=bay_lin method.prior_precision=marglik``: the fitted lambda and the evidence in the
    run's fit summary (status.json "fit", model/method.json), and evaluate.py scores the saved run as training did
    (from the saved precision: nothing is refitted)."""
    folder = tmp_path / "outputs" / "runs" / "marglik"
    args = ["method=bay_lin", "method.prior_precision=marglik", "method.marglik_refits=1", "method.hessian=weighted",
            "progress=false", "dataset.n_train=400", "dataset.n_eval=100", "dataset.n_ood=100", "dataset.n_cal=100",
            *NO_FIGURES, f"hydra.run.dir={folder}"]
    proc = run("train.py", args, tmp_path, shared_cache)
    assert "marglik_prior_precision" in proc.stdout + proc.stderr
    method_info = json.loads((folder / "model" / "method.json").read_text())
    assert method_info["hyperparameters"]["prior_precision"] == "marglik"
    lam = method_info["fit_summary"]["marglik_prior_precision"]
    assert lam > 0 and len(method_info["fit_summary"]["marglik_prior_precision_rounds"]) == 2
    fit = json.loads((folder / "status.json").read_text())["fit"]
    assert fit["marglik_prior_precision"] == lam and fit["marglik_log_evidence"] >= fit[
        "marglik_log_evidence_at_reg_lambda"]
    before = json.loads((folder / "metrics.json").read_text())
    run("evaluate.py", [f"run={folder}", "dataset=synthetic_ood", "progress=false", *NO_FIGURES], tmp_path,
        shared_cache)
    after = json.loads((folder / "metrics.json").read_text())
    for key in ("win_rate", "ece", "ebce", "rs_0.2", "bound_width"):
        if key in before["synthetic_ood"]:
            assert after["synthetic_ood"][key] == pytest.approx(before["synthetic_ood"][key], abs=1e-9), key


# ------------------------------------------------------------------------------------------- laplace-torch parity
class BTLogits(nn.Module):
    """The BT likelihood as laplace-torch's 2-class classification: logits [0, theta^T dz] with label 1 (chosen)
    give -log softmax(.)_1 = -log sigmoid(theta^T dz); the logits' Jacobian is [0; dz^T] and the softmax's Hessian
    diag(p) - p p^T has s (1 - s) at (1, 1), so the GGN is s (1 - s) dz dz^T: eq. 15's weighted term."""

    def __init__(self, head: nn.Linear):
        super().__init__()
        self.head = head

    def forward(self, dz):
        r = self.head(dz)
        return torch.cat([torch.zeros_like(r), r], -1)


def laplace_fit(model, likelihood, x, y, lam, **kw):
    from laplace import Laplace
    from torch.utils.data import DataLoader, TensorDataset

    la = Laplace(model, likelihood, subset_of_weights="all", hessian_structure="full", prior_precision=lam, **kw)
    la.fit(DataLoader(TensorDataset(x, y), batch_size=32))
    return la


def float64_head(m) -> nn.Linear:
    head = nn.Linear(m.head.in_features, 1, bias=False).double()
    with torch.no_grad():
        head.weight.copy_(m.head.weight.double())
    return head


@pytest.fixture(scope="module")
def laplace_lib():
    return pytest.importorskip("laplace")


@pytest.mark.parametrize("prior", ["fixed", "marglik"])
def test_unweighted_precision_equals_laplace_torch_regression(laplace_lib, prior):
    """hessian=unweighted: H = lambda I + sum dz dz^T is the Laplace posterior precision of a linear no-bias model of
    dz with a unit-variance Gaussian likelihood (the targets do not enter it). Weight-1 pairs: a pair of weight w
    would be its dz scaled by sqrt(w)."""
    m, zc, zr, _ = fitted(prior_precision=prior)
    lam = m.laplace_summary.get("marglik_prior_precision", m.reg_lambda)
    dz = (zc - zr).double()
    la = laplace_fit(float64_head(m), "regression", dz, torch.zeros(len(dz), 1, dtype=F64), lam, sigma_noise=1.0)
    torch.testing.assert_close(la.posterior_precision, m.precision, rtol=5e-6, atol=5e-6 * float(m.precision.max()))


def test_weighted_precision_and_evidence_equal_laplace_torch_classification(laplace_lib):
    m, zc, zr, _ = fitted(hessian="weighted", prior_precision="marglik")
    s = m.laplace_summary
    lam = s["marglik_prior_precision"]
    dz = (zc - zr).double()
    la = laplace_fit(BTLogits(float64_head(m)), "classification", dz, torch.ones(len(dz), dtype=torch.long), lam)
    torch.testing.assert_close(la.posterior_precision, m.precision, rtol=1e-6, atol=1e-6 * float(m.precision.max()))
    # laplace-torch's log marginal likelihood: log p(D | theta*) - (log det(H) - d log lambda + lambda ||theta||^2) / 2
    assert float(la.log_likelihood) == pytest.approx(s["marglik_log_likelihood"], rel=1e-12)
    assert float(la.log_marginal_likelihood()) == pytest.approx(s["marglik_log_evidence"], rel=1e-7)


@pytest.mark.filterwarnings("ignore:Full backward hook", "ignore:Extension saving to grad_batch")
@pytest.mark.parametrize("hessian", ["unweighted", "weighted"])
def test_uncertainty_equals_laplace_torch_functional_variance(laplace_lib, hessian):
    """u(z) = sqrt(z^T H^-1 z) is the GLM predictive standard deviation of the reward r(z) = theta^T z, whose
    Jacobian is z. BackPack's GGN here: laplace-torch 0.3's default (Curvlinops) backend builds the full matrix by
    multiplying with a float32 identity, which leaves ~3e-8 relative error in H even for a float64 model."""
    from laplace.curvature import BackPackGGN

    m, zc, zr, _ = fitted(hessian=hessian, prior_precision="marglik")
    lam = m.laplace_summary["marglik_prior_precision"]
    dz = (zc - zr).double()
    if hessian == "unweighted":
        la = laplace_fit(float64_head(m), "regression", dz, torch.zeros(len(dz), 1, dtype=F64), lam,
                         sigma_noise=1.0, backend=BackPackGGN)
    else:
        la = laplace_fit(BTLogits(float64_head(m)), "classification", dz, torch.ones(len(dz), dtype=torch.long),
                         lam, backend=BackPackGGN)
    z = torch.cat([zc, zr])[:50]
    expected = la.functional_variance(z.double()[:, None, :])[:, 0, 0].sqrt()
    torch.testing.assert_close(quadratic_form_sqrt(m.cholesky, z - m.feature_mean), expected, rtol=2e-9, atol=2e-9)
    u = (m.score_features(z).upper - m.score_features(z).reward) / m.beta   # the float32 u the scores carry
    np.testing.assert_allclose(u, expected.numpy(), rtol=2e-6)
