"""The full-rank Dirichlet-kernel estimator computed in label-sorted row blocks equals the dense formula sample by
sample, on both of its paths (one-hot product for few classes, sums over label runs for many) and at every block
size, with unsorted labels and classes that no sample has."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import gammaln

from rewarduq_exp.metrics import ranking as rm


def dense_kernel_errors(f, y, h, p):
    """Per-sample errors from the whole (n, n) kernel matrix, straight from the definition."""
    n, c = f.shape
    alpha = f / h + 1
    logk = (gammaln(alpha.sum(1)) - gammaln(alpha).sum(1))[None, :] \
        + ((alpha - 1)[None, :, :] * np.log(np.maximum(f, 1e-8))[:, None, :]).sum(-1)
    np.fill_diagonal(logk, -np.inf)
    w = np.exp(logk - logk.max(axis=1, keepdims=True))
    diff = np.abs(w @ np.eye(c)[y] / (w.sum(axis=1, keepdims=True) + 1e-8) - f)
    return diff.max(axis=1) if np.isinf(p) else np.sum(diff**p, axis=1) ** (1 / p)


@pytest.mark.parametrize("n_classes", [2, 3, rm._ONEHOT_MAX_CLASSES, rm._ONEHOT_MAX_CLASSES + 1, 40])
def test_blocked_kernel_equals_dense_formula_per_sample(n_classes):
    rng = np.random.default_rng(n_classes)
    n = 157
    f = rng.dirichlet(np.full(n_classes, 0.6), size=n)
    f[3] = np.eye(n_classes)[0]  # zeros: log clamped at 1e-8
    y = rng.integers(0, max(2, n_classes - 3), size=n)  # unsorted, and the last classes never occur
    for h, p in ((1.0, 1), (0.2, 2), (0.5, np.inf)):
        want = dense_kernel_errors(f, y, h, p)
        for chunk in (None, 1, 10, n):
            got = rm.dirichlet_kernel_errors(f, y, h=h, p=p, chunk_size=chunk)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
        assert rm.dirichlet_kernel_ece(f, y, h=h, p=p) == pytest.approx(want.mean(), abs=1e-12)


def test_kernel_does_not_depend_on_sample_order():
    rng = np.random.default_rng(0)
    f = rng.dirichlet(np.ones(4), size=200)
    y = rng.integers(0, 4, size=200)
    perm = rng.permutation(200)
    errors = rm.dirichlet_kernel_errors(f, y)
    np.testing.assert_allclose(rm.dirichlet_kernel_errors(f[perm], y[perm]), errors[perm], rtol=0, atol=1e-13)
