"""Training checkpoints: what lets a killed, preempted or timed-out run resume exactly where it stopped.

A run trains in one or more *phases* (one per training loop: ENS-MLP, BAY-LIN's MAP fit and ENS-LoRA have one, a
label-ranking learner one per cross-validation fold), numbered in the order they start, which is the same in every
attempt of the same config. Each phase's state lives in one file, ``<run>/checkpoint/<NN>-<phase>.safetensors``:

* the tensors: the trainable parameters, the optimizer's state, the data order of the epoch (and its generator), the
  torch RNG states (CPU and every CUDA device), numpy's Mersenne twister keys;
* in the file's header (safetensors metadata, JSON): the step, the scheduler's state, the optimizer's param groups,
  python's and numpy's remaining RNG state, the training history, the config hash of the run, whether the phase
  is done, and the seconds the phase has trained so far over every attempt (``seconds``; a resumed run adds them to
  its training time, so ``method.json`` reports the whole of it, see :attr:`TrainingCheckpoints.earlier_seconds`).

One file per phase, written to a temporary name and renamed (``atomic_path``), so a job killed while writing leaves the
previous checkpoint intact; safetensors and JSON only, so a checkpoint from a shared run folder runs no code when it
is read (no pickle). A finished phase keeps its final state (a job killed while scoring does not train again); the
run deletes the whole folder when it completes.

When a phase is saved: every ``checkpoint.every_steps`` optimizer steps, every ``checkpoint.every_minutes`` minutes,
and at the next step boundary after the process is signalled (``SIGINT``: Ctrl-C; ``SIGTERM``: preemption,
``scancel``, ``kill``; ``SIGUSR1`` / ``SIGUSR2``: Slurm's warning before the time limit, see
:mod:`rewarduq_exp.core.job_signals`). A resumed phase takes every value back, so the rest of the run computes
exactly what an uninterrupted one would.

Only the training loops of an active run checkpoint (``train.py`` activates a :class:`TrainingCheckpoints` for its
folder): the Python API's ``method.fit`` keeps no state on disk.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rewarduq_exp.core.atomic_write import atomic_path
from rewarduq_exp.core.distributed import rank, world_size
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.job_signals import deferred

log = logging.getLogger("rewarduq_exp")

CHECKPOINT_DIR = "checkpoint"
FORMAT = 1


@dataclass
class TrainingState:
    """What one phase saved: tensors by name and the JSON header."""

    tensors: dict[str, torch.Tensor]
    meta: dict

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def done(self) -> bool:
        return bool(self.meta.get("done"))


class TrainingCheckpoints:
    """The checkpoints of one run: ``directory`` (``<run>/checkpoint``), the run's config hash (a checkpoint of
    another config is never taken), and when to save."""

    def __init__(self, directory: str | Path, config_hash: str | None, every_steps: int | None = None,
                 every_minutes: float | None = None):
        self.directory = Path(directory)
        self.config_hash = config_hash
        self.every_steps = int(every_steps) if every_steps else None
        self.every_s = float(every_minutes) * 60 if every_minutes else None
        self._phases = 0
        self.resumed: list[str] = []   # what this attempt took from a checkpoint (reported in status.json)
        self.last_saved: str | None = None   # what this attempt saved last ("step 37 of 190 of <phase>"), if anything
        # Training seconds of earlier attempts in the phases this one resumed, up to their last save (work after it
        # was lost and is done again, so it is counted once, in this attempt).
        self.earlier_seconds = 0.0

    def phase(self, name: str) -> Phase:
        """The next phase of the run (its number is its order: the same in every attempt of one config)."""
        self._phases += 1
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[:60] or "training"
        suffix = f"-rank{rank()}" if world_size() > 1 else ""
        return Phase(self, self.directory / f"{self._phases:02d}-{slug}{suffix}.safetensors", name)

    def clear(self) -> None:
        """Delete every checkpoint (the run completed, or starts over with ``force=true``)."""
        shutil.rmtree(self.directory, ignore_errors=True)

    def exists(self) -> bool:
        return self.directory.is_dir() and any(self.directory.glob("*.safetensors"))


class Phase:
    """One training loop's checkpoint file: :meth:`load` at the start, :meth:`due` after every step, :meth:`save`."""

    def __init__(self, owner: TrainingCheckpoints, path: Path, name: str):
        self.owner, self.path, self.name = owner, path, name
        self._last_save = self._begun = time.monotonic()
        self._earlier_s = 0.0   # this phase's training seconds in earlier attempts (from the checkpoint it resumes)

    def load(self, total: int) -> TrainingState | None:
        """The saved state of this phase, or None to start it fresh (no file; a file of another config or another
        number of steps is set aside with a warning, never read). A damaged file is one line naming it."""
        if not self.path.exists():
            return None
        from rewarduq_exp.core.saved_files import load_safetensors

        tensors = load_safetensors(self.path)
        meta = _header(self.path)
        if meta.get("config_hash") != self.owner.config_hash or int(meta.get("total", -1)) != total:
            log.warning("checkpoint %s belongs to another config or schedule (hash %s, %s steps; this run %s, %d "
                        "steps): not resumed from, starting this phase from step 0", self.path,
                        meta.get("config_hash"), meta.get("total"), self.owner.config_hash, total)
            return None
        self.owner.resumed.append(f"{self.name}: step {meta['step']} of {total}" + (" (done)" if meta.get("done")
                                                                                     else ""))
        earlier = meta.get("seconds")
        if isinstance(earlier, (int, float)) and not isinstance(earlier, bool) and 0 <= earlier < float("inf"):
            self._earlier_s = float(earlier)
            self.owner.earlier_seconds += self._earlier_s
        return TrainingState(tensors, meta)

    def due(self, step: int) -> bool:
        """Save after optimizer step ``step`` (1-based)? Every ``every_steps`` steps or ``every_minutes`` minutes."""
        every_steps, every_s = self.owner.every_steps, self.owner.every_s
        if every_steps and step % every_steps == 0:
            return True
        # Time-based saves only in a one-process run: the ranks of a distributed run would decide at different
        # steps (their files must describe one step); they save on the step schedule.
        return bool(every_s and world_size() == 1 and time.monotonic() - self._last_save >= every_s)

    def save(self, tensors: dict[str, torch.Tensor], meta: dict) -> float:
        """Write this phase's state atomically; returns the seconds it took. A stop signal (a second Ctrl-C) that
        arrives meanwhile waits until the file is in place (:func:`rewarduq_exp.core.job_signals.deferred`)."""
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        header = {"format": FORMAT, "config_hash": self.owner.config_hash, "phase": self.name,
                  "seconds": round(self._earlier_s + time.monotonic() - self._begun, 3), **meta}
        with deferred():
            tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
            with atomic_path(self.path) as tmp:
                save_file(tensors, str(tmp), metadata={"state": json.dumps(header)})
            self.owner.last_saved = (f"step {header.get('step')} of {header.get('total')} of {self.name}"
                                     + (" (training done)" if header.get("done") else ""))
        self._last_save = time.monotonic()
        return time.perf_counter() - t0


