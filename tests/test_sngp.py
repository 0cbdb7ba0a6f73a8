"""SNGP (rewarduq_exp/methods/sngp.py): the spectral norms of the trained residual layers within their bound, the GP
layer's Laplace covariance against a direct dense computation, u growing with the distance from the training data
(the residual + spectral-normalised body preserves distance), the prior precision by the evidence, save/load,
refusals, the planner, and the run as a user makes it (train.py, evaluate.py, the Python API, downstream.py's
best-of-n, plan=true)."""

import json

import numpy as np
import pytest
import torch
from head_method_end_to_end import (
    assert_best_of_n_reads,
    assert_completed,
    assert_evaluate_and_api_reproduce,
    assert_plans,
    train_tiny,
)
from test_knn_method import fit, subspace_pairs

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.base import load_method
from rewarduq_exp.methods.posteriors.evidence import log_evidence
from rewarduq_exp.methods.sngp import Sngp

F64 = torch.float64


def make(**kw):
    defaults = dict(hidden_dim=16, num_random_features=64, learning_rate=1e-2, batch_size=32, num_epochs=3, seed=0,
                    prior_precision=1.0, device="cpu", show_progress=False)
    return Sngp(**{**defaults, **kw})


@pytest.fixture(scope="module")
def trained():
    """Trained long at a high rate, so the residual weights grow past the bound and the normalisation acts."""
    zc, zr, w = subspace_pairs(n=300, weighted=True)
    return fit(make(num_epochs=30, learning_rate=3e-2, spec_norm_bound=0.5), zc, zr, w), (zc, zr, w)


def test_each_hidden_layer_meets_the_spectral_norm_bound_after_training(trained):
    m, (zc, zr, _) = trained
    sigmas = m.gp_summary["spectral_norms_before_bound"]
    assert len(sigmas) == m.num_hidden_layers and max(sigmas) > m.spec_norm_bound   # the bound had work to do
    for layer, sigma in zip(m.network.layers, sigmas):
        norm = float(torch.linalg.matrix_norm(layer.weight.detach().double(), ord=2))
        assert norm <= m.spec_norm_bound + 1e-5
        assert norm == pytest.approx(min(sigma, m.spec_norm_bound), rel=1e-5)   # W / max(1, sigma / c)
    assert not m.network.spectral   # materialised: plain tensors, no power-iteration state
    assert np.mean(m.score_features(zc).reward > m.score_features(zr).reward) > 0.8   # it learned the task


def test_during_training_the_bounded_weight_is_torchs_normalised_weight_times_min_sigma_c():
    """Before materialising: the weight used in the forward is W / max(1, sigma / c) with torch's sigma estimate;
    once the power iteration has converged, its spectral norm is min(sigma(W), c)."""
    m = make(spec_norm_bound=0.3)
    m._build(5)
    layer = m.network.layers[0]
    for _ in range(200):   # each access in training mode is one power iteration
        m.network.bounded_weight(layer)
    w = layer.parametrizations.weight.original.detach().double()
    sigma = float(torch.linalg.matrix_norm(w, ord=2))
    bounded = m.network.bounded_weight(layer).detach().double()
    assert float(torch.linalg.matrix_norm(bounded, ord=2)) == pytest.approx(min(sigma, 0.3), rel=1e-4)
    torch.testing.assert_close(bounded, w / max(1.0, sigma / 0.3), rtol=1e-4, atol=1e-6)


