"""ENS-MLP (paper section 4.1, eqs. 10-11): batched heads, loss terms, bounds, training and save/load."""

import numpy as np
import pytest
import torch

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.ens_mlp import BatchedMLPHeads, EnsMLP


def test_batched_heads_equal_separate_heads():
    torch.manual_seed(0)
    heads = BatchedMLPHeads(5, 12, hidden_dim=7, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # non-zero biases so the comparison covers them
        for b in heads.biases:
            b.normal_()
    z = torch.randn(9, 12)
    naive = torch.stack([h(z).squeeze(-1) for h in heads.separate_heads()])
    torch.testing.assert_close(heads(z), naive, rtol=1e-5, atol=1e-6)


def test_heads_shape_param_count_and_xavier_init():
    d, h = 1024, 128
    heads = BatchedMLPHeads(3, d, hidden_dim=h, generator=torch.Generator().manual_seed(0))
    # Linear(d,128)+bias, Linear(128,128)+bias, Linear(128,1) without bias: P = 128 d + 16768 (reference notes 3.1)
    assert heads.params_per_head == 128 * d + 16768
    bound = np.sqrt(6.0 / (d + h))
    w0 = heads.weights[0]
    assert w0.abs().max() <= bound and w0.abs().max() > 0.95 * bound
    assert all(float(b.detach().abs().max()) == 0.0 for b in heads.biases)
    # heads start different (diversity comes from the init)
    assert not torch.allclose(w0[0], w0[1])


def make_method(**kw):
    defaults = dict(num_heads=4, hidden_dim=8, learning_rate=1e-2, reg_lambda=0.5, center_gamma=0.1, seed=0,
                    device="cpu", show_progress=False, batch_size=16)
    return EnsMLP(**{**defaults, **kw})


def test_loss_terms_by_hand():
    m = make_method()
    m._build(6)
    zc, zr, w = torch.randn(10, 6), torch.randn(10, 6), torch.ones(10)
    total, parts = m.loss(zc, zr, w)
    assert float(parts["loss_anchor"]) == 0.0  # at init every head sits on its anchor
    rc, rr = m.heads(zc), m.heads(zr)
    bt = -torch.nn.functional.logsigmoid(rc - rr).mean()
    center = (rc + rr).pow(2).mean()
    torch.testing.assert_close(parts["loss_bt"], bt)
    torch.testing.assert_close(parts["loss_center"], center)
    torch.testing.assert_close(total, bt + 0.1 * center)
    # move one head's parameters by delta: anchor = mean over heads of (P * delta^2 / P) -> delta^2 / K
    delta = 0.3
    with torch.no_grad():
        for p in m.heads.parameters():
            p[1] += delta
    _, parts = m.loss(zc, zr, w)
    assert float(parts["loss_anchor"]) == pytest.approx(delta**2 / 4, rel=1e-5)


def test_pair_weights_equal_repetition():
    m = make_method()
    m._build(6)
    zc, zr = torch.randn(3, 6), torch.randn(3, 6)
    weighted, _ = m.loss(zc, zr, torch.tensor([2.0, 1.0, 1.0]))
    repeated, _ = m.loss(zc[[0, 0, 1, 2]], zr[[0, 0, 1, 2]], torch.ones(4))
    torch.testing.assert_close(weighted, repeated)


def separable_pairs(n=400, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(d, generator=g)
    zc, zr = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    swap = (zc @ theta) < (zr @ theta)
    zc[swap], zr[swap] = zr[swap].clone(), zc[swap].clone()
    return zc, zr, torch.ones(n)


def test_training_reduces_loss_and_learns_preferences():
    zc, zr, w = separable_pairs()
    m = make_method(num_epochs=3)
    m._build(zc.shape[1])
    before, _ = m.loss(zc, zr, w)
    torch.manual_seed(0)
    m._fit_features(zc, zr, w)
    after, _ = m.loss(zc, zr, w)
    assert float(after.detach()) < 0.7 * float(before.detach())
    s_c, s_r = m.score_features(zc), m.score_features(zr)
    assert np.mean(s_c.reward > s_r.reward) > 0.85
    assert m.history and m.history[-1]["step"] == 3 * 25


def test_scores_mean_and_unbiased_std_bounds():
    m = make_method(beta=2.0)
    m._build(6)
    z = torch.randn(7, 6)
    s = m.score_features(z)
    members = m.member_rewards(z)
    np.testing.assert_allclose(s.reward, members.mean(0).numpy(), rtol=1e-5, atol=1e-6)
    u = members.std(0, unbiased=True).numpy()
    np.testing.assert_allclose(s.upper - s.reward, 2.0 * u, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(s.reward - s.lower, 2.0 * u, rtol=1e-4, atol=1e-6)
    assert np.all(s.lower <= s.reward) and np.all(s.reward <= s.upper) and np.all(u > 0)


def test_save_load_gives_identical_scores(tmp_path):
    zc, zr, w = separable_pairs(n=64)
    m = make_method()
    m._build(zc.shape[1])
    m._fit_features(zc, zr, w)
    m.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["method.json", "state.safetensors"]
    loaded = make_method().load(tmp_path)
    a, b = m.score_features(zc), loaded.score_features(zc)
    np.testing.assert_array_equal(a.reward, b.reward)
    np.testing.assert_array_equal(a.upper, b.upper)
    # the anchor travels with the weights: continuing training pulls towards the same point
    for p0, q0 in zip(m.initial, loaded.initial):
        torch.testing.assert_close(p0, q0)


@pytest.mark.parametrize("kw, key", [(dict(num_heads=1), "num_heads"), (dict(beta=0.0), "beta"),
                                     (dict(learning_rate=-1.0), "learning_rate"), (dict(reg_lambda=-0.1), "reg_lambda"),
                                     (dict(batch_size=0), "batch_size"), (dict(num_heads=2.5), "num_heads")])
def test_bad_hyperparameters_are_user_errors(kw, key):
    with pytest.raises(UserError, match=f"method.{key}="):
        make_method(**kw)


@pytest.mark.parametrize("method", ["ens_mlp", "bay_lin"])
def test_gradients_clipped_to_max_grad_norm(monkeypatch, method):
    """Each AdamW step sees a total gradient norm <= max_grad_norm (the HF Trainer's 1.0 by default; null = off)."""
    from rewarduq_exp.methods.adamw import FunctionalAdamW
    from rewarduq_exp.methods.bay_lin import BayLin

    seen = []
    step = FunctionalAdamW.step

    def recording_step(self, *args, **kwargs):
        grads = [p.grad for p in self.params if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(FunctionalAdamW, "step", recording_step)
    g = torch.Generator().manual_seed(0)
    zc, zr = 5 * torch.randn(64, 6, generator=g), 5 * torch.randn(64, 6, generator=g)
    norms = {}
    for max_norm in (None, 1e-3):
        seen.clear()
        kw = {"max_grad_norm": max_norm, "seed": 0, "device": "cpu", "show_progress": False, "batch_size": 16}
        m = make_method(**kw) if method == "ens_mlp" else BayLin(**kw)
        m._build(6)
        m._fit_features(zc, zr, torch.ones(64))
        norms[max_norm] = list(seen)
        assert "grad_norm" in m.history[0]  # the norm before clipping, logged as the HF Trainer logs it
    assert max(norms[None]) > 1e-2  # unclipped gradients are far above the limit tested below
    assert max(norms[1e-3]) <= 1e-3 * (1 + 1e-5)
    with pytest.raises(UserError, match="method.max_grad_norm=0 is invalid"):
        make_method(max_grad_norm=0)


def test_cosine_schedule_equals_transformers():
    """Our warm-up + cosine schedule (kept here to avoid a 2.8 s import) gives transformers' values step by step."""
    from transformers import get_cosine_schedule_with_warmup

    from rewarduq_exp.methods.base import cosine_schedule_with_warmup

    for warmup, total in ((0, 7), (3, 50), (5, 5)):
        ours = cosine_schedule_with_warmup(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), warmup, total)
        hf = get_cosine_schedule_with_warmup(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), warmup,
                                             total)
        for _ in range(total + 2):
            assert ours.get_last_lr() == pytest.approx(hf.get_last_lr(), abs=1e-12)
            ours.optimizer.step(), hf.optimizer.step()
            ours.step(), hf.step()
