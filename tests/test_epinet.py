"""EPINET (rewarduq_exp/methods/epinet.py): the architecture against its formula, joint index draws, u outside the
training data, save/load, refusals, the planner, and the run as a user makes it (train.py, evaluate.py, the Python
API, downstream.py's BALD). Resumption after SIGTERM is in tests/test_training_resume.py (its table of methods)."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
from test_cli import NO_FIGURES, SMALL, run

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.base import load_method
from rewarduq_exp.methods.epinet import Epinet, sample_indices
from rewarduq_exp.metrics import METRIC_NAMES


def make(**kw):
    defaults = dict(hidden_dim=16, index_dim=4, epinet_hidden_dim=8, prior_hidden_dim=4, num_eval_indices=32,
                    learning_rate=1e-2, batch_size=32, seed=0, device="cpu", show_progress=False)
    return Epinet(**{**defaults, **kw})


def fit(m: Epinet, zc, zr, w) -> Epinet:
    m._build(zc.shape[1])
    with torch.random.fork_rng(devices=[]):   # as FeatureHeadMethod.fit runs it
        torch.manual_seed(m.seed)
        m._fit_features(zc, zr, w)
    return m


def subspace_pairs(n=1000, d=16, active=8, seed=0):
    """Pairs whose features live in the first ``active`` dimensions (the rest 0), labelled by a linear reward."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(active, generator=g)
    zc, zr = torch.zeros(n, d), torch.zeros(n, d)
    zc[:, :active], zr[:, :active] = torch.randn(n, active, generator=g), torch.randn(n, active, generator=g)
    swap = (zc[:, :active] @ theta) < (zr[:, :active] @ theta)
    zc[swap], zr[swap] = zr[swap].clone(), zc[swap].clone()
    return zc, zr, torch.ones(n)


def u_of(m: Epinet, z) -> np.ndarray:
    return m.score_features(z).u


@pytest.fixture(scope="module")
def trained():
    zc, zr, w = subspace_pairs()
    return fit(make(hidden_dim=32, num_epochs=5), zc, zr, w), (zc, zr, w)


def test_u_is_larger_far_outside_the_training_data_than_inside(trained):
    """Inside: new points in the span of the training features; outside: points of the same norm in the dimensions
    training never saw. Training shrinks the spread over indices where there is data (the learnable epinet cancels
    the prior there) and leaves it elsewhere; measured: u 0.40 inside, 0.77 outside (0.96 / 1.23 untrained). With
    method.epinet_input=hidden (the epinet and prior read phi(z) alone) this fails: 0.39 inside, 0.25 outside."""
    m, (zc, zr, _) = trained
    g = torch.Generator().manual_seed(5)
    inside, outside = torch.zeros(300, 16), torch.zeros(300, 16)
    inside[:, :8], outside[:, 8:] = torch.randn(300, 8, generator=g), torch.randn(300, 8, generator=g)
    assert u_of(m, outside).mean() > 1.5 * u_of(m, inside).mean()
    assert np.mean(m.score_features(zc).reward > m.score_features(zr).reward) > 0.95   # and it learned the task
    untrained = make(hidden_dim=32)
    untrained._build(16)
    assert u_of(m, inside).mean() < 0.6 * u_of(untrained, inside).mean()   # the data shrank u where it is


def test_without_centring_each_index_keeps_its_offset_and_u_does_not_shrink(trained):
    """A shift of all rewards under one index changes no margin: only the centring term cancels the prior's
    per-index offset, which otherwise adds the same spread to every response (u inside 2.33 against 0.40)."""
    m, (zc, zr, w) = trained
    loose = fit(make(hidden_dim=32, num_epochs=5, center_gamma=0.0), zc, zr, w)
    inside = zc[:300]
    assert u_of(loose, inside).mean() > 3 * u_of(m, inside).mean()


