"""k-NN (rewarduq_exp/methods/knn.py) and the scale of u both distance-aware heads share
(rewarduq_exp/methods/distance_scale.py): the distances against a brute-force computation, the reference set and its
bound, u off the training data, the scale against a known one, save/load, refusals, the planner, and the run as a
user makes it (train.py, evaluate.py, the Python API, downstream.py's best-of-n, plan=true)."""

import json
import math

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

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.base import load_method
from rewarduq_exp.methods.distance_scale import bt_nll, calibration_split, fit_distance_scale
from rewarduq_exp.methods.knn import KnnHead


def make(**kw):
    defaults = dict(hidden_dim=16, learning_rate=1e-2, batch_size=32, num_epochs=3, n_neighbors=5, seed=0,
                    device="cpu", show_progress=False)
    return KnnHead(**{**defaults, **kw})


def fit(m, zc, zr, w):
    m._build(zc.shape[1])
    with torch.random.fork_rng(devices=[]):   # as FeatureHeadMethod.fit runs it
        torch.manual_seed(m.seed)
        m._fit_features(zc, zr, w)
    return m


def subspace_pairs(n=400, d=12, active=6, seed=0, weighted=False):
    """Pairs whose features live in the first ``active`` dimensions (the rest 0), labelled by the Bradley-Terry
    model of a linear reward (so a head trained on them errs on held-out pairs); ``weighted``: pair weights in
    [0.5, 1.5) instead of 1 (drawn last, so the pairs are the same)."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(active, generator=g)
    zc, zr = torch.zeros(n, d), torch.zeros(n, d)
    zc[:, :active], zr[:, :active] = torch.randn(n, active, generator=g), torch.randn(n, active, generator=g)
    swap = torch.rand(n, generator=g) > torch.sigmoid((zc[:, :active] - zr[:, :active]) @ theta)
    zc[swap], zr[swap] = zr[swap].clone(), zc[swap].clone()
    return zc, zr, (torch.rand(n, generator=g) + 0.5 if weighted else torch.ones(n))


@pytest.fixture(scope="module")
def trained():
    """A head trained long at a high rate on 320 pairs: over-confident on the 80 held out, so c is well above 0
    (measured 1.09; with 3 epochs at 1e-2 the head is not over-confident there and c sits at the bottom of its range,
    5.9e-7)."""
    zc, zr, w = subspace_pairs()
    return fit(make(hidden_dim=32, num_epochs=40, learning_rate=3e-2), zc, zr, w), (zc, zr, w)


def training_rows(zc, zr, fraction=0.2, seed=0):
    train, _ = calibration_split(len(zc), fraction, seed)
    return torch.cat([zc[train], zr[train]]).double()


def test_distances_are_a_brute_force_k_nearest_mean_in_the_standardised_space(trained):
    """The reference set is the chosen and rejected features of the pairs the head trained on, standardised by their
    own mean and sd; d(z) = mean of the k smallest Euclidean distances to it (torch.cdist, float64, by hand)."""
    m, (zc, zr, _) = trained
    rows = training_rows(zc, zr)
    mean, sd = rows.mean(0), rows.std(0, unbiased=False)
    sd = torch.where(sd > 0, sd, torch.ones_like(sd))
    reference = (rows - mean) / sd
    torch.testing.assert_close(m.reference.double(), reference, rtol=0, atol=1e-6)
    g = torch.Generator().manual_seed(3)
    z = torch.randn(50, 12, generator=g) * 1.5
    z[:10] = zc[:10]                                  # some training points: their own neighbour at 0
    by_hand = torch.cdist((z.double() - mean) / sd, reference).topk(5, largest=False).values.mean(1)
    torch.testing.assert_close(m.distance(z), by_hand, rtol=1e-5, atol=1e-5)
    u = m.score_features(z).u
    np.testing.assert_allclose(u, m.scale * by_hand.numpy(), rtol=1e-5, atol=1e-6)


def test_max_reference_keeps_a_seeded_subsample_of_the_training_rows():
    zc, zr, w = subspace_pairs(n=100)
    full = training_rows(zc, zr)
    a, b, c = (fit(make(max_reference=50, num_epochs=1, seed=s), zc, zr, w) for s in (0, 0, 1))
    assert a.reference.shape == (50, 12)
    torch.testing.assert_close(a.reference, b.reference, rtol=0, atol=0)
    assert not torch.equal(a.reference, c.reference)
    standardised = ((full - a.feature_mean) / a.feature_sd).float()
    # every kept row is one of the training rows (the standardisation still uses all of them)
    assert torch.cdist(a.reference.double(), standardised.double()).min(1).values.max() < 1e-5


def test_u_is_larger_far_outside_the_training_data_than_inside(trained):
    """Inside: new points in the span of the training features; outside: points in the dimensions training never
    saw (measured: 2.0x the mean u inside). The scale is positive and the head learned the task."""
    m, (zc, zr, _) = trained
    g = torch.Generator().manual_seed(5)
    inside, outside = torch.zeros(200, 12), torch.zeros(200, 12)
    inside[:, :6], outside[:, 6:] = torch.randn(200, 6, generator=g), torch.randn(200, 6, generator=g)
    assert m.scale > 0 and m.scale_fit.cf_held_out <= m.cf_target   # u's scale: the held-out CF target
    assert m.score_features(outside).u.mean() > 1.5 * m.score_features(inside).u.mean()
    assert np.mean(m.score_features(zc).reward > m.score_features(zr).reward) > 0.7


def test_the_reward_scale_is_the_held_out_likelihoods_temperature():
    """Labels drawn from sigmoid(2 m): the fitted a is 2 (20,000 pairs: within 5 %), and it lowers the NLL below the
    head's own (a = 1)."""
    rng = np.random.default_rng(0)
    m = rng.normal(0.0, 1.0, 20_000)
    win = rng.random(len(m)) < 1 / (1 + np.exp(-2.0 * m))
    margin = np.where(win, m, -m)
    found = fit_distance_scale(margin, np.ones_like(m), np.ones_like(m))
    assert found.a == pytest.approx(2.0, rel=0.05) and found.nll < found.nll_as_trained
    assert found.nll <= bt_nll(math.log(1.8), margin, np.ones_like(m))


