"""The one training loop of every method we train ourselves (:func:`run_training`) and its learning-rate schedule
(:func:`cosine_schedule_with_warmup`); the settings it runs are a :class:`~rewarduq_exp.methods.schedule.
TrainingSchedule`. Both stay importable from :mod:`rewarduq_exp.methods.base`."""

from __future__ import annotations

import logging
import math

import torch

from rewarduq_exp.core import distributed
from rewarduq_exp.core.progress import progress
from rewarduq_exp.methods.adamw import FunctionalAdamW
from rewarduq_exp.methods.schedule import TrainingSchedule

log = logging.getLogger("rewarduq_exp")


def cosine_factor(warmup_steps: int, total_steps: int):
    """The factor of the learning rate at each step: linear warm-up from 0 over ``warmup_steps``, then a half cosine
    to 0 at ``total_steps``: the schedule of ``transformers.get_cosine_schedule_with_warmup`` (RewardUQ Appendix
    B.2), value for value (tested).

    Written here because importing ``transformers.optimization`` pulls in ``trainer_utils`` and, through it, PEFT and
    every model's generation code: 2.8 s of every frozen-backbone run on a 2-core CPU for a three-line formula.
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    return factor


def cosine_schedule_with_warmup(optimizer, warmup_steps: int, total_steps: int):
    """:func:`cosine_factor` as a ``LambdaLR`` on a torch optimizer."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_factor(warmup_steps, total_steps))


