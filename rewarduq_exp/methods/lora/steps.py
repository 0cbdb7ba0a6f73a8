"""Pieces of a LoRA training step: the anchor that pulls each member's trainable parameters towards their initial
values, and the one all-reduce of a data-parallel step.

The anchor of member k over its trainable parameters theta_k (LoRA + head), with theta_k0 their initial values:

* ``l2`` (ENS-LoRA's default): ``||theta_k - theta_k0||_2``, the unsquared L2 norm over all of the member's trainable
  parameters, not divided by their count. This is what the RewardUQ authors' LoRA trainer trains with
  (``lambda * torch.norm(weights - initial_weights, p=2)``), so Table 1's lambdas (0.01, 0.001 for 4B) and the sweep
  grid {0.001, 0.01, 0.1} mean this form. Its gradient has norm lambda wherever theta != theta_0 (a constant pull);
  at theta = theta_0 the norm is computed as a norm of per-tensor norms, whose (sub)gradient there is 0, not NaN.
* ``mean_squared``: the mean over those parameters of (theta - theta_0)^2, the form ENS-MLP's eq. 11 uses (per
  parameter, so the same lambda is a much weaker pull: tune lambda anew when choosing it).
"""

from __future__ import annotations

import torch

ANCHORS = ("l2", "mean_squared")


def anchor_value(diffs: list[torch.Tensor], form: str) -> torch.Tensor:
    """The anchor (module docstring) per member, ``(K,)``, from ``diffs``: (K, n_i) differences theta - theta_0 of
    every trainable tensor, member-major."""
    if form == "l2":
        # A norm of per-tensor norms: vector_norm's (sub)gradient at 0 is 0, where sqrt(sum of squares) would give
        # 0 * inf = NaN at the first step (theta = theta_0).
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d, dim=1) for d in diffs]), dim=0)
    return sum(d.pow(2).sum(1) for d in diffs) / sum(d.shape[1] for d in diffs)


def sum_over_processes(params, parts: torch.Tensor) -> torch.Tensor:
    """Sum the gradients of ``params`` and the loss ``parts`` over the processes, in ONE all-reduce of a flat buffer.

    Not DDP: ENS-LoRA's per-member path runs K backward passes per step and each touches one member's slices only,
    which DDP's once-per-backward bucketed reduction does not support without find_unused_parameters and no_sync
    juggling; the trainable parameters are small (LoRA + heads), so one flat reduction per step is cheap.
    """
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads] + [parts.reshape(-1).to(grads[0].dtype)])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    return flat[offset:].view_as(parts).to(parts.dtype)