def test_rewards_are_the_formula_index_by_index():
    """r(z, xi) = mu(z) + g([z, phi], xi)^T xi + prior_scale * h([z, phi])^T xi, written out one index at a time."""
    m = make(prior_scale=0.7, epinet_num_hidden_layers=2)
    m._build(6)
    net = m.net
    with torch.no_grad():
        for b in [*net.base_b, *net.epi_b]:   # non-zero biases so the comparison covers them
            b.normal_()
    z, xi = torch.randn(5, 6), torch.randn(3, 4)
    mu, phi = net.base(z)
    x = torch.cat([z, phi], 1)
    for s in range(3):
        h = torch.relu(torch.cat([x, xi[s].expand(5, 4)], 1) @ torch.cat([net.epi_phi, net.epi_xi]) + net.epi_b[0])
        h = torch.relu(h @ net.epi_w[0] + net.epi_b[1])
        learn = (h @ net.epi_out) @ xi[s]
        prior = torch.stack([torch.relu(x @ net.prior_w0[k] + net.prior_b0[k]) @ net.prior_w1[k, :, 0]
                             for k in range(4)], 1)
        torch.testing.assert_close(m.rewards(z, xi)[s], mu + learn + 0.7 * prior @ xi[s])
    # hidden: the epinet and the prior read phi(z) alone
    m = make(epinet_input="hidden")
    m._build(6)
    assert m.net.epi_phi.shape == (16, 8) and m.net.prior_w0.shape == (4, 16, 4)


def test_the_prior_is_fixed_and_the_base_features_are_not_moved_by_the_epinet(trained):
    m, (zc, zr, w) = trained
    assert {n for n, _ in m.net.named_buffers()} == {"prior_w0", "prior_b0", "prior_w1"}
    fresh = make(hidden_dim=32, num_epochs=5)
    fresh._build(16)
    for name, buf in m.net.named_buffers():
        torch.testing.assert_close(buf, getattr(fresh.net, name), rtol=0, atol=0)   # untouched by 5 epochs
    # sg[phi]: the epinet's part of the loss sends no gradient into the base head
    m2 = make()
    m2._build(16)
    base = [*m2.net.base_w, *m2.net.base_b, m2.net.base_out]
    via_mu = torch.autograd.grad(3 * m2.net.base(zc[:8])[0].sum(), base)
    m2.rewards(zc[:8], torch.randn(3, 4)).sum().backward()
    for p, g in zip(base, via_mu):
        torch.testing.assert_close(p.grad, g)   # the base head's gradient is mu's alone
    assert m2.net.epi_out.grad.abs().max() > 0


