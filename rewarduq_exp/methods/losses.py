"""The pairwise losses every reward model trains on: the Bradley-Terry NLL of the label and the centring term of
RewardUQ eq. 11, written once for every method (heads on frozen features, the LoRA members, the epinet's indices).

A pair's loss is ``-log sigmoid(r_c - r_r) + gamma * (r_c + r_r)^2``: the centring pins the reward's free offset
(the likelihood sees only margins) near zero. :func:`bradley_terry_loss` returns the two terms weighted by the pair
weights; the caller adds ``gamma`` times the second, because some methods log the terms apart or add other terms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def weighted_mean(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (values * weight).sum() / weight.sum()


def bradley_terry_nll(margin: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(r_chosen - r_rejected), elementwise (the Bradley-Terry likelihood of the label)."""
    return -F.logsigmoid(margin)


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, weight: torch.Tensor, *,
                       normalise: bool = False, mean_over_members: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(bt, center): the Bradley-Terry NLL and the centring term ``(r_c + r_r)^2`` of pairs, weighted by ``weight``
    (one per pair, the last axis).

    ``r_chosen``, ``r_rejected``: rewards (..., B), a leading axis for members (ENS-LoRA, ENS-MLP) or epinet indices.
    By default each term is the weighted SUM over the pairs, one value per leading index (the LoRA members: their
    ``weight`` is already divided by the whole batch's total, so micro-batches add up to the step). ``normalise``:
    the weighted MEAN instead (divided by ``weight.sum()``); ``mean_over_members``: the terms are first averaged over
    the leading axis (ENS-MLP and the epinet: the loss of the mean over members / indices), so the result is a
    scalar."""
    nll = bradley_terry_nll(r_chosen - r_rejected)
    center = (r_chosen + r_rejected).pow(2)
    if mean_over_members:
        nll, center = nll.mean(0), center.mean(0)
    if normalise:
        return weighted_mean(nll, weight), weighted_mean(center, weight)
    return (nll * weight).sum(-1), (center * weight).sum(-1)
