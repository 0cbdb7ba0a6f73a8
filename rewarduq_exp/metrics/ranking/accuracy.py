"""Accuracy of the modal ranking: Kendall tau, Spearman footrule, top-1 accuracy."""

from __future__ import annotations

import numpy as np

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics.ranking.events import _CHUNK_ELEMENTS, check_true_ranks


def _check_pair(true_ranks, pred_ranks) -> tuple[np.ndarray, np.ndarray]:
    t = check_true_ranks(true_ranks)
    p = np.asarray(pred_ranks)
    if p.shape != t.shape:
        raise UserError(f"predicted ranks have shape {p.shape}, true ranks {t.shape}")
    return t, p


def kendall_tau_samples(true_ranks, pred_ranks) -> np.ndarray:
    """Per-sample Kendall tau_a: (concordant - discordant) / (m (m - 1) / 2) over item pairs; a pair tied in either
    ranking counts as discordant (sklr's ``tau_score``, used by the reference). 1 = identical, -1 = reversed."""
    t, p = _check_pair(true_ranks, pred_ranks)
    m = t.shape[1]
    i, j = np.triu_indices(m, k=1)
    step = max(1, _CHUNK_ELEMENTS // len(i))
    out = np.empty(len(t))
    for lo in range(0, len(t), step):
        s = np.sign(t[lo: lo + step, i] - t[lo: lo + step, j]) * np.sign(p[lo: lo + step, i] - p[lo: lo + step, j])
        out[lo: lo + step] = 2.0 * (s > 0).sum(axis=1) / len(i) - 1.0
    return out


def footrule_samples(true_ranks, pred_ranks) -> np.ndarray:
    """Per-sample Spearman footrule sum_j |rank_true(j) - rank_pred(j)| (0 = identical)."""
    t, p = _check_pair(true_ranks, pred_ranks)
    return np.abs(t - p).sum(axis=1).astype(np.float64)


def max_footrule(m: int) -> int:
    """The largest footrule between two rankings of m items, floor(m^2 / 2) (attained by the reversal)."""
    return (m * m) // 2


def top1_correct(true_ranks, pred_ranks) -> np.ndarray:
    """Per sample, 1.0 where the predicted best item (rank 1) is the true best item."""
    t, p = _check_pair(true_ranks, pred_ranks)
    return (np.argmin(t, axis=1) == np.argmin(p, axis=1)).astype(np.float64)


def ranking_accuracy(true_ranks, pred_ranks) -> dict[str, float]:
    """Means over samples: ``kendall_tau``, ``footrule``, ``footrule_norm`` (footrule / floor(m^2/2), in [0, 1])
    and ``top1_accuracy``."""
    t, p = _check_pair(true_ranks, pred_ranks)
    foot = footrule_samples(t, p)
    return {
        "kendall_tau": float(kendall_tau_samples(t, p).mean()),
        "footrule": float(foot.mean()),
        "footrule_norm": float(foot.mean() / max_footrule(t.shape[1])),
        "top1_accuracy": float(top1_correct(t, p).mean()),
    }