def test_the_gp_covariance_is_the_inverse_of_the_prior_plus_the_bt_hessian_of_random_feature_differences(trained):
    """P = lambda I + sum_i w_i p_i (1 - p_i) dphi_i dphi_i^T, by a Python loop over the pairs in float64 (pair weights
    other than 1); u^2 = phi^T P^-1 phi with the explicit inverse."""
    m, (zc, zr, w) = trained
    with torch.no_grad():   # the float32 random features the model scores with, their differences in float32 too
        d_phi = (m.network.random_features(zc) - m.network.random_features(zr)).double()
        beta = m.network.beta.double()
    lam = m.posterior.prior_precision
    assert lam == 1.0 and m.gp_summary["prior_precision_used"] == 1.0
    direct = lam * torch.eye(64, dtype=F64)
    for dp, wi in zip(d_phi, w.double()):
        p = torch.sigmoid(dp @ beta)
        direct += wi * p * (1 - p) * torch.outer(dp, dp)
    torch.testing.assert_close(m.posterior.precision, direct, rtol=1e-9, atol=1e-9)
    z = torch.randn(20, 12, generator=torch.Generator().manual_seed(4))
    phi = m.network.random_features(z).detach().double()
    u2 = torch.einsum("bi,ij,bj->b", phi, torch.linalg.inv(direct), phi)
    np.testing.assert_allclose(m.score_features(z).u, u2.sqrt().numpy(), rtol=1e-5)
    np.testing.assert_allclose(m.score_features(z).reward, (phi @ beta).numpy(), rtol=1e-5, atol=1e-6)


def test_u_grows_with_the_distance_from_the_training_data(trained):
    """Training features span the first 6 dimensions. Moving training points along the 6 unseen ones by t, u rises
    with t towards the prior's standard deviation lambda^-1/2 (phi^T phi ~= 1), which no point near the data reaches;
    the body keeps the distance (bi-Lipschitz: no far point is mapped close)."""
    m, (zc, _, _) = trained
    g = torch.Generator().manual_seed(5)
    direction = torch.zeros(12)
    direction[6:] = torch.randn(6, generator=g)
    direction /= direction.norm()
    base = zc[:100]
    scale = float(m.network.feature_sd[:6].mean())   # a training feature's sd (the unseen dimensions have sd 1)
    u = [m.score_features(base + t * scale * direction).u.mean() for t in (0.0, 2.0, 3.0, 5.0)]
    assert u[0] < u[1] < u[2] < u[3], u   # measured 0.668, 0.697, 0.767, 0.896
    for t in (10.0, 20.0, 40.0):   # far away: the prior's sd sqrt(phi^T phi / lambda) (~1), which the data never lower
        far = base + t * scale * direction
        phi = m.network.random_features(far).detach().double()
        prior_sd = (phi.pow(2).sum(1) / m.posterior.prior_precision).sqrt().numpy()
        u_far = m.score_features(far).u
        assert np.all(u_far <= prior_sd + 1e-6) and u_far.mean() > 0.9 * prior_sd.mean() > 1.3 * u[0], t
    with torch.no_grad():   # distance-preserving: ||f(a) - f(b)|| >= (1 - c)^L ||h0(a) - h0(b)||
        a, b = base, base + 3.0 * scale * direction
        h0 = lambda z: m.network.standardise(z) @ m.network.projection.T   # noqa: E731
        ratio = (m.network.body(a) - m.network.body(b)).norm(dim=1) / (h0(a) - h0(b)).norm(dim=1)
    assert float(ratio.min()) >= (1 - m.spec_norm_bound) ** m.num_hidden_layers - 1e-6
    assert float(ratio.max()) <= (1 + m.spec_norm_bound) ** m.num_hidden_layers + 1e-6


def test_marglik_maximises_the_evidence_of_the_gp_layer():
    zc, zr, w = subspace_pairs(n=150, weighted=True)
    m = fit(make(prior_precision="marglik"), zc, zr, w)
    s = m.gp_summary
    lam = s["prior_precision_used"]
    assert m.posterior.prior_precision == lam and lam != 1.0
    g = m.posterior.spectrum()
    beta = m.network.beta.detach().double()
    grid = np.logspace(-6, 6, 1201)
    best = max(log_evidence(s["train_log_likelihood"], float(beta @ beta), g, v) for v in grid)
    assert s["log_marginal_likelihood"] >= best - 1e-9
    assert 0 < s["effective_parameters"] < 64


