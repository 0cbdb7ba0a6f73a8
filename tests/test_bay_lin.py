"""BAY-LIN (paper section 4.4, eqs. 14-15): MAP head, Laplace precision, row-wise u, distributed H, save/load."""

import os
import socket

import child_processes
import numpy as np
import pytest
import torch

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.bay_lin import BayLin
from rewarduq_exp.methods.posteriors.full import posterior_precision, quadratic_form_sqrt


def make_method(**kw):
    defaults = dict(learning_rate=5e-2, reg_lambda=0.1, seed=0, device="cpu", show_progress=False, batch_size=16)
    return BayLin(**{**defaults, **kw})


def pairs(n=200, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(d, generator=g)
    zc, zr = torch.randn(n, d, generator=g) + 3.0, torch.randn(n, d, generator=g) + 3.0  # shared offset, like LLMs
    swap = (zc @ theta) < (zr @ theta)
    zc[swap], zr[swap] = zr[swap].clone(), zc[swap].clone()
    return zc, zr, torch.ones(n)


def test_precision_matches_the_formula():
    dz, coef = torch.randn(50, 4, dtype=torch.float64), torch.rand(50, dtype=torch.float64)
    expected = 0.3 * torch.eye(4, dtype=torch.float64) + sum(c * torch.outer(x, x) for x, c in zip(dz, coef))
    torch.testing.assert_close(posterior_precision(dz, coef, 0.3, chunk=7), expected)


def test_rowwise_u_equals_quadratic_form_with_inverse():
    a = torch.randn(6, 6, dtype=torch.float64)
    h = a @ a.T + 0.5 * torch.eye(6, dtype=torch.float64)
    z = torch.randn(11, 6)
    u = quadratic_form_sqrt(torch.linalg.cholesky(h), z)
    expected = torch.diag(z.double() @ torch.linalg.inv(h) @ z.double().T).sqrt()
    torch.testing.assert_close(u, expected)


def test_fit_builds_unweighted_and_weighted_precision():
    zc, zr, w = pairs()
    for mode in ("unweighted", "weighted"):
        m = make_method(hessian=mode)
        m._build(zc.shape[1])
        m._fit_features(zc, zr, w)
        dz = (zc - zr).double()
        coef = torch.ones(len(dz), dtype=torch.float64)
        if mode == "weighted":
            s = torch.sigmoid(dz @ m.head.weight.detach().double()[0])  # margins in float64, as the fit computes
            coef = s * (1 - s)
        expected = 0.1 * torch.eye(dz.shape[1], dtype=torch.float64) + dz.T @ (dz * coef[:, None])
        torch.testing.assert_close(m.precision, expected)


def test_training_learns_and_uncertainty_shrinks_with_data():
    zc, zr, w = pairs(n=400)
    m = make_method(num_epochs=3)
    m._build(zc.shape[1])
    m._fit_features(zc, zr, w)
    sc, sr = m.score_features(zc), m.score_features(zr)
    assert np.mean(sc.reward > sr.reward) > 0.85
    assert np.all(sc.lower <= sc.reward) and np.all(sc.reward <= sc.upper)
    small = make_method(num_epochs=3)
    small._build(zc.shape[1])
    small._fit_features(zc[:40], zr[:40], w[:40])
    assert small.score_features(zc).upper.mean() - small.score_features(zc).reward.mean() > \
        sc.upper.mean() - sc.reward.mean()  # less data -> wider bounds


def test_centering_changes_u_not_rewards():
    zc, zr, w = pairs()
    centred, raw = make_method(center_features=True), make_method(center_features=False)
    for m in (centred, raw):
        m._build(zc.shape[1])
        m._fit_features(zc, zr, w)
    a, b = centred.score_features(zc), raw.score_features(zc)
    np.testing.assert_allclose(a.reward, b.reward, rtol=1e-6)
    # raw u carries the shared offset that the BT likelihood never constrains: larger and nearly constant
    assert (b.upper - b.reward).mean() > (a.upper - a.reward).mean()
    u_raw = quadratic_form_sqrt(raw.cholesky, zc[:5])
    np.testing.assert_allclose((b.upper - b.reward)[:5], 0.5 * u_raw.numpy(), rtol=1e-5)


def test_save_load_identical(tmp_path):
    zc, zr, w = pairs(n=64)
    m = make_method()
    m._build(zc.shape[1])
    m._fit_features(zc, zr, w)
    m.save(tmp_path)
    loaded = make_method().load(tmp_path)
    a, b = m.score_features(zc), loaded.score_features(zc)
    np.testing.assert_array_equal(a.reward, b.reward)
    np.testing.assert_array_equal(a.lower, b.lower)


def _distributed_worker(rank, world, port, zc, zr, w, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        m = make_method()
        m._build(zc.shape[1])
        m._fit_features(zc, zr, w)  # every rank sees all pairs for the MAP; H from its shard + all-reduce
        out.put((rank, m.precision.numpy()))
    finally:
        torch.distributed.destroy_process_group()


def test_precision_sums_over_all_processes():
    zc, zr, w = pairs(n=90)
    single = make_method()
    single._build(zc.shape[1])
    single._fit_features(zc, zr, w)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # forkserver children (tests/child_processes.py): torch imported already, as in a fork, but no CUDA state
    out = child_processes.queue()
    child_processes.start_ranks(_distributed_worker, args=(2, port, zc, zr, w, out), nprocs=2)
    precisions = dict(out.get(timeout=60) for _ in range(2))
    for rank in (0, 1):
        torch.testing.assert_close(torch.from_numpy(precisions[rank]), single.precision)


@pytest.mark.parametrize("kw, key", [(dict(reg_lambda=0.0), "reg_lambda"), (dict(beta=-1.0), "beta"),
                                     (dict(hessian="full"), "hessian")])
def test_bad_hyperparameters(kw, key):
    with pytest.raises(UserError, match=f"method.{key}="):
        make_method(**kw)
