"""MCD-DPO's TRL trainer: ``DPOTrainer`` with dropout on the final hidden states before the LM head (eq. 13, sigmoid
loss), its pair-weight collator and the weighted DPO loss.

Training goes through TRL's ``DPOTrainer`` with ``precompute_ref_log_probs=True``: the reference log-probs are
computed once per pair before training, never per step, per epoch or per MC sample, and no reference copy stays in
memory while training. That pass is ours (``compute_ref_log_probs``): the body and the chunked LM head of training,
without dropout. ``compute_loss`` is overridden (dropout before the LM head, chunked log-softmax);
``training_step`` averages the gradients over several processes (:mod:`.gradients`). The DPO loss is the
pair-weighted mean of eq. 13 over a micro-batch (weight = repetition); the frame's ``weight`` column reaches
``compute_loss`` through :class:`WeightCollator`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from rewarduq_exp.core import training_checkpoint
from rewarduq_exp.core.distributed import is_main
from rewarduq_exp.core.progress import ProgressClock
from rewarduq_exp.methods.mcd_dpo.callbacks import _progress_log_callback_class
from rewarduq_exp.methods.mcd_dpo.gradients import average_gradients
from rewarduq_exp.methods.mcd_dpo.logprobs import completion_logps, row_generators, row_seed, step_seed
from rewarduq_exp.methods.mcd_dpo.weights import _load_params
from rewarduq_exp.models.shared_prefix import shared_prefix_hidden


class WeightCollator:
    """TRL's preference collator plus a float32 ``weight`` (B,) taken from the examples' ``weight`` column, and each
    row's dropout-mask seed (``row_seeds``, 2B ints in the collator's [chosen; rejected] order: :func:`row_seed` of
    the row's prompt + completion ids) when ``seed`` is given.

    TRL 1.16 keeps every dataset column through its tokenisation ``map`` (``DPOTrainer._prepare_dataset`` only adds
    ``prompt_ids``/``chosen_ids``/``rejected_ids``) and through the reference pre-computation (it concatenates the
    ``ref_*_logps`` columns, axis=1), and with ``remove_unused_columns=False`` the Trainer hands whole rows to the
    collator; but ``DataCollatorForPreference.torch_call`` builds its output from the id columns and the ref log-probs
    only, so ``weight`` is dropped there. This wrapper puts it back (one value per pair, same order as the rows).
    """

    def __init__(self, inner, seed: int | None = None):
        self.inner = inner
        self.seed = seed

    def __call__(self, examples):
        out = self.inner(examples)
        if examples and "weight" in examples[0]:
            out["weight"] = torch.tensor([float(e["weight"]) for e in examples], dtype=torch.float32)
        if self.seed is not None and examples and "prompt_ids" in examples[0]:
            out["row_seeds"] = ([row_seed(self.seed, e["prompt_ids"] + e["chosen_ids"]) for e in examples]
                                + [row_seed(self.seed, e["prompt_ids"] + e["rejected_ids"]) for e in examples])
        return out


def weighted_dpo_loss(margin: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """Eq. 13 as a weighted mean over the pairs: sum_i w_i * -log sigmoid(m_i) / sum_i w_i.

    Weighting equals repetition: a pair of weight 2 counts like the pair twice. All weights 1
    (or none) give exactly the plain mean. A batch whose weights are all 0 gives loss 0 (and zero gradient).
    """
    nll = -F.logsigmoid(margin)
    if weight is None:
        return nll.mean()
    weight = weight.to(nll.device, nll.dtype)
    if bool((weight == 1).all()):          # bit-identical to the unweighted loss
        return nll.mean()
    return (nll * weight).sum() / weight.sum().clamp_min(torch.finfo(nll.dtype).tiny)

def _history(log_history: list[dict]) -> list[dict]:
    """Our training history (one record per logged step) from the Trainer's log history."""
    return [{"step": int(rec["step"]), "loss": float(rec["loss"]), "lr": float(rec.get("learning_rate", float("nan"))),
             **{k: float(v) for k, v in rec.items() if k.startswith("rewards/")}}
            for rec in log_history if "loss" in rec]