def test_save_and_load_give_identical_scores_and_draws(trained, tmp_path):
    m, (zc, zr, _) = trained
    m.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["method.json", "state.safetensors"]
    loaded = load_method(tmp_path, encoder=None, device="cpu", show_progress=False)
    assert type(loaded) is Sngp and loaded.hyperparameters() == m.hyperparameters()
    assert not loaded.network.spectral and loaded.posterior.prior_precision == m.posterior.prior_precision
    z = torch.cat([zc[:40], zr[:40] + 0.3])
    a, b = m.score_features(z), loaded.score_features(z)
    for field in ("reward", "u", "lower", "upper"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    draws = m._sample_features(z)
    assert draws.shape == (Sngp.POSTERIOR_SAMPLES, 80) and torch.equal(draws, loaded._sample_features(z))


def test_a_damaged_state_file_is_refused_in_one_line(trained, tmp_path):
    from safetensors.torch import load_file, save_file

    m, _ = trained
    m.save(tmp_path)
    tensors = load_file(tmp_path / "state.safetensors")
    save_file({**tensors, "posterior.precision": torch.zeros(65, 65, dtype=F64)}, tmp_path / "state.safetensors")
    with pytest.raises(UserError, match=r"state.safetensors.*posterior\.precision.*num_random_features=64") as err:
        load_method(tmp_path, encoder=None, device="cpu", show_progress=False)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kw, key", [(dict(spec_norm_bound=0), "spec_norm_bound"),
                                     (dict(num_random_features=0), "num_random_features"),
                                     (dict(num_random_features=10**6), "num_random_features"),
                                     (dict(hidden_dim=2.5), "hidden_dim"), (dict(num_hidden_layers=0),
                                                                             "num_hidden_layers"),
                                     (dict(gp_kernel_scale=-1.0), "gp_kernel_scale"),
                                     (dict(prior_precision="fixed"), "prior_precision"),
                                     (dict(prior_precision=0), "prior_precision"), (dict(beta=0.0), "beta")])
def test_bad_hyperparameters_are_one_line(kw, key):
    with pytest.raises(UserError, match=f"method.{key}=") as err:
        make(**kw)
    assert "\n" not in str(err.value)


def test_the_planner_counts_the_trained_parts_and_the_gp_posterior():
    from rewarduq_exp.runner.plan import compose_points, make_plan

    cfg = compose_points(["method=sngp", "model=qwen3-4b", "dataset=ultrafeedback"])[0][1]
    plan = make_plan(cfg)
    built = Sngp(device="cpu", show_progress=False)
    built._build(2560)
    assert plan.params_trainable == sum(p.numel() for p in built.network.parameters())
    training = next(p for p in plan.phases if p.name == "training")
    assert training.parts["GP layer posterior D x D (float64: G, G + lambda I, Cholesky)"] == 3 * 1024**2 * 8
    assert training.parts["SNGP fixed projection and random features (float32)"] == \
        (128 * 2560 + 1024 * 128 + 1024 + 2 * 2560) * 4


# ------------------------------------------------------------------------------------------------ as a user runs it
@pytest.fixture(scope="module")
def run_folder(tmp_path_factory, shared_cache):
    return train_tiny(tmp_path_factory, shared_cache, "sngp")


@pytest.mark.e2e
def test_train_evaluate_and_the_api_on_the_tiny_model(run_folder, shared_cache, tmp_path):
    _, folder, proc = run_folder
    info = assert_completed(folder, proc, "sngp")
    summary = info["fit_summary"]
    assert summary["feature_dim"] == 256 and summary["prior_precision_used"] > 0
    assert info["hyperparameters"]["prior_precision"] == "marglik" and summary["log_marginal_likelihood"] < 0
    assert summary["gp_length_scale"] > 0 and len(summary["spectral_norms_before_bound"]) == 2
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["synthetic_ood"]["bound_width"] > metrics["synthetic_eval"]["bound_width"]   # wider off the data
    assert_evaluate_and_api_reproduce(folder, tmp_path, shared_cache)


@pytest.mark.e2e
def test_best_of_n_reads_the_run(run_folder, shared_cache):
    assert_best_of_n_reads(run_folder, shared_cache, "sngp")


@pytest.mark.e2e
def test_plan_on_the_command_line(tmp_path):
    assert_plans(tmp_path, "sngp", "GP layer posterior")
