"""The Trainer callbacks of MCD-DPO's training: the run's checkpoint phase, and a progress log line with bars off.

Checkpoints: inside a run (``train.py``) the training is one phase of the run's training checkpoints
(:mod:`rewarduq_exp.core.training_checkpoint`), like every loop that :func:`~rewarduq_exp.methods.base.run_training`
drives. At the end of an optimizer step that is due (or after a stop signal) the Trainer first logs the step, then its
``_save_checkpoint`` writes the phase file: trainable weights, AdamW state, scheduler, the Trainer's state (step,
epoch, log history) and its running log sums, every RNG state; safetensors + JSON, no pickle. The data order needs no
state of its own: accelerate's seedable sampler draws epoch ``e``'s order from ``data_seed + e``. A resumed run lets
the Trainer resume from a folder that holds only ``trainer_state.json`` (so it skips the batches already trained, as
it does for its own checkpoints) and takes the weights, optimizer, scheduler and RNG from the phase file where the
Trainer would read its ``.pt`` files (the trainer's ``_load_*`` overrides); the RNG is restored at the very point the
Trainer restores its own, so the remaining steps draw the same dropout masks. A finished phase keeps the trained
weights and history: a run launched again after training skips tokenisation, the reference pass and training.

The classes are built on first use (transformers is imported only then).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from pathlib import Path

from rewarduq_exp.core import job_signals, training_checkpoint
from rewarduq_exp.core.distributed import max_across, world_size
from rewarduq_exp.core.progress import ProgressClock
from rewarduq_exp.methods.mcd_dpo.weights import _param_tensors

log = logging.getLogger("rewarduq_exp")


@functools.cache
def _phase_checkpoint_class():
    from transformers import TrainerCallback

    class PhaseCheckpoint(TrainerCallback):
        """The run's checkpoint phase inside the Trainer's loop (see this module's docstring).

        ``on_step_end`` decides whether this step is saved: due on the run's schedule, or a stop signal (under
        torchrun every rank takes the largest signal of all, so all stop at the same step). The Trainer then logs the
        step and calls ``_save_checkpoint`` (-> :meth:`save`), then ``on_save``, which leaves on a stop: after the
        save, with the step's log record in the saved history. The last step is not saved here: the finished phase is
        (see ``McdDpo._fit``).
        """

        def __init__(self, trainer, phase, total: int, saved):
            self.trainer, self.phase, self.total, self.saved = trainer, phase, total, saved
            self.stop = 0

        def resume_dir(self, root: str) -> str | None:
            """A folder for ``train(resume_from_checkpoint=...)``: the saved Trainer state as trainer_state.json,
            nothing else (the Trainer reads the rest through the trainer's ``_load_*`` overrides)."""
            if self.saved is None:
                return None
            folder = Path(root) / f"resume-{self.saved.step}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "trainer_state.json").write_text(json.dumps(self.saved.meta["trainer_state"]))
            return str(folder)

        def on_train_begin(self, args, state, control, **kwargs):
            if state.max_steps != self.total:   # the phase file is matched by this count: both must be the Trainer's
                raise RuntimeError(f"mcd_dpo: the Trainer plans {state.max_steps} optimizer steps but the checkpoint "
                                   f"phase counts {self.total} (McdDpo._optimizer_steps is out of step with it)")
            if self.saved is None:
                return
            # The Trainer resets its running log sums right before this event; a step saved between two log steps
            # (log_every > 1) takes them back, so the next logged loss averages the same steps as without the stop.
            t, sums = self.trainer, self.saved.meta["trainer_sums"]
            t._tr_loss = self.saved.tensors["trainer.tr_loss"].to(t._tr_loss.device)
            t._globalstep_last_logged = int(sums["globalstep_last_logged"])
            t._total_loss_scalar = float(sums["total_loss_scalar"])
            t.current_flos = float(sums["current_flos"])
            t._metrics["train"].clear()
            t._metrics["train"].update({k: list(v) for k, v in sums["metrics"].items()})

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= state.max_steps:
                return
            stop = job_signals.stop_requested() or 0
            if world_size() > 1:
                stop = max_across(stop)
            if stop or self.phase.due(state.global_step):
                self.stop = stop
                control.should_save = True

        def save(self) -> None:
            t = self.trainer
            step = t.state.global_step
            opt_tensors, groups = training_checkpoint.optimizer_state(t.optimizer)
            tensors = {**_param_tensors(t.accelerator.unwrap_model(t.model)), **opt_tensors,
                       "trainer.tr_loss": t._tr_loss.detach(), **training_checkpoint.rng_tensors()}
            meta = {"step": step, "total": self.total, "done": False, "optimizer_groups": groups,
                    "scheduler": training_checkpoint.scheduler_state(t.lr_scheduler),
                    "trainer_state": dataclasses.asdict(t.state),
                    "trainer_sums": {"globalstep_last_logged": t._globalstep_last_logged,
                                     "total_loss_scalar": t._total_loss_scalar, "current_flos": t.current_flos,
                                     "metrics": {k: list(v) for k, v in t._metrics["train"].items()}},
                    **training_checkpoint.rng_meta()}
            seconds = self.phase.save(tensors, meta)
            log.info("%s: training state saved at step %d of %d (%.2f s)", self.phase.name, step, self.total, seconds)

        def on_save(self, args, state, control, **kwargs):
            if self.stop:
                raise job_signals.TrainingInterrupted(self.stop, f"at step {state.global_step} of {self.total} of "
                                                                 f"{self.phase.name}")

    return PhaseCheckpoint


@functools.cache
def _progress_log_callback_class():
    from transformers import TrainerCallback

    class ProgressLogCallback(TrainerCallback):
        """A log line every few minutes while the Trainer trains with bars off (see ``rewarduq_exp.core.progress``)."""

        clock = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.clock = ProgressClock("mcd_dpo training", state.max_steps, "steps", initial=state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.clock is not None and logs and "loss" in logs:
                self.clock.values["loss"] = float(logs["loss"])

        def on_step_end(self, args, state, control, **kwargs):
            if self.clock is not None:
                self.clock.update(state.global_step)

    return ProgressLogCallback