def _make_trainer_class():
    from trl import DPOTrainer

    class DropoutHeadDPOTrainer(DPOTrainer):
        """TRL's DPO trainer with dropout on the final hidden states before the LM head (eq. 13, sigmoid loss).

        Only ``compute_loss`` changes (plus the pair weight carried to it, and the gradients' average over several
        processes, which bypassing DDP's forward leaves to ``training_step``); TRL keeps the data pipeline, the
        reference pre-computation, the optimizer, scheduler, accumulation and logging.
        """

        # compute_loss divides by the whole optimizer step's weight itself (get_batch_samples), so the Trainer must
        # not divide by the number of micro-batches again.
        loss_is_scaled_for_ga = True

        def __init__(self, *args, dropout: float, logprob_chunk: int, show_progress: bool = True,
                     mask_seed: int = 0, **kwargs):
            self.head_dropout = dropout
            self.logprob_chunk = logprob_chunk
            self.mask_seed = mask_seed
            self._step_weight: torch.Tensor | None = None
            # With bars off, the reference pass (inside TRL's __init__) and training log a line every few minutes.
            config, data = kwargs["args"], kwargs["train_dataset"]
            batches = math.ceil(len(data) / (config.precompute_ref_batch_size or config.per_device_train_batch_size))
            self._reference_clock = (ProgressClock("mcd_dpo reference log-probs", batches, "batches")
                                     if not show_progress and is_main() else None)
            self._reference_batches = 0
            super().__init__(*args, **kwargs)
            if not show_progress and is_main():
                self.add_callback(_progress_log_callback_class()())
            # Wrapped only now: TRL's __init__ builds its collator (pad token checks, mirrored onto the model config)
            # and already ran the reference pre-computation with it, whose batches must not carry ``weight``
            # (``compute_ref_log_probs`` passes every non-mask key to the model). Training batches get it.
            self.data_collator = WeightCollator(self.data_collator, seed=mask_seed)

        # A PhaseCheckpoint while the run's training checkpoints are active (train.py), else None. The four methods
        # below are the Trainer's own checkpoint I/O; with save_strategy="no" they run only for the phase: a save the
        # PhaseCheckpoint asked for, or train(resume_from_checkpoint=PhaseCheckpoint.resume_dir(...)).
        phase_checkpoint = None

        def _save_checkpoint(self, model, trial):
            self.phase_checkpoint.save()   # instead of a checkpoint-<step> folder of pickled .pt files

        def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
            _load_params(self.accelerator.unwrap_model(self.model), self.phase_checkpoint.saved)

        def _load_optimizer_and_scheduler(self, checkpoint):
            if checkpoint is not None:
                training_checkpoint.load_optimizer_state(self.optimizer, self.phase_checkpoint.saved)
                training_checkpoint.load_scheduler_state(self.lr_scheduler, self.phase_checkpoint.saved)

        def _load_rng_state(self, checkpoint):
            # Called where the Trainer restores its own RNG file: after fetching the first batches of a resumed
            # epoch (whose iterator draws a base seed from torch's RNG), so the next step draws what it would have.
            if checkpoint is not None:
                training_checkpoint.restore_rng(self.phase_checkpoint.saved)

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            """The micro-batches of one optimizer step, and their total pair weight over every process: each
            micro-batch's loss is its share of the step's weighted mean (:meth:`compute_loss`), so a step's gradient
            is that of one batch whatever the micro-batch size and the number of processes."""
            samples, items = super().get_batch_samples(epoch_iterator, num_batches, device)
            total = sum(float(b["weight"].sum()) if "weight" in b else float(len(b["input_ids"]) // 2)
                        for b in samples)
            weight = torch.tensor(total, dtype=torch.float64, device=self.accelerator.device)
            self._step_weight = self.accelerator.reduce(weight, "sum") if self.accelerator.num_processes > 1 \
                else weight
            return samples, items

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            # Several processes (torchrun, accelerate launch, a multi-task Slurm job): the Trainer wraps the model in
            # DDP, but compute_loss calls the unwrapped body and LM head (so no (B, L, V) logits exist), so DDP's
            # forward never runs, its reducer is never armed and each rank would keep the gradient of its own batch
            # only: the ranks' weights would drift apart. The gradients are averaged here instead, once per optimizer
            # step: the Trainer sets sync_gradients before the step's last micro-batch and clips and steps right
            # after this returns. The accumulated gradient is linear in the micro-batches, so one reduction of the
            # sum equals DDP's reduction of each. FSDP and DeepSpeed reduce in hooks of their own (which run without
            # the root forward) and hold sharded or partitioned gradients: left to them.
            if (self.accelerator.sync_gradients and self.accelerator.num_processes > 1
                    and not self.is_fsdp_enabled and not self.is_deepspeed_enabled):
                average_gradients([p for p in model.parameters() if p.requires_grad])
            return loss

        def compute_ref_log_probs(self, model, inputs):
            """The reference's summed completion log-probs of one batch, ``(chosen, rejected)``: the policy's own
            forward (:meth:`_completion_logps`) without dropout and without gradients."""
            from trl.models.utils import disable_gradient_checkpointing

            with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                logps = self._completion_logps(model, inputs, dropout=0.0, training=False).chunk(2)
            self._reference_batches += 1
            if self._reference_clock is not None:
                self._reference_clock.update(self._reference_batches)
            return logps

        def _completion_logps(self, model, inputs, dropout: float, training: bool) -> torch.Tensor:
            """Summed completion log-probs (2B,) of a [chosen; rejected] batch: the body's final hidden states, then
            the LM head (with the head dropout when ``training``) on the completion positions only. A row's masks
            are draws of its own generator, seeded by the row and the optimizer step (:func:`step_seed`)."""
            lm = self.accelerator.unwrap_model(model)
            body = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
            # Accelerate applies mixed precision by wrapping ``model.forward``; the body and the LM head are called
            # directly here, so the bf16 autocast is entered explicitly (a no-op without mixed precision).
            ids, attention = inputs["input_ids"], inputs["attention_mask"]
            with self.accelerator.autocast():
                if self.is_fsdp_enabled or self.is_deepspeed_enabled:  # sharded: one forward, as they expect
                    hidden = body(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state
                else:  # chosen and rejected (and pairs asking the same) share their prompt: run once
                    prompt_lengths = inputs["completion_mask"].argmax(1).tolist()
                    hidden = shared_prefix_hidden(body, ids, attention, prompt_lengths)
                generators = None
                if training and dropout > 0 and "row_seeds" in inputs:
                    step = self.state.global_step
                    generators = row_generators([step_seed(r, step) for r in inputs["row_seeds"]], ids.device)
                return completion_logps(hidden, lm.lm_head, inputs["input_ids"], inputs["completion_mask"],
                                        self.logprob_chunk, dropout, training=training, generators=generators)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            logps = self._completion_logps(model, inputs, self.head_dropout, training=model.training)
            chosen, rejected = logps.chunk(2)          # the collator stacks [chosen; rejected]
            ref_c, ref_r = inputs["ref_chosen_logps"].float(), inputs["ref_rejected_logps"].float()
            margin = self.beta * ((chosen - ref_c) - (rejected - ref_r))
            if model.training and self._step_weight is not None:
                # eq. 13 as the weighted mean over the whole optimizer step (every micro-batch of every process):
                # this micro-batch's weighted sum over the step's total weight, times the number of processes,
                # whose gradients are averaged. Summed over the micro-batches it is the one-batch loss.
                weight = inputs.get("weight")
                nll = -torch.nn.functional.logsigmoid(margin)
                weighted = (nll * weight.to(nll.device, nll.dtype)).sum() if weight is not None else nll.sum()
                loss = weighted * self.accelerator.num_processes / self._step_weight.to(nll.dtype).clamp_min(
                    torch.finfo(nll.dtype).tiny)
            else:
                loss = weighted_dpo_loss(margin, inputs.get("weight"))
            mode = "train" if model.training else "eval"
            # Over all processes' micro-batches (as TRL logs its own metrics): the logged values are the global
            # batch's, not rank 0's share. Sums and a count, a fixed shape whatever the batch sizes of the ranks.
            m = margin.detach().float()
            total = self.accelerator.reduce(torch.stack([m.sum(), (m > 0).float().sum(), m.new_tensor(len(m))]), "sum")
            self._metrics[mode]["rewards/margins"].append((total[0] / total[2]).item())
            self._metrics[mode]["rewards/accuracies"].append((total[1] / total[2]).item())
            return (loss, {"logps": logps}) if return_outputs else loss

    return DropoutHeadDPOTrainer


def _checkpointing_key(config_class) -> str:
    """The training-arguments field that turns activation checkpointing on: transformers 5.24 renamed
    ``gradient_checkpointing`` to ``activation_checkpointing`` (the old name warns and goes in v6)."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