def test_the_distance_scale_is_the_smallest_meeting_the_cf_target_by_hand():
    """c = the smallest scale at which the bounds r +- beta c d call at most cf_target of the held-out pairs (by
    weight) confidently wrong; checked against a direct scan of every candidate c."""
    rng = np.random.default_rng(1)
    n = 400
    margin, dc, dr = rng.normal(0.5, 1.0, n), rng.uniform(0.1, 2.0, n), rng.uniform(0.1, 2.0, n)
    weight = rng.integers(1, 4, n).astype(float)
    found = fit_distance_scale(margin, dc, dr, weight, beta=2.0, cf_target=0.05)
    a_m = found.a * margin

    def cf_share(c):   # bounds a r +- beta c d apart the wrong way: a m + beta c (d_c + d_r) < 0
        return weight[a_m + 2.0 * c * (dc + dr) < 0].sum() / weight.sum()

    assert cf_share(found.c) <= 0.05 + 1e-12 and found.cf_held_out == pytest.approx(cf_share(found.c))
    assert cf_share(found.c * (1 - 1e-9)) > 0.05            # any smaller c breaks the target
    assert found.feasible and found.pairs == n
    repeat = weight.astype(int)
    copied = fit_distance_scale(np.repeat(margin, repeat), np.repeat(dc, repeat), np.repeat(dr, repeat), beta=2.0,
                                cf_target=0.05)
    assert (copied.a, copied.c) == pytest.approx((found.a, found.c), rel=1e-6)   # a weight w counts as w copies


def test_wrong_pairs_at_distance_zero_make_the_target_infeasible():
    margin = np.array([-1.0, -1.0, 1.0, 1.0])
    found = fit_distance_scale(margin, np.array([0.0, 1.0, 1.0, 1.0]), np.array([0.0, 1.0, 1.0, 1.0]),
                               cf_target=0.1)
    assert not found.feasible and found.cf_held_out == pytest.approx(0.25)   # the pair at distance 0 stays wrong


def test_the_split_holds_out_a_seeded_share_and_always_one_pair_each_side():
    train, held = calibration_split(100, 0.2, 0)
    assert len(held) == 20 and len(train) == 80 and not set(train) & set(held)
    assert np.array_equal(calibration_split(100, 0.2, 0)[1], held) and not np.array_equal(
        calibration_split(100, 0.2, 1)[1], held)
    assert [len(x) for x in calibration_split(2, 0.2, 0)] == [1, 1]
    assert [len(x) for x in calibration_split(3, 0.9, 0)] == [1, 2]
    with pytest.raises(UserError, match="at least 2 training pairs"):
        calibration_split(1, 0.2, 0)


