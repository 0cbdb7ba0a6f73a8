"""Which process am I, and the few collective steps a run needs (``torchrun`` / ``accelerate launch`` / a
multi-task Slurm job; one process otherwise, where every helper here is a no-op).

Under a launcher every process runs the whole of ``train.py`` and :func:`setup` joins them into one
``torch.distributed`` group (through accelerate, so nccl on GPUs and gloo on CPUs, as TRL will use). The work is split,
not repeated:

* backbone features: each process extracts a contiguous shard, rank 0 assembles the cache entry (features.py);
* head fits (ENS-MLP, BAY-LIN): rank 0 fits on the cached features and broadcasts the result (seconds of work);
* ENS-LoRA / MCD-DPO training: data parallel (gradients summed over the processes every step);
* scoring by the fine-tuning methods: each process scores a shard of the rows, rank 0 gathers (evaluation.py).

Only rank 0 writes the run folder, prints the summary and talks to wandb. Before :func:`setup` the launcher's
``RANK`` / ``WORLD_SIZE`` environment variables say who is who.
"""

from __future__ import annotations

import os

import numpy as np


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    if _initialized():
        import torch.distributed as dist

        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def world_size() -> int:
    if _initialized():
        import torch.distributed as dist

        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def is_main() -> bool:
    return rank() == 0


def setup(device_type: str) -> None:
    """Join the launcher's processes into one process group (no-op for a single process or when already joined).

    accelerate's ``PartialState`` reads the launcher's environment and picks the backend and the device: for
    ``device_type`` cpu, gloo and the CPU (nothing of CUDA, also on a GPU node); otherwise, where CUDA is available,
    nccl and ``cuda:LOCAL_RANK``, bound with ``torch.cuda.set_device`` (so ``cuda`` means this process's own GPU). TRL's
    trainer later finds the same state.
    """
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1 or _initialized():
        return
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=device_type == "cpu")
    if state.distributed_type == DistributedType.MULTI_CPU:
        _barrier_on_the_cpu(state)


def _barrier_on_the_cpu(state) -> None:
    """accelerate's ``wait_for_everyone`` (behind ``Accelerator.wait_for_everyone`` and ``main_process_first``, which
    TRL's trainer calls) runs ``torch.distributed.barrier(device_ids=[local rank])`` whatever the backend, and torch
    then puts the barrier's tensor on ``<the accelerator torch was built for>:<local rank>``: with a CUDA build of
    torch, a process whose device is cpu would create a CUDA context on a GPU, fail with "invalid device ordinal" where
    the node has fewer GPUs than processes, or with "CUDA error: initialization error" where it was forked from a
    process that had used CUDA. A gloo barrier needs no device (torch takes the CPU when none is named): the state that
    every ``PartialState``, ``AcceleratorState`` and ``Accelerator`` shares gets a ``wait_for_everyone`` without
    device ids, for as long as that state lives."""
    import torch.distributed as dist

    def wait_for_everyone() -> None:
        dist.barrier()

    state.wait_for_everyone = wait_for_everyone  # the shared state's attribute, ahead of the class's method


def _collective_device():
    """Where this process's collectives put their tensors: its own GPU under nccl (``setup`` bound it with
    ``torch.cuda.set_device``), the CPU otherwise."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if _initialized() and world_size() > 1:
        import torch.distributed as dist

        device = _collective_device()
        if device.type == "cuda":  # name this process's GPU (torch would otherwise guess one, and warn)
            dist.barrier(device_ids=[device.index])
        else:  # gloo: no device named, torch takes the CPU
            dist.barrier()


def broadcast_from_main(obj):
    """Rank 0's ``obj`` on every process (picklable objects; tensors travel as CPU copies)."""
    if not _initialized() or world_size() == 1:
        return obj
    import torch.distributed as dist

    box = [obj if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_all(obj) -> list:
    """Every process's ``obj``, in rank order, on every process."""
    if not _initialized() or world_size() == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def shard_rows(n: int) -> np.ndarray:
    """This process's contiguous block of ``range(n)`` (blocks in rank order concatenate back to ``range(n)``)."""
    return np.array_split(np.arange(n), world_size())[rank()]


def launcher_overrides(argv: list[str]) -> tuple[list[str], str | None]:
    """(extra Hydra overrides, error) for a run started by a launcher; ``([], None)`` for a plain run.

    * all processes must use the same run folder, but the default one is named after the start time (to the second),
      which the processes need not agree on: ask for ``hydra.run.dir=...`` instead of guessing.
    (Only rank 0 writes the run folder, ``.hydra/`` included: ``train.py`` writes it, not Hydra.)
    """
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return [], None
    if not any(a.startswith(("hydra.run.dir=", "++hydra.run.dir=", "+hydra.run.dir=")) for a in argv):
        return [], (f"running as one of {os.environ['WORLD_SIZE']} processes (torchrun / accelerate launch): pass "
                    "hydra.run.dir=<folder> so that all processes share one run folder (the default folder name "
                    "holds the start time, which the processes need not agree on)")
    return [], None


def max_across(value: int) -> int:
    """The largest of every process's ``value`` (one small all-reduce; ``value`` itself in a one-process run). All
    processes must call it at the same point."""
    if not _initialized() or world_size() == 1:
        return value
    import torch
    import torch.distributed as dist

    box = torch.tensor([value], dtype=torch.long, device=_collective_device())
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return int(box.item())