def test_chosen_and_rejected_share_every_index():
    """In training (one xi per sampled model for both completions of a pair) and in the draws BALD reads."""
    m = make()
    m._build(6)
    zc, zr, w = torch.randn(10, 6), torch.randn(10, 6), torch.ones(10)
    xi = torch.randn(5, 4)
    total, parts = m.loss(zc, zr, w, xi)
    margins = m.rewards(zc, xi) - m.rewards(zr, xi)            # (S, B): each pair under each index
    bt = -torch.nn.functional.logsigmoid(margins).mean()
    center = (m.rewards(zc, xi) + m.rewards(zr, xi)).pow(2).mean()
    torch.testing.assert_close(parts["loss_bt"], bt)
    torch.testing.assert_close(parts["loss_center"], center)
    torch.testing.assert_close(total, bt + 0.1 * parts["loss_l2"] + 0.01 * center)
    # Prediction: the same fixed indices on every call, so a completion scored as chosen and as rejected gets the
    # same draws (zero margin under every one) and the scores are the mean and std of those draws.
    with torch.no_grad():
        draws = m._sample_features(zc)
        torch.testing.assert_close(draws, m._sample_features(zc), rtol=0, atol=0)
        torch.testing.assert_close(m._sample_features(torch.cat([zr, zc]))[:, 10:], draws)   # other rows beside
    assert draws.shape == (32, 10)
    s = m.score_features(zc)
    np.testing.assert_allclose(s.reward, draws.mean(0).double(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(s.u, draws.std(0).double(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s.upper - s.reward, 0.4 * s.u, rtol=1e-9)


def test_index_distributions():
    g = torch.Generator().manual_seed(0)
    gauss = sample_indices("gaussian", 4000, 3, g)
    assert abs(gauss.mean()) < 0.05 and abs(gauss.var() - 1) < 0.05
    sphere = sample_indices("sphere", 50, 6, g)
    torch.testing.assert_close(sphere.norm(dim=1), torch.full((50,), 6**0.5))
    one_hot = sample_indices("one_hot", 50, 5, g)
    assert (one_hot.sum(1) == 1).all() and ((one_hot == 0) | (one_hot == 1)).all()
    m = make(index_distribution="one_hot", index_dim=5)   # prediction: every member once, not 32 draws
    m._build(6)
    torch.testing.assert_close(m.eval_index, torch.eye(5))
    assert m.score_features(torch.randn(7, 6)).reward.shape == (7,) and m.eval_draws == 5
    # the seed fixes the eval indices; another seed draws others
    a, b, c = make(), make(), make(seed=1)
    for x in (a, b, c):
        x._build(6)
    assert torch.equal(a.eval_index, b.eval_index) and not torch.equal(a.eval_index, c.eval_index)


def test_save_and_load_method_give_identical_scores(trained, tmp_path):
    m, (zc, _, _) = trained
    m.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["method.json", "state.safetensors"]
    loaded = load_method(tmp_path, encoder=None, device="cpu", show_progress=False)
    assert type(loaded) is Epinet and loaded.hyperparameters() == m.hyperparameters()
    a, b = m.score_features(zc), loaded.score_features(zc)
    for field in ("reward", "u", "lower", "upper"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    with torch.no_grad():
        torch.testing.assert_close(m._sample_features(zc), loaded._sample_features(zc), rtol=0, atol=0)


def test_a_mismatched_or_damaged_state_file_is_refused_in_one_line(trained, tmp_path):
    m, _ = trained
    m.save(tmp_path)
    info = json.loads((tmp_path / "method.json").read_text())
    # hyperparameters that do not match the saved tensors (index_dim 4 saved, 6 claimed)
    (tmp_path / "method.json").write_text(json.dumps({**info, "hyperparameters": {**info["hyperparameters"],
                                                                                  "index_dim": 6}}))
    with pytest.raises(UserError, match=r"state.safetensors.*index_dim=6") as err:
        load_method(tmp_path, encoder=None, device="cpu", show_progress=False)
    assert "\n" not in str(err.value)
    (tmp_path / "method.json").write_text(json.dumps(info))
    data = (tmp_path / "state.safetensors").read_bytes()
    (tmp_path / "state.safetensors").write_bytes(data[: len(data) // 2])   # cut short
    with pytest.raises(UserError, match=r"state.safetensors") as err:
        load_method(tmp_path, encoder=None, device="cpu", show_progress=False)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kw, key", [(dict(index_dim=0), "index_dim"), (dict(index_distribution="cauchy"),
                                                                         "index_distribution"),
                                     (dict(num_eval_indices=1), "num_eval_indices"), (dict(prior_scale=-1.0),
                                                                                      "prior_scale"),
                                     (dict(num_index_samples=2.5), "num_index_samples"), (dict(beta=0.0), "beta"),
                                     (dict(epinet_input="raw"), "epinet_input"),
                                     (dict(index_dim=1, index_distribution="one_hot"), "index_dim")])
def test_bad_hyperparameters_are_user_errors(kw, key):
    with pytest.raises(UserError, match=f"method.{key}="):
        make(**kw)


@pytest.mark.parametrize("model, hidden", [("qwen3-0.6b", 1024), ("qwen3-4b", 2560)])
def test_the_planner_counts_the_heads_parameters(model, hidden):
    from rewarduq_exp.runner.plan import compose_points, make_plan

    cfg = compose_points(["method=epinet", f"model={model}", "dataset=ultrafeedback"])[0][1]
    plan = make_plan(cfg)
    built = Epinet(device="cpu", show_progress=False)
    built._build(hidden)
    assert plan.params_trainable == sum(p.numel() for p in built.net.parameters())
    training = next(p for p in plan.phases if p.name == "training")
    assert training.parts["EPINET base head and epinet (weights, grads, AdamW x2)"] == 16 * plan.params_trainable
    fixed = sum(b.numel() for b in built.net.buffers()) + built.eval_index.numel()
    assert training.parts["EPINET prior networks (fixed) and eval indices"] == 4 * fixed
    assert plan.flops["training"] > 0 and plan.peak > training.parts["train features (float32)"]


# ------------------------------------------------------------------------------------------------ as a user runs it
@pytest.fixture(scope="module")
def run_folder(tmp_path_factory, shared_cache):
    cwd = tmp_path_factory.mktemp("epinet_run")
    folder = cwd / "outputs" / "runs" / "epinet"
    proc = run("train.py", ["method=epinet", *SMALL, "dataset.n_cal=200", *NO_FIGURES, f"hydra.run.dir={folder}"],
               cwd, shared_cache)
    return cwd, folder, proc


def test_train_evaluate_and_the_api_on_the_tiny_model(run_folder, shared_cache, tmp_path):
    from test_api import assert_api_scores_as_evaluate

    from rewarduq_exp.data.synthetic import SyntheticWorld

    cwd, folder, proc = run_folder
    assert json.loads((folder / "status.json").read_text())["state"] == "completed"
    assert "synthetic_ood" in proc.stdout and "win_rate" in proc.stdout
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["synthetic_eval"]["win_rate"] > 0.6
    info = json.loads((folder / "model" / "method.json").read_text())
    assert info["method"] == "epinet" and info["fit_summary"]["seconds_training"] > 0
    before = metrics["synthetic_ood"]
    run("evaluate.py", [f"run={folder}", "dataset=synthetic_ood", "progress=false", *NO_FIGURES], tmp_path,
        shared_cache)
    after = json.loads((folder / "metrics.json").read_text())["synthetic_ood"]
    for key in METRIC_NAMES:   # the run's feature cache and the saved eval indices: the same numbers
        assert after[key] == pytest.approx(before[key], abs=1e-9)
    assert_api_scores_as_evaluate(folder, "synthetic_eval", SyntheticWorld(n_train=600, n_eval=200).load("eval"))


def test_active_learning_with_bald_reads_the_eval_indices(run_folder, shared_cache):
    cwd, folder, _ = run_folder
    out = cwd / "outputs" / "al"
    run("downstream.py", ["progress=false", f"hydra.run.dir={out}", "task=active_learning", f"run={folder}",
                          "task.pool=120", "task.initial=20", "task.batch=20", "task.rounds=1", "task.repeats=1",
                          "task.strategies=[random,bald]", "task.method.num_epochs=2"], cwd, shared_cache)
    curves = pd.read_csv(out / "curves.csv")
    assert set(curves.strategy) == {"random", "bald"} and sorted(set(curves.labels)) == [20, 40]
    assert curves.win_rate.between(0, 1).all()


def test_plan_on_the_command_line(tmp_path):
    from conftest import ROOT
    from entry_points import run_entry_point

    proc = run_entry_point(ROOT / "train.py", ["method=epinet", "model=qwen3-4b", "dataset=ultrafeedback", "plan=true",
                                               f"paths.output_root={tmp_path}/out"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "EPINET base head and epinet" in proc.stdout and "62135 train pairs" in proc.stdout
    assert not (tmp_path / "out").exists()
