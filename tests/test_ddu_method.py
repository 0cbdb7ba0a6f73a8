"""DDU (rewarduq_exp/methods/ddu.py): the mixture's log density from its saved arrays against scikit-learn's
score_samples, the shift, u off the training data, save/load, refusals, the planner, and the run as a user makes it
(train.py, evaluate.py, the Python API, downstream.py's best-of-n, plan=true). The scale of u, which DDU shares with
k-NN, is tested in tests/test_knn_method.py."""

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
from sklearn.mixture import GaussianMixture
from test_knn_method import fit, subspace_pairs, training_rows

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.base import load_method
from rewarduq_exp.methods.ddu import COVARIANCE_TYPES, DduHead, gmm_log_density


def make(**kw):
    defaults = dict(hidden_dim=32, learning_rate=3e-2, batch_size=32, num_epochs=40, seed=0, device="cpu",
                    show_progress=False)
    return DduHead(**{**defaults, **kw})


@pytest.fixture(scope="module")
def trained():
    zc, zr, w = subspace_pairs()
    return fit(make(), zc, zr, w), (zc, zr, w)


@pytest.mark.parametrize("covariance_type", COVARIANCE_TYPES)
@pytest.mark.parametrize("k", [1, 3])
def test_the_log_density_of_the_arrays_is_sklearns_score_samples(covariance_type, k):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 1, (150, 5)) @ rng.normal(0, 1, (5, 5)), rng.normal(4, 0.5, (150, 5))])
    gmm = GaussianMixture(k, covariance_type=covariance_type, reg_covar=1e-3, random_state=0).fit(x)
    new = rng.normal(1, 3, (40, 5))
    ours = gmm_log_density(torch.from_numpy(new), *(torch.from_numpy(np.asarray(a)) for a in (
        gmm.weights_, gmm.means_, gmm.precisions_cholesky_)), covariance_type)
    np.testing.assert_allclose(ours.numpy(), gmm.score_samples(new), rtol=1e-10, atol=1e-9)


@pytest.mark.parametrize("covariance_type, k", [("full", 1), ("diag", 2), ("tied", 2), ("spherical", 3)])
def test_a_saved_and_loaded_head_scores_the_density_sklearn_fits_to_the_training_rows(covariance_type, k, tmp_path):
    """The mixture refitted by hand with scikit-learn on the standardised chosen and rejected features of the pairs
    the head trained on gives, through score_samples, the loaded head's log density; the shift is its smallest
    negative log density on those rows, so d is 0 there and >= 0 on every training row."""
    zc, zr, w = subspace_pairs(n=200)
    m = fit(make(covariance_type=covariance_type, n_components=k, num_epochs=2), zc, zr, w)
    m.save(tmp_path)
    loaded = load_method(tmp_path, encoder=None, device="cpu", show_progress=False)
    rows = training_rows(zc, zr)
    mean, sd = rows.mean(0), rows.std(0, unbiased=False)
    sd = torch.where(sd > 0, sd, torch.ones_like(sd))
    x = ((rows - mean) / sd).numpy()
    gmm = GaussianMixture(k, covariance_type=covariance_type, reg_covar=m.reg_covar, max_iter=100,
                          random_state=0).fit(x)
    new = torch.randn(30, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    np.testing.assert_allclose(-loaded.negative_log_density(loaded.standardise(new)).numpy(),
                               gmm.score_samples(((new - mean) / sd).numpy()), rtol=1e-8, atol=1e-6)
    assert loaded.shift == pytest.approx(-gmm.score_samples(x).max(), rel=1e-9)
    d = loaded.distance(torch.from_numpy(x) * sd + mean)
    assert float(d.min()) == pytest.approx(0.0, abs=1e-8) and (d >= 0).all()


def test_u_is_larger_far_outside_the_training_data_than_inside(trained):
    """As for k-NN (tests/test_knn_method.py); the density of the dimensions training never saw is reg_covar's,
    so u there is orders of magnitude above u inside (measured: 1070x the mean u inside; c = 0.33)."""
    m, (zc, zr, _) = trained
    g = torch.Generator().manual_seed(5)
    inside, outside = torch.zeros(200, 12), torch.zeros(200, 12)
    inside[:, :6], outside[:, 6:] = torch.randn(200, 6, generator=g), torch.randn(200, 6, generator=g)
    assert m.scale > 0.01
    assert m.score_features(outside).u.mean() > 10 * m.score_features(inside).u.mean()
    assert np.mean(m.score_features(zc).reward > m.score_features(zr).reward) > 0.7


def test_save_and_load_give_identical_scores(trained, tmp_path):
    m, (zc, zr, _) = trained
    m.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["method.json", "state.safetensors"]
    loaded = load_method(tmp_path, encoder=None, device="cpu", show_progress=False)
    assert type(loaded) is DduHead and loaded.hyperparameters() == m.hyperparameters()
    z = torch.cat([zc[:40], zr[:40] + 0.3])
    a, b = m.score_features(z), loaded.score_features(z)
    for field in ("reward", "u", "lower", "upper"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    loaded.score_batch_size = 7
    c = loaded.score_features(z)
    for field in ("reward", "u"):
        np.testing.assert_allclose(getattr(c, field), getattr(a, field), rtol=1e-6, atol=1e-6)


def test_a_mismatched_state_file_is_refused_in_one_line(trained, tmp_path):
    m, _ = trained
    m.save(tmp_path)
    info = json.loads((tmp_path / "method.json").read_text())
    (tmp_path / "method.json").write_text(json.dumps({**info, "hyperparameters": {**info["hyperparameters"],
                                                                                  "covariance_type": "diag"}}))
    with pytest.raises(UserError, match=r"state.safetensors.*covariance_type=diag") as err:
        load_method(tmp_path, encoder=None, device="cpu", show_progress=False)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kw, key", [(dict(n_components=0), "n_components"), (dict(n_components=1.5), "n_components"),
                                     (dict(covariance_type="banana"), "covariance_type"),
                                     (dict(reg_covar=0.0), "reg_covar"),
                                     (dict(calibration_fraction=1.5), "calibration_fraction")])