def test_save_and_load_give_identical_scores_in_any_batches(trained, tmp_path):
    m, (zc, zr, _) = trained
    m.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["method.json", "state.safetensors"]
    loaded = load_method(tmp_path, encoder=None, device="cpu", show_progress=False)
    assert type(loaded) is KnnHead and loaded.hyperparameters() == m.hyperparameters()
    z = torch.cat([zc[:40], zr[:40] + 0.3])
    a, b = m.score_features(z), loaded.score_features(z)
    for field in ("reward", "u", "lower", "upper"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert loaded.scale == m.scale and loaded.beta == m.beta
    loaded.score_batch_size = 7   # in batches of 7: the same numbers to float32 rounding of the head's products
    c = loaded.score_features(z)
    for field in ("reward", "u"):
        np.testing.assert_allclose(getattr(c, field), getattr(a, field), rtol=1e-6, atol=1e-6)


def test_a_mismatched_or_damaged_state_file_is_refused_in_one_line(trained, tmp_path):
    from safetensors.torch import load_file, save_file

    m, _ = trained
    m.save(tmp_path)
    tensors = load_file(tmp_path / "state.safetensors")
    save_file({**tensors, "reference": tensors["reference"][:, :5].contiguous()}, tmp_path / "state.safetensors")
    with pytest.raises(UserError, match=r"state.safetensors") as err:
        load_method(tmp_path, encoder=None, device="cpu", show_progress=False)
    assert "\n" not in str(err.value)
    info = json.loads((tmp_path / "method.json").read_text())   # more rows than max_reference says
    (tmp_path / "method.json").write_text(json.dumps({**info, "hyperparameters": {**info["hyperparameters"],
                                                                                  "max_reference": 10}}))
    save_file(tensors, tmp_path / "state.safetensors")
    with pytest.raises(UserError, match=r"state.safetensors.*max_reference=10") as err:
        load_method(tmp_path, encoder=None, device="cpu", show_progress=False)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kw, key", [(dict(n_neighbors=0), "n_neighbors"), (dict(max_reference=2.5), "max_reference"),
                                     (dict(max_reference=10**9), "max_reference"),
                                     (dict(calibration_fraction=1.0), "calibration_fraction"),
                                     (dict(calibration_fraction=0), "calibration_fraction"),
                                     (dict(beta=0.0), "beta"), (dict(hidden_dim=0), "hidden_dim")])
def test_bad_hyperparameters_are_user_errors(kw, key):
    with pytest.raises(UserError, match=f"method.{key}="):
        make(**kw)


@pytest.mark.parametrize("model, hidden", [("qwen3-0.6b", 1024), ("qwen3-4b", 2560)])
def test_the_planner_counts_the_head_and_the_reference_set(model, hidden):
    from rewarduq_exp.runner.plan import compose_points, make_plan

    cfg = compose_points(["method=knn", f"model={model}", "dataset=ultrafeedback"])[0][1]
    plan = make_plan(cfg)
    built = KnnHead(device="cpu", show_progress=False)
    built._build(hidden)
    assert plan.params_trainable == sum(p.numel() for p in built.head.parameters())
    training = next(p for p in plan.phases if p.name == "training")
    assert training.parts["KNN reward head (weights, grads, AdamW x2)"] == 16 * plan.params_trainable
    # 62,135 pairs, 12,427 held out: 2 x 49,708 rows < max_reference = 100,000
    assert training.parts["KNN reference set (standardised float32)"] == 2 * 49_708 * hidden * 4
    small = make_plan(compose_points(["method=knn", f"model={model}", "dataset=ultrafeedback",
                                      "method.max_reference=1000"])[0][1])
    assert next(p for p in small.phases if p.name == "training").parts[
        "KNN reference set (standardised float32)"] == 1000 * hidden * 4


# ------------------------------------------------------------------------------------------------ as a user runs it
@pytest.fixture(scope="module")
def run_folder(tmp_path_factory, shared_cache):
    return train_tiny(tmp_path_factory, shared_cache, "knn")


@pytest.mark.e2e
def test_train_evaluate_and_the_api_on_the_tiny_model(run_folder, shared_cache, tmp_path):
    _, folder, proc = run_folder
    info = assert_completed(folder, proc, "knn")
    assert info["fit_summary"]["u_scale"] > 0
    assert info["fit_summary"]["scale_pairs"] == 40 and info["fit_summary"]["feature_dim"] == 256
    assert_evaluate_and_api_reproduce(folder, tmp_path, shared_cache)


@pytest.mark.e2e
def test_best_of_n_reads_the_run(run_folder, shared_cache):
    assert_best_of_n_reads(run_folder, shared_cache, "knn")


@pytest.mark.e2e
def test_plan_on_the_command_line(tmp_path):
    assert_plans(tmp_path, "knn", "KNN reference set")
