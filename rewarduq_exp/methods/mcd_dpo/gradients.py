"""Gradient averaging over the processes of a data-parallel MCD-DPO run (torchrun, ``accelerate launch``, a
multi-task Slurm job).

Each process trains on its own micro-batches. The Trainer wraps the policy in DDP, but the trainer's ``compute_loss``
calls the body and the LM head directly (the wrapper's forward would compute the full-vocabulary logits), so DDP
never reduces anything; the trainer averages the gradients over the processes itself with
:func:`average_gradients`, once per optimizer step before clipping (its ``training_step``): the processes train as
one process does on the same global batches (but for the dropout masks, which each process draws for its own rows).
Under FSDP the sharded model reduces its own gradients.
"""

from __future__ import annotations

import torch

# Gradients are all-reduced in flat buckets of at most this many bytes: few collectives, and the extra memory is one
# bucket, not a second copy of every gradient (a full fine-tune's gradients are as large as its weights).
_GRAD_BUCKET_BYTES = 64 * 2**20


@torch.no_grad()
def average_gradients(params, bucket_bytes: int = _GRAD_BUCKET_BYTES) -> None:
    """Replace each parameter's ``.grad`` by its mean over the processes of the torch.distributed group.

    What DDP's reducer does in backward (mean over ranks of each rank's gradient), done after it. Every process must
    call it at the same point with the same parameters in the same order. A missing gradient counts as zeros (and
    becomes zeros), so every process builds the same buckets. Averaging is idempotent (gradients already equal on all
    processes stay as they are), so a second reduction would cost time, never change the result.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    bucket: list[torch.Tensor] = []
    size = 0

    def flush():
        if len(bucket) == 1 and bucket[0].is_contiguous():
            dist.all_reduce(bucket[0])
            bucket[0].div_(world)
        elif bucket:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat)   # SUM, then divide: gloo has no AVG
            flat.div_(world)
            for g, piece in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(piece.view_as(g))
        bucket.clear()

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        g = p.grad
        nbytes = g.numel() * g.element_size()
        if bucket and (g.dtype != bucket[0].dtype or g.device != bucket[0].device or size + nbytes > bucket_bytes):
            flush()
            size = 0
        bucket.append(g)
        size += nbytes
    flush()
