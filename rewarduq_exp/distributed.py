"""Which process am I? (``torchrun`` / ``accelerate launch`` runs; one process otherwise).

Under a launcher every process runs the whole of ``train.py``: all of them train (the fine-tuning methods through
TRL/accelerate, which initialise ``torch.distributed``) and all of them score, but only the main process (rank 0)
writes the run folder, prints the summary and talks to wandb. Before a trainer has initialised ``torch.distributed``
the launcher's ``RANK`` / ``WORLD_SIZE`` environment variables say the same thing.
"""

from __future__ import annotations

import os


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


def launcher_overrides(argv: list[str]) -> tuple[list[str], str | None]:
    """(extra Hydra overrides, error) for a run started by a launcher; ``([], None)`` for a plain run.

    * all processes must use the same run folder, but the default one is named after the start time (to the second),
      which the processes need not agree on: ask for ``hydra.run.dir=...`` instead of guessing.
    * only rank 0 writes Hydra's ``.hydra/`` copy of the config (the others would rewrite the same files).
    """
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return [], None
    if not any(a.startswith(("hydra.run.dir=", "++hydra.run.dir=", "+hydra.run.dir=")) for a in argv):
        return [], (f"running as one of {os.environ['WORLD_SIZE']} processes (torchrun / accelerate launch): pass "
                    "hydra.run.dir=<folder> so that all processes share one run folder (the default folder name "
                    "holds the start time, which the processes need not agree on)")
    return ([] if is_main() else ["hydra.output_subdir=null"]), None