def clip_total_norm(params: list, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (the same total norm, the same coefficient), except that on a CPU the
    gradients are not multiplied when the coefficient is exactly 1: that multiplication changes no value but is one
    more pass over every gradient (10 MB a step for ENS-MLP's K = 20 heads on 1024 features). torch multiplies
    anyway to spare a GPU the synchronisation the test needs, so on a GPU it still does."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    grads = [p.grad for p in params if p.grad is not None]
    total = get_total_norm(grads)
    if grads and all(g.device.type == "cpu" for g in grads) and bool(max_norm / (total + 1e-6) >= 1.0):
        return total
    clip_grads_with_norm_(params, max_norm, total)
    return total


def run_training(params, n: int, schedule: TrainingSchedule, step, *, seed: int, desc: str, history: list,
                 show_progress: bool, log_every: int, clip=None, synchronized: bool = False,
                 step_knows_records: bool = False) -> int:
    """The one training loop of every method we train ourselves (MCD-DPO trains through TRL's DPOTrainer, BoRP
    fits closed-form regressors, Mallows and RPC are not trained by gradients): AdamW with cosine warm-up (or a
    constant learning rate) over ``ceil(n / batch_size * num_epochs)`` steps, one seeded permutation of the ``n`` rows
    per epoch (same seed, same order on every process), and a log record every ``log_every`` steps.

    ``step(index)`` runs the forward and backward pass of one batch (CPU row indices) and returns the values to log
    (``loss`` first). ``clip()`` replaces the default clipping of the total gradient norm over ``params`` at
    ``schedule.max_grad_norm`` (ENS-LoRA clips each member on its own); the default also logs ``grad_norm``.
    With ``step_knows_records``, ``step(index, record)`` is told whether this step's values will be logged, so it
    can skip computing values nobody reads (it must still return ``loss`` when ``record`` is true).
    Returns the number of steps taken.

    Inside a run (``train.py``), the loop is one phase of the run's training checkpoints
    (:mod:`rewarduq_exp.core.training_checkpoint`): it resumes from a saved state (exactly: parameters, optimizer,
    scheduler, data order and every RNG state), saves on the run's schedule and when the job is signalled
    (:mod:`rewarduq_exp.core.job_signals`), and keeps its final state once done. ``synchronized``: every process of a
    distributed run runs this loop in step (ENS-LoRA's data parallelism), so they agree on when to stop.
    """
    from rewarduq_exp.core import job_signals, training_checkpoint

    params = list(params)
    steps_per_epoch = math.ceil(n / schedule.batch_size)
    total = max(1, math.ceil(steps_per_epoch * schedule.num_epochs))
    # foreach: the same arithmetic in the same order as the per-tensor loop torch picks on a CPU (equal to the bit),
    # with the denominator divided in place instead of into one more tensor the size of the parameters. Stepped
    # through torch's functional AdamW: torch.optim.AdamW would import torch._dynamo (0.8 s; methods/adamw.py).
    optimizer = FunctionalAdamW(params, lr=schedule.learning_rate, betas=tuple(schedule.adam_betas),
                                eps=schedule.adam_eps, weight_decay=schedule.weight_decay)
    if schedule.lr_schedule == "constant":
        factor = lambda step: 1.0   # noqa: E731
    else:
        factor = cosine_factor(int(round(schedule.warmup_ratio * total)), total)
    # as torch's LambdaLR sets it: the base rate times the factor of the step about to be taken
    learning_rate = lambda step: schedule.learning_rate * factor(step)   # noqa: E731
    max_norm = schedule.max_grad_norm if schedule.max_grad_norm is not None else float("inf")
    generator = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    checkpoints = training_checkpoint.active()
    phase = checkpoints.phase(desc) if checkpoints is not None else None
    first = 0
    saved = phase.load(total) if phase is not None else None
    if saved is not None:
        with torch.no_grad():
            for i, p in enumerate(params):
                p.copy_(saved.tensors[f"param.{i}"])
        training_checkpoint.restore_rng(saved)
        history[:] = saved.meta["history"]
        if saved.done:
            log.info("%s: already trained (%s); not training again", desc, phase.path)
            return total
        training_checkpoint.load_optimizer_state(optimizer, saved)   # the learning rate follows from the step
        generator.set_state(saved.tensors["data.generator"])
        order, first = saved.tensors["data.order"], saved.step
        log.info("%s: resumed at step %d of %d (%s)", desc, first, total, phase.path)

    def save(done: bool, step_count: int) -> float:
        tensors = {f"param.{i}": p for i, p in enumerate(params)}
        meta = {"step": step_count, "total": total, "done": done, "history": list(history),
                **training_checkpoint.rng_meta()}
        if not done:   # a finished phase needs only its result
            opt_tensors, groups = training_checkpoint.optimizer_state(optimizer)
            tensors |= opt_tensors | {"data.generator": generator.get_state(), "data.order": order}
            meta |= {"optimizer_groups": groups}   # the learning rate follows from "step"
        return phase.save(tensors | training_checkpoint.rng_tensors(), meta)

    bar = progress(range(first, total), desc=desc, show=show_progress, unit="steps", initial=first, total=total,
                   quiet=not distributed.is_main())
    with job_signals.training_loop():
        for i in bar:
            start = (i % steps_per_epoch) * schedule.batch_size
            if start == 0:
                order = torch.randperm(n, generator=generator)
            optimizer.zero_grad()
            record = i % log_every == 0 or i == total - 1
            batch = order[start:start + schedule.batch_size]
            values = step(batch, record) if step_knows_records else step(batch)
            if clip is None:
                values["grad_norm"] = clip_total_norm(params, max_norm)
            else:
                clip()
            optimizer.step(learning_rate(i))
            if record:
                record = {"step": i + 1, "loss": float(values.pop("loss")), "lr": learning_rate(i + 1),
                          **{k: float(v) for k, v in values.items()}}
                history.append(record)
                bar.set_postfix(loss=f"{record['loss']:.4f}")
            if phase is None or i == total - 1:
                continue
            due = phase.due(i + 1)
            stop = job_signals.stop_requested() or 0
            if synchronized:
                stop = distributed.max_across(stop)
            if stop or due:
                seconds = save(False, i + 1)
                log.info("%s: training state saved at step %d of %d (%.2f s)", desc, i + 1, total, seconds)
                if stop:
                    raise job_signals.TrainingInterrupted(stop, f"at step {i + 1} of {total} of {desc}")
    if phase is not None:
        save(True, total)
        if stop := job_signals.stop_requested():   # signalled during the last step: leave with the result saved
            raise job_signals.TrainingInterrupted(stop, f"after the last step of {desc}")
    return total
