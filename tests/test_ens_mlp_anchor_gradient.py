"""ENS-MLP's anchor gradient added directly (``EnsMLP.add_anchor_gradient``) trains exactly as eq. 11 through autograd
did: the reference below is the former training step (the anchor's value and gradient through autograd, one backward
of the whole loss), written here so that it is no production option."""

import pytest
import torch

from rewarduq_exp.methods.base import bradley_terry_nll, weighted_mean
from rewarduq_exp.methods.ens_mlp import EnsMLP
from rewarduq_exp.methods.training import run_training


def make_method(**kw):
    defaults = dict(num_heads=4, hidden_dim=8, learning_rate=1e-2, reg_lambda=0.5, center_gamma=0.1, seed=0,
                    device="cpu", show_progress=False, batch_size=16, num_epochs=3, log_every=1)
    return EnsMLP(**{**defaults, **kw})


def autograd_fit(m: EnsMLP, zc, zr, weight) -> None:
    """The former step: eq. 11 with the anchor in the graph, one backward, the loop's clipping and AdamW."""

    def anchor_penalty():
        sq = sum((p - p0).pow(2).flatten(1).sum(1) for p, p0 in zip(m.heads.parameters(), m.initial))
        return (sq / m.heads.params_per_head).mean()

    def step(index):
        c, r, w = zc[index], zr[index], weight[index]
        n = c.shape[0]
        rewards = m.heads(torch.cat([c, r]))
        rc, rr = rewards[:, :n], rewards[:, n:]
        bt = weighted_mean(bradley_terry_nll(rc - rr).mean(0), w)
        center = weighted_mean((rc + rr).pow(2).mean(0), w)
        anchor = anchor_penalty() if m.reg_lambda > 0 else torch.zeros(())
        total = bt + m.reg_lambda * anchor + m.center_gamma * center
        total.backward()
        return {"loss": total.detach(), "loss_bt": bt.detach(), "loss_anchor": anchor.detach(),
                "loss_center": center.detach()}

    run_training(m.heads.parameters(), len(zc), m.schedule, step, seed=m.seed, desc="reference", history=m.history,
                 show_progress=False, log_every=m.log_every)


def data(n=80, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.rand(n, generator=g) + 0.5
    return torch.randn(n, d, generator=g), torch.randn(n, d, generator=g), weight


@pytest.mark.parametrize("reg_lambda", [0.5, 0.0])
@pytest.mark.parametrize("max_grad_norm", [None, 1.0, 0.05])
def test_direct_anchor_gradient_trains_as_autograd(reg_lambda, max_grad_norm):
    zc, zr, weight = data()
    runs = []
    for fit in (autograd_fit, EnsMLP._fit_features):
        m = make_method(reg_lambda=reg_lambda, max_grad_norm=max_grad_norm)
        m._build(zc.shape[1])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            fit(m, zc, zr, weight)
        runs.append(m)
    ref, new = runs
    assert len(new.history) == len(ref.history) == 15   # 5 steps an epoch, 3 epochs, every step logged
    for a, b in zip(ref.history, new.history):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (key, a["step"])
    if reg_lambda > 0:
        assert ref.history[-1]["loss_anchor"] > 0   # the anchor did pull
    if max_grad_norm == 0.05:
        assert all(h["grad_norm"] > 0.05 for h in ref.history)   # clipping was active at every step
    for p, q in zip(ref.heads.parameters(), new.heads.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    # the anchor copies are untouched
    for p, q in zip(ref.initial, new.initial):
        assert torch.equal(p, q)


def test_anchor_gradient_equals_autograd_of_anchor_penalty():
    m = make_method(reg_lambda=0.3)
    m._build(5)
    with torch.no_grad():
        for p in m.heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    params = list(m.heads.parameters())
    sq = sum((p - p0).pow(2).flatten(1).sum(1) for p, p0 in zip(params, m.initial))
    expected_value = (sq / m.heads.params_per_head).mean()
    expected = torch.autograd.grad(m.reg_lambda * expected_value, params)
    base = [torch.randn_like(p) for p in params]
    for p, b in zip(params, base):
        p.grad = b.clone()
    value = m.add_anchor_gradient()
    torch.testing.assert_close(value, expected_value.detach(), rtol=1e-6, atol=0)
    for p, b, e in zip(params, base, expected):
        torch.testing.assert_close(p.grad, b + e, rtol=1e-6, atol=1e-9)
    for p in params:   # a parameter without a gradient gets the anchor's alone
        p.grad = None
    m.add_anchor_gradient()
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-6, atol=1e-12)