def test_bad_hyperparameters_are_user_errors(kw, key):
    with pytest.raises(UserError, match=f"method.{key}="):
        make(**kw)


def test_more_components_than_training_rows_is_one_line():
    zc, zr, w = subspace_pairs(n=10)
    with pytest.raises(UserError, match="method.n_components=50 is more than the 16 training features"):
        fit(make(n_components=50, num_epochs=1), zc, zr, w)


@pytest.mark.parametrize("covariance_type, per_component", [("full", 2560 * 2560), ("diag", 2560)])
def test_the_planner_counts_the_mixture(covariance_type, per_component):
    from rewarduq_exp.runner.plan import compose_points, make_plan

    cfg = compose_points(["method=ddu", "model=qwen3-4b", "dataset=ultrafeedback", "method.n_components=2",
                          f"method.covariance_type={covariance_type}"])[0][1]
    plan = make_plan(cfg)
    built = DduHead(device="cpu", show_progress=False)
    built._build(2560)
    assert plan.params_trainable == sum(p.numel() for p in built.head.parameters())
    training = next(p for p in plan.phases if p.name == "training")
    assert training.parts["DDU reward head (weights, grads, AdamW x2)"] == 16 * plan.params_trainable
    assert training.parts["DDU mixture fit: standardised training rows (float64)"] == 2 * 49_708 * 2560 * 8
    assert training.parts["DDU mixture (means, covariances, precision Cholesky factors; float64)"] == (
        2 * 2560 + 2 * 2 * per_component) * 8


# ------------------------------------------------------------------------------------------------ as a user runs it
@pytest.fixture(scope="module")
def run_folder(tmp_path_factory, shared_cache):
    return train_tiny(tmp_path_factory, shared_cache, "ddu")


@pytest.mark.e2e
def test_train_evaluate_and_the_api_on_the_tiny_model(run_folder, shared_cache, tmp_path):
    _, folder, proc = run_folder
    info = assert_completed(folder, proc, "ddu")
    assert info["fit_summary"]["u_scale"] > 0
    assert_evaluate_and_api_reproduce(folder, tmp_path, shared_cache)


@pytest.mark.e2e
def test_best_of_n_reads_the_run(run_folder, shared_cache):
    assert_best_of_n_reads(run_folder, shared_cache, "ddu")


@pytest.mark.e2e
def test_plan_on_the_command_line(tmp_path):
    assert_plans(tmp_path, "ddu", "DDU mixture")