def _header(path: Path) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {})["state"])
        if not isinstance(meta, dict) or "step" not in meta:
            raise ValueError("no step")
    except (KeyError, ValueError, OSError) as err:
        raise UserError(f"{path} is not a training checkpoint of this project ({type(err).__name__}: {err}); "
                        "delete it to start the run over") from None
    return meta


# ---------------------------------------------------------------------------------------------------- active run
_ACTIVE: TrainingCheckpoints | None = None


@contextlib.contextmanager
def activate(checkpoints: TrainingCheckpoints | None) -> Iterator[TrainingCheckpoints | None]:
    """Make ``checkpoints`` the one the training loops of this process save to, while the block runs."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, checkpoints
    try:
        yield checkpoints
    finally:
        _ACTIVE = previous


def active() -> TrainingCheckpoints | None:
    return _ACTIVE


# ---------------------------------------------------------------------------------------------------- state pieces
def rng_tensors() -> dict[str, torch.Tensor]:
    """Every random state a training step draws from, as tensors: torch (CPU, each CUDA device), numpy's keys."""
    out = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = state
    keys = np.random.get_state()[1]   # the Mersenne twister's 624 words (the rest goes in rng_meta)
    out["rng.numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.uint32).view(np.int32).copy())
    return out


def rng_meta() -> dict:
    kind, _, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"rng_numpy": [kind, int(pos), int(has_gauss), float(gauss)],
            "rng_python": [version, list(internal), gauss_next]}


def restore_rng(state: TrainingState) -> None:
    t, meta = state.tensors, state.meta
    torch.set_rng_state(t["rng.torch"])
    cuda = sorted(k for k in t if k.startswith("rng.cuda."))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t[k] for k in cuda])
    kind, pos, has_gauss, gauss = meta["rng_numpy"]
    np.random.set_state((kind, t["rng.numpy_keys"].numpy().view(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = meta["rng_python"]
    random.setstate((version, tuple(internal), gauss_next))


def optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list]:
    """An optimizer's state_dict as (tensors by name, param groups as JSON-able lists)."""
    sd = optimizer.state_dict()
    tensors = {}
    for index, values in sd["state"].items():
        for key, value in values.items():
            tensors[f"optimizer.{index}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return tensors, sd["param_groups"]


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: TrainingState) -> None:
    per_param: dict[int, dict] = {}
    for name, value in state.tensors.items():
        if name.startswith("optimizer."):
            _, index, key = name.split(".", 2)
            per_param.setdefault(int(index), {})[key] = value
    groups = state.meta["optimizer_groups"]
    for group in groups:   # JSON has no tuples; torch keeps betas as a tuple
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": per_param, "param_groups": groups})


def scheduler_state(scheduler) -> dict:
    sd = scheduler.state_dict()
    sd.pop("lr_lambdas", None)   # functions: rebuilt by the method, not state
    return sd


def load_scheduler_state(scheduler, state: TrainingState) -> None:
    sd = dict(state.meta["scheduler"])
    if hasattr(scheduler, "lr_lambdas"):   # LambdaLR expects one entry per lambda (None: a plain function)
        sd["lr_lambdas"] = [None] * len(scheduler.lr_lambdas)
    scheduler.load_state_dict(sd)
