"""MCD-DPO (RewardUQ section 4.3, eq. 13): a DPO-trained policy whose implicit reward gets MC-dropout uncertainty.

The whole causal LM is fine-tuned with the DPO loss (eq. 13) against the frozen base checkpoint as reference. A
dropout layer of rate ``p`` sits on the final hidden states (after the final norm) right before the LM head; it is
on in training (one i.i.d. mask per element, as usual) and is kept on at inference, where ``K = num_samples`` masks
give K implicit rewards

    r_k(x, y) = dpo_beta * (sum_t log p_policy,k(y_t | x, y_<t) - sum_t log p_ref(y_t | x, y_<t))

summed over the completion tokens, the chat template's tokens of the assistant turn included (as the authors do).
reward = mean_k r_k, u = unbiased std_k r_k, bounds reward ± beta * u (paper eq. 9, beta 2).

The DPO loss is the pair-weighted mean of eq. 13 over a micro-batch (weight = repetition); the
frame's ``weight`` column reaches ``compute_loss`` through :class:`WeightCollator`. A bf16 backbone (a GPU, or CPU with
``model.keep_dtype_on_cpu=true``) trains and scores under bf16 autocast with fp32 weights (policy and reference).
Gradients are clipped to a total norm of ``max_grad_norm`` (1.0, the HF Trainer default the authors trained with, so
Table 1's values hold with it; null = off), passed to TRL's config explicitly.

Performance:
- training goes through TRL's ``DPOTrainer`` with ``precompute_ref_log_probs=True``: the reference log-probs are
  computed once per pair before training, never per step, per epoch or per MC sample, and no reference copy stays in
  memory while training. That pass is ours (``compute_ref_log_probs``): the body and the chunked LM head of training,
  without dropout. ``compute_loss`` is overridden (dropout before the LM head, chunked log-softmax); see "Several
  processes" for ``training_step``.
- every body forward (reference pass, training, scoring) runs each distinct prompt of a batch once: chosen and
  rejected share theirs, and so do pairs that ask the same (``rewarduq_exp.models.shared_prefix``; exact, gradients
  included; not under FSDP or DeepSpeed, which expect one forward per step).
- scoring runs the transformer body once per batch; only dropout + LM head + log-softmax are repeated K times, over
  chunks of completion positions, so no (K, B, L, V) logits tensor ever exists. The reference model (no dropout) is
  run once per batch.

Several processes (torchrun, ``accelerate launch``, a multi-task Slurm job): data parallel, each process on its own
micro-batches. The Trainer wraps the policy in DDP, but ``compute_loss`` calls the body and the LM head directly (the
wrapper's forward would compute the full-vocabulary logits), so DDP never reduces anything; the trainer averages the
gradients over the processes itself, once per optimizer step before clipping (``training_step``): the processes train
as one process does on the same global batches (but for the dropout masks, which each process draws for its own
rows). Under FSDP the sharded model reduces its own gradients.

Checkpoints: inside a run (``train.py``) the training is one phase of the run's training checkpoints
(:mod:`rewarduq_exp.core.training_checkpoint`), like every loop that :func:`~rewarduq_exp.methods.base.run_training`
drives. At the end of an optimizer step that is due (or after a stop signal) the Trainer first logs the step, then its
``_save_checkpoint`` writes the phase file: trainable weights, AdamW state, scheduler, the Trainer's state (step,
epoch, log history) and its running log sums, every RNG state; safetensors + JSON, no pickle. The data order needs no
state of its own: accelerate's seedable sampler draws epoch ``e``'s order from ``data_seed + e``. A resumed run lets
the Trainer resume from a folder that holds only ``trainer_state.json`` (so it skips the batches already trained, as
it does for its own checkpoints) and takes the weights, optimizer, scheduler and RNG from the phase file where the
Trainer would read its ``.pt`` files; the RNG is restored at the very point the Trainer restores its own, so the
remaining steps draw the same dropout masks. A finished phase keeps the trained weights and history: a run launched
again after training skips tokenisation, the reference pass and training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rewarduq_exp.core import job_signals, training_checkpoint
from rewarduq_exp.core.atomic_write import atomic_path
from rewarduq_exp.core.checks import check_max_grad_norm, check_positive
from rewarduq_exp.core.distributed import is_main, max_across, rank, world_size
from rewarduq_exp.core.errors import UserError, one_line
from rewarduq_exp.core.progress import ProgressClock, progress
from rewarduq_exp.core.saved_files import check_safetensors
from rewarduq_exp.methods.base import (
    RewardMethod,
    Scores,
    TrainingSchedule,
    read_method_info,
    write_method_info,
)
from rewarduq_exp.models.backbone import resolve_device
from rewarduq_exp.models.shared_prefix import batch_order, shared_prefix_hidden

log = logging.getLogger("rewarduq_exp")

WEIGHTS_FILE = "policy.safetensors"


# ---------------------------------------------------------------------------------------------------- tokenisation
def _messages(value) -> list[dict]:
    """Plain list of {role, content} dicts (parquet round trips give numpy arrays of dicts)."""
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in list(value)]


def _template_ids(tokenizer, messages, **kw) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
    return list(out["input_ids"] if isinstance(out, dict) else out)


def tokenize_completion(tokenizer, prompt, completion) -> tuple[list[int], int]:
    """(ids of prompt + completion, index of the first completion token).

    The same split as TRL's DPO tokenisation (which training uses): the prompt is rendered with the generation prompt
    and the completion starts where that and the full conversation diverge, so the completion holds everything the
    template adds for the assistant turn (e.g. Qwen3's empty think block and the closing ``<|im_end|>\\n``).
    """
    prompt_ids = _template_ids(tokenizer, prompt, add_generation_prompt=True)
    full = _template_ids(tokenizer, list(prompt) + list(completion))
    start = 0
    for a, b in zip(prompt_ids, full):
        if a != b:
            break
        start += 1
    if start >= len(full):
        raise UserError("a completion renders to no tokens after its prompt; check the data's assistant turns")
    return full, max(start, 1)  # the first token has no prediction; a completion never starts at position 0


# ---------------------------------------------------------------------------------------------------- log-probs
def _target_positions(completion_mask: torch.Tensor):
    """Rows/positions whose hidden state predicts a completion token: h[:, t] predicts input_ids[:, t + 1]."""
    shifted = completion_mask[:, 1:].bool()
    rows, cols = shifted.nonzero(as_tuple=True)
    return rows, cols


def _token_logps(h: torch.Tensor, lm_head, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) for hidden states ``h`` (..., H) and ``targets`` (...); logits only for this chunk."""
    logits = lm_head(h).float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def completion_logps(hidden: torch.Tensor, lm_head, input_ids: torch.Tensor, completion_mask: torch.Tensor,
                     chunk: int, dropout: float = 0.0, training: bool = False) -> torch.Tensor:
    """Summed completion log-probs (B,) from final hidden states (B, L, H), in chunks of ``chunk`` positions.

    With ``training`` the chunk's dropout + LM head are re-run in the backward pass (activation checkpointing), so
    training also never keeps more than one chunk's logits.
    """
    rows, cols = _target_positions(completion_mask)
    h = hidden[rows, cols]                       # (N, H): only positions that predict a completion token
    targets = input_ids[rows, cols + 1]
    out = hidden.new_zeros(hidden.shape[0], dtype=torch.float32)

    def piece(hc, tc, keep):
        return _token_logps(hc if keep is None else hc * keep, lm_head, tc)

    for s in range(0, len(h), chunk):
        hc, tc = h[s:s + chunk], targets[s:s + chunk]
        # The mask is drawn outside the checkpointed function, so the backward recomputation reuses the very same
        # mask without torch's RNG-state preservation (which costs ~10x the chunk's work on CPU).
        keep = None
        if dropout > 0 and training:
            keep = (torch.rand_like(hc) >= dropout).to(hc.dtype) / (1.0 - dropout)
        if training and torch.is_grad_enabled() and hc.is_cuda:  # CPU: checkpoint costs ~10x here, memory is no issue
            lp = checkpoint(piece, hc, tc, keep, use_reentrant=False, preserve_rng_state=False)
        else:
            lp = piece(hc, tc, keep)
        out = out.index_add(0, rows[s:s + chunk], lp)
    return out


def draw_masks(generator: torch.Generator, n_tokens: int, num_samples: int, hidden_size: int, p: float,
               device, dtype) -> torch.Tensor:
    """Scaled keep-masks (num_samples, n_tokens, H), drawn token-major.

    Token-major order means the masks of consecutive tokens are consecutive draws of the generator, so on CPU the
    masks do not depend on how the positions are chunked (the test compares chunked with one-shot computation).
    """
    keep = torch.rand((n_tokens, num_samples, hidden_size), generator=generator, device=device) >= p
    return (keep.to(dtype) / (1.0 - p)).transpose(0, 1)


def row_seed(seed: int, token_ids) -> int:
    """The dropout-mask seed of one scored sequence: the method's seed and a hash of the sequence's token ids.

    Seeding per sequence (not once per call) makes a completion's MC-dropout score a function of that completion
    alone: the same under any batch, order or company of other texts (an RL loop scores each sample once, in
    whatever batch the trainer forms)."""
    digest = hashlib.blake2b(np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=8,
                             key=int(seed).to_bytes(8, "little", signed=True)).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def row_generators(seeds, device) -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


@torch.no_grad()
def mc_completion_logps(hidden: torch.Tensor, lm_head, input_ids: torch.Tensor, completion_mask: torch.Tensor,
                        num_samples: int, p: float, generators: list[torch.Generator], chunk: int) -> torch.Tensor:
    """(K, B) summed completion log-probs under K dropout masks on the final hidden states.

    ``hidden`` comes from ONE forward of the transformer body. Per chunk of ``chunk`` completion positions the K
    masked copies go through the LM head at once: (K, chunk, V) logits at most, never (K, B, L, V). Row b's masks are
    consecutive draws of ``generators[b]`` (see :func:`row_seed`), so they do not depend on the chunking nor on the
    other rows of the batch.
    """
    if len(generators) != hidden.shape[0]:
        raise ValueError(f"{len(generators)} generators for {hidden.shape[0]} rows")
    rows, cols = _target_positions(completion_mask)
    h = hidden[rows, cols]
    targets = input_ids[rows, cols + 1]
    out = torch.zeros(num_samples, hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for s in range(0, len(h), chunk):
        hc, tc, rc = h[s:s + chunk], targets[s:s + chunk], rows[s:s + chunk]
        # Positions come row-major (nonzero), so a chunk holds a few runs of rows; each run draws from its row's
        # generator. The loop is over the rows of a chunk, the K masks of a run are one draw.
        row_ids, counts = torch.unique_consecutive(rc, return_counts=True)
        masks = torch.cat([draw_masks(generators[int(r)], int(c), num_samples, hidden.shape[-1], p, hidden.device,
                                      hidden.dtype) for r, c in zip(row_ids.tolist(), counts.tolist())], dim=1)
        lp = _token_logps(hc.unsqueeze(0) * masks, lm_head, tc.unsqueeze(0).expand(num_samples, -1))  # (K, c)
        out.index_add_(1, rc, lp)
    return out


# ---------------------------------------------------------------------------------------------------- loading
def load_causal_lm(backbone, dtype=None):
    """The backbone checkpoint as a causal LM, refusing a sequence classifier whose LM head would be random.

    Skywork reward models are ``Qwen3ForSequenceClassification`` checkpoints: they hold the transformer body and a
    score head, no LM head. With ``tie_word_embeddings`` the LM head is the input embedding matrix (what the Qwen3
    0.6B-4B bases do); without it, ``from_pretrained`` would silently initialise a random LM head (the reference
    code's bug, notes 9.3), so that case is an error.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    backbone.require_decoder("mcd_dpo")
    config = backbone.from_pretrained(AutoConfig, "config")
    classifier = any("ForSequenceClassification" in a for a in (getattr(config, "architectures", None) or []))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if classifier and not tied:
        raise UserError(f"model '{backbone.name}' is a sequence-classifier checkpoint without tied word embeddings: "
                        "it has no LM head and cannot be used with method=mcd_dpo (use a causal LM or a checkpoint "
                        "with tie_word_embeddings=true)")
    model, info = backbone.from_pretrained(AutoModelForCausalLM, dtype=dtype or backbone.dtype,
                                           output_loading_info=True)
    missing = set(info.get("missing_keys", ()))
    head_is_embedding = model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    if classifier and not head_is_embedding:
        model.lm_head.weight = model.get_input_embeddings().weight
        head_is_embedding = True
    if "lm_head.weight" in missing and not head_is_embedding:
        raise UserError(f"model '{backbone.name}' has no LM head weights (lm_head.weight missing) and untied "
                        "embeddings: it cannot be used with method=mcd_dpo")
    return model


def full_weights(model) -> dict[str, torch.Tensor]:
    """The whole weights of an FSDP-sharded model as CPU tensors, on every process (a collective call).

    ``full_state_dict`` all-gathers every DTensor; without ``cpu_offload`` every process (not only rank 0) receives
    the result, briefly as one whole copy of the weights on the device, before it moves to the CPU.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {k: v.detach().to("cpu") for k, v in state.items()}


# ---------------------------------------------------------------------------------------------------- trainer
class WeightCollator:
    """TRL's preference collator plus a float32 ``weight`` (B,) taken from the examples' ``weight`` column.

    TRL 1.16 keeps every dataset column through its tokenisation ``map`` (``DPOTrainer._prepare_dataset`` only adds
    ``prompt_ids``/``chosen_ids``/``rejected_ids``) and through the reference pre-computation (it concatenates the
    ``ref_*_logps`` columns, axis=1), and with ``remove_unused_columns=False`` the Trainer hands whole rows to the
    collator; but ``DataCollatorForPreference.torch_call`` builds its output from the id columns and the ref log-probs
    only, so ``weight`` is dropped there. This wrapper puts it back (one value per pair, same order as the rows).
    """

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, examples):
        out = self.inner(examples)
        if examples and "weight" in examples[0]:
            out["weight"] = torch.tensor([float(e["weight"]) for e in examples], dtype=torch.float32)
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


def _param_tensors(model) -> dict[str, torch.Tensor]:
    """The model's parameters by name (a tied LM head appears once, as the input embedding it shares)."""
    return {f"param.{name}": p.detach() for name, p in model.named_parameters()}


@torch.no_grad()
def _load_params(model, state: training_checkpoint.TrainingState) -> None:
    params = dict(model.named_parameters())
    saved = {k.removeprefix("param."): v for k, v in state.tensors.items() if k.startswith("param.")}
    if saved.keys() != params.keys():
        odd = sorted(saved.keys() ^ params.keys())[:3]
        raise UserError(one_line(f"the MCD-DPO training checkpoint does not match this model (parameters {odd} are "
                                 "in one of them only); delete the run's checkpoint folder to train from step 0"))
    for name, p in params.items():
        p.copy_(saved[name])


def _history(log_history: list[dict]) -> list[dict]:
    """Our training history (one record per logged step) from the Trainer's log history."""
    return [{"step": int(rec["step"]), "loss": float(rec["loss"]), "lr": float(rec.get("learning_rate", float("nan"))),
             **{k: float(v) for k, v in rec.items() if k.startswith("rewards/")}}
            for rec in log_history if "loss" in rec]


@functools.cache
def _phase_checkpoint_class():
    from transformers import TrainerCallback

    class PhaseCheckpoint(TrainerCallback):
        """The run's checkpoint phase inside the Trainer's loop (module docstring, "Checkpoints").

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


def _make_trainer_class():
    from trl import DPOTrainer

    class DropoutHeadDPOTrainer(DPOTrainer):
        """TRL's DPO trainer with dropout on the final hidden states before the LM head (eq. 13, sigmoid loss).

        Only ``compute_loss`` changes (plus the pair weight carried to it, and the gradients' average over several
        processes, which bypassing DDP's forward leaves to ``training_step``); TRL keeps the data pipeline, the
        reference pre-computation, the optimizer, scheduler, accumulation and logging.
        """

        def __init__(self, *args, dropout: float, logprob_chunk: int, show_progress: bool = True, **kwargs):
            self.head_dropout = dropout
            self.logprob_chunk = logprob_chunk
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
            self.data_collator = WeightCollator(self.data_collator)

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
            the LM head (with the head dropout when ``training``) on the completion positions only."""
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
                return completion_logps(hidden, lm.lm_head, inputs["input_ids"], inputs["completion_mask"],
                                        self.logprob_chunk, dropout, training=training)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            logps = self._completion_logps(model, inputs, self.head_dropout, training=model.training)
            chosen, rejected = logps.chunk(2)          # the collator stacks [chosen; rejected]
            ref_c, ref_r = inputs["ref_chosen_logps"].float(), inputs["ref_rejected_logps"].float()
            margin = self.beta * ((chosen - ref_c) - (rejected - ref_r))
            # eq. 13, weighted mean over THIS micro-batch's pairs. With gradient accumulation the Trainer divides each
            # micro-batch loss by the number of accumulation steps (TRL sets model_accepts_loss_kwargs=False), so an
            # optimizer step follows the plain mean of the micro-batches' weighted means, not one weighted mean over
            # the whole effective batch; with micro_batch_size == batch_size the two coincide.
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


# ---------------------------------------------------------------------------------------------------- method
def _checkpointing_key(config_class) -> str:
    """The training-arguments field that turns activation checkpointing on: transformers 5.24 renamed
    ``gradient_checkpointing`` to ``activation_checkpointing`` (the old name warns and goes in v6)."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


class McdDpo(RewardMethod):
    """MCD-DPO: DPO full fine-tune + MC dropout on the final hidden states (RewardUQ eq. 13)."""

    name = "mcd_dpo"
    fine_tunes_backbone = True  # the whole causal LM, with DPO

    def __init__(self, encoder=None, learning_rate: float = 1e-6, dpo_beta: float = 0.1, dropout: float = 0.1,
                 num_samples: int = 20, beta: float = 2.0, batch_size: int = 64, micro_batch_size: int = 8,
                 num_epochs: float = 1.0, warmup_ratio: float = 0.05, weight_decay: float = 0.0,
                 seed: int = 0, device: str = "auto", show_progress: bool = True, score_batch_size: int = 8,
                 logprob_chunk: int = 64, gradient_checkpointing: bool | str = "auto", log_every: int = 1,
                 max_grad_norm: float | None = 1.0):
        if not (isinstance(dropout, (int, float)) and 0 <= dropout < 1):
            raise UserError(f"method.dropout={dropout} is invalid: must be in [0, 1)")
        check_positive(num_samples, "method.num_samples", integer=True, minimum=2, inclusive=True)
        check_positive(dpo_beta, "method.dpo_beta")
        check_positive(beta, "method.beta", inclusive=True)
        check_positive(micro_batch_size, "method.micro_batch_size", integer=True, minimum=1, inclusive=True)
        check_positive(score_batch_size, "method.score_batch_size", integer=True, minimum=1, inclusive=True)
        check_positive(logprob_chunk, "method.logprob_chunk", integer=True, minimum=1, inclusive=True)
        checkpointing = {"auto": "auto", "true": True, "false": False}.get(str(gradient_checkpointing).lower())
        if checkpointing is None:
            raise UserError(f"method.gradient_checkpointing={gradient_checkpointing} is invalid; allowed: auto, true, "
                            "false")
        # None (no clipping) or a number > 0; it reaches DPOConfig explicitly (see _make_trainer)
        max_grad_norm = check_max_grad_norm(max_grad_norm, "method.max_grad_norm")
        self.schedule = TrainingSchedule(learning_rate=float(learning_rate), batch_size=int(batch_size),
                                         num_epochs=float(num_epochs), warmup_ratio=float(warmup_ratio),
                                         weight_decay=float(weight_decay), max_grad_norm=max_grad_norm)
        self.schedule.validate()
        if int(batch_size) % int(micro_batch_size) and int(batch_size) > int(micro_batch_size):
            raise UserError(f"method.batch_size={batch_size} must be a multiple of method.micro_batch_size="
                            f"{micro_batch_size} (gradient accumulation)")
        self.encoder = encoder
        self.dpo_beta = float(dpo_beta)
        self.dropout = float(dropout)
        self.num_samples = int(num_samples)
        self.beta = float(beta)
        self.micro_batch_size = min(int(micro_batch_size), int(batch_size))
        self.seed = int(seed)
        self.device = resolve_device(device)
        self.show_progress = show_progress and not os.environ.get("TQDM_DISABLE")
        self.score_batch_size = int(score_batch_size)
        self.logprob_chunk = int(logprob_chunk)
        self.gradient_checkpointing = checkpointing   # "auto" (GPU only), True or False
        self.log_every = int(log_every)
        self.history: list[dict] = []
        self.fit_summary: dict = {}
        self.policy = None
        self.reference = None
        self.stats = {"reference_pairs_precomputed": 0}
        self._shared_dir: str | None = None  # torchrun: the ranks' common datasets cache (see _shared_dataset)

    def hyperparameters(self) -> dict:
        s = self.schedule
        return {"learning_rate": s.learning_rate, "dpo_beta": self.dpo_beta, "dropout": self.dropout,
                "num_samples": self.num_samples, "beta": self.beta, "batch_size": s.batch_size,
                "micro_batch_size": self.micro_batch_size, "num_epochs": s.num_epochs,
                "warmup_ratio": s.warmup_ratio, "weight_decay": s.weight_decay, "max_grad_norm": s.max_grad_norm,
                "seed": self.seed}

    # ------------------------------------------------------------------ models
    @property
    def backbone(self):
        if self.encoder is None:
            raise RuntimeError("McdDpo needs .encoder (a FeatureEncoder, or anything with a .backbone)")
        return self.encoder.backbone

    @property
    def tokenizer(self):
        return self.backbone.tokenizer

    def _train_dtype(self):
        # Trained weights stay fp32 (AdamW on bf16 weights loses small updates); a bf16 backbone autocasts to bf16.
        return torch.float32

    def _bf16(self) -> bool:
        """bf16 autocast in training and scoring: the backbone's dtype is bf16 (on a GPU, or on CPU with
        ``model.keep_dtype_on_cpu=true``, which makes this path testable without a GPU)."""
        return self.backbone.dtype == torch.bfloat16

    def _ensure_policy(self):
        if self.policy is None:
            self.policy = load_causal_lm(self.backbone, dtype=self._train_dtype()).to(self.device).eval()
        return self.policy

    def _ensure_reference(self):
        if self.reference is None:
            # Same weight dtype as the policy, under the same autocast: the reference then gives the very numbers TRL
            # pre-computed for training (policy weights before training, ``accelerator.autocast()``), and an untrained
            # policy has implicit reward 0. Loading it in bf16 instead would give a bf16 residual stream and a
            # per-sequence offset between policy and reference log-probs that is pure rounding.
            ref = load_causal_lm(self.backbone, dtype=self._train_dtype())
            ref.requires_grad_(False)
            self.reference = ref.to(self.device).eval()
        return self.reference

    # ------------------------------------------------------------------ training
    def _dataset(self, frame: pd.DataFrame):
        from datasets import Dataset

        weight = frame["weight"].to_numpy(dtype=float) if "weight" in frame else np.ones(len(frame))
        return Dataset.from_dict({
            "prompt": [_messages(p) for p in frame["prompt"]],
            "chosen": [_messages(c) for c in frame["chosen"]],
            "rejected": [_messages(r) for r in frame["rejected"]],
            "weight": [float(w) for w in weight],   # pair weight -> WeightCollator -> weighted eq. 13
        })

    def _shared_dataset(self, dataset):
        """The training set as an arrow file in one directory that all ranks of a torchrun / accelerate run read.

        TRL maps the dataset (tokenisation) and writes the pre-computed reference log-probs to a cache file next to
        the dataset's own files, on the main process only, and the other ranks then open that file. An in-memory
        ``Dataset`` has no files, so each process would put its cache in a private temp dir and rank 1 fails with
        ``FileNotFoundError`` on rank 0's file. Saving the data once under the (shared) cache dir gives every cache
        file one path that all ranks see. Rank 0 picks a fresh directory and broadcasts its name: nothing is reused
        between runs; :meth:`_fit` deletes it after training. Multi-node runs need ``paths.cache_dir`` on a shared
        file system (TRL needs the same for its own cache files).
        """
        from accelerate import PartialState
        from accelerate.utils import broadcast_object_list
        from datasets import load_from_disk

        state = PartialState()  # already set up (torch.distributed initialised) by DPOConfig
        path = [None]
        if state.is_main_process:
            root = Path(self.backbone.cache_dir) / "mcd_dpo_datasets"
            root.mkdir(parents=True, exist_ok=True)
            path = [tempfile.mkdtemp(prefix="run-", dir=root)]
            dataset.save_to_disk(path[0])
        broadcast_object_list(path, from_process=0)  # also a barrier: the files are complete when the name arrives
        self._shared_dir = path[0]
        return load_from_disk(path[0])

    def _make_trainer(self, train: pd.DataFrame, output_dir: str):
        from trl import DPOConfig

        model = self._ensure_policy()
        s = self.schedule
        cuda = self.device.type == "cuda"
        # method.batch_size is the global batch: under torchrun each of the N ranks takes micro-batches, so the
        # accumulation steps are divided by N (one process: unchanged).
        accumulation = max(1, s.batch_size // (self.micro_batch_size * world_size()))
        # transformers 5 has no warmup_ratio: the same fraction of the optimizer steps, computed here.
        batches_per_epoch = math.ceil(len(train) / (self.micro_batch_size * world_size()))
        total_steps = max(1, math.ceil(batches_per_epoch / accumulation * s.num_epochs))
        args = DPOConfig(
            output_dir=output_dir, learning_rate=s.learning_rate, beta=self.dpo_beta, loss_type=["sigmoid"],
            per_device_train_batch_size=self.micro_batch_size, gradient_accumulation_steps=accumulation,
            num_train_epochs=s.num_epochs, lr_scheduler_type="cosine", warmup_steps=round(s.warmup_ratio * total_steps),
            # The fused AdamW kernel, the Trainer's default the authors trained with (torch >= 2.8): the same update,
            # and on CPU 0.04 s instead of 0.30 s a step for 135M parameters (foreach), measured on 2 cores.
            weight_decay=s.weight_decay, optim="adamw_torch_fused", adam_beta1=s.adam_betas[0],
            adam_beta2=s.adam_betas[1],
            adam_epsilon=s.adam_eps, seed=self.seed, data_seed=self.seed,
            # Explicit, not the Trainer's default by accident: Table 1's eq. 13 values were tuned with the HF Trainer
            # clipping at 1.0; transformers 5 clips only when max_grad_norm > 0, so null (no clipping) -> 0.0.
            max_grad_norm=s.max_grad_norm if s.max_grad_norm is not None else 0.0,
            precompute_ref_log_probs=True, precompute_ref_batch_size=self.score_batch_size,
            max_length=None,                        # the run already drops over-long pairs (never truncate)
            disable_dropout=True,                   # Qwen3's own dropouts off; our head dropout is separate
            # bf16=True -> accelerate's bf16 autocast (CPU autocast under use_cpu=True; transformers 5.23 accepts it)
            bf16=self._bf16(), use_cpu=not cuda,
            # auto: on a GPU only (activation memory); on CPU it only costs time unless asked for explicitly
            **{_checkpointing_key(DPOConfig): cuda if self.gradient_checkpointing == "auto"
               else self.gradient_checkpointing},
            logging_steps=self.log_every, save_strategy="no", report_to=[], disable_tqdm=not self.show_progress,
            remove_unused_columns=False, dataloader_num_workers=0,
        )
        dataset = self._dataset(train)
        if world_size() > 1:
            dataset = self._shared_dataset(dataset)
        Trainer = _make_trainer_class()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*gradient_checkpointing.* is deprecated",
                                    category=FutureWarning)
            trainer = Trainer(model=model, ref_model=None, args=args, train_dataset=dataset,
                              processing_class=self.tokenizer, dropout=self.dropout, logprob_chunk=self.logprob_chunk,
                              show_progress=self.show_progress)
        if not self.show_progress:
            from transformers.trainer_callback import PrinterCallback, ProgressCallback

            trainer.remove_callback(PrinterCallback)  # per-step log dicts on stdout
            trainer.remove_callback(ProgressCallback)
        return trainer

    def fit(self, train: pd.DataFrame, eval: pd.DataFrame | None = None) -> McdDpo:  # noqa: A002
        t0 = time.perf_counter()
        quiet = not self.show_progress and not os.environ.get("TQDM_DISABLE")
        if quiet:  # TRL's reference pre-computation bar only listens to this variable
            os.environ["TQDM_DISABLE"] = "1"
        try:
            self._fit(train, eval, t0)
            return self
        finally:
            if quiet:
                os.environ.pop("TQDM_DISABLE", None)

    def _optimizer_steps(self, n_pairs: int) -> int:
        """The Trainer's number of optimizer steps (its ``max_steps``) for ``n_pairs`` pairs, known before the
        trainer and its reference pass are built: a finished checkpoint phase is matched by it and skips both."""
        per_batch = self.micro_batch_size * world_size()
        accumulation = max(1, self.schedule.batch_size // per_batch)
        steps_per_epoch = max(1, math.ceil(math.ceil(n_pairs / per_batch) / accumulation))
        return math.ceil(self.schedule.num_epochs * steps_per_epoch)

    def _fit(self, train: pd.DataFrame, eval: pd.DataFrame | None, t0: float) -> dict:
        checkpoints = training_checkpoint.active()
        phase = checkpoints.phase(self.name) if checkpoints is not None else None
        total = self._optimizer_steps(len(train))
        saved = phase.load(total) if phase is not None else None
        if saved is not None and saved.done:
            return self._take_finished(saved, phase, len(train))
        with tempfile.TemporaryDirectory(prefix="mcd_dpo-") as tmp:
            trainer = self._make_trainer(train, tmp)
            t_ref = time.perf_counter() - t0        # includes tokenisation and the one reference pass
            self.stats["reference_pairs_precomputed"] += len(trainer.train_dataset)
            if phase is not None and trainer.is_fsdp_enabled:
                log.warning("%s: no training checkpoint under FSDP (the sharded optimizer state is not saved); a "
                            "stopped run trains again from step 0", self.name)
                phase = saved = None
            resume = None
            if phase is not None:
                trainer.phase_checkpoint = _phase_checkpoint_class()(trainer, phase, total, saved)
                trainer.add_callback(trainer.phase_checkpoint)
                resume = trainer.phase_checkpoint.resume_dir(tmp)
                if saved is not None:
                    log.info("%s: resumed at step %d of %d (%s)", self.name, saved.step, total, phase.path)
            t1 = time.perf_counter()
            # Signals wait for a step boundary only where a stop can be saved (train.py); elsewhere they act at once.
            with job_signals.training_loop() if phase is not None else contextlib.nullcontext():
                try:
                    with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), \
                            warnings.catch_warnings():
                        warnings.filterwarnings("ignore", message=".*is deprecated", category=FutureWarning)
                        torch.manual_seed(self.seed + rank())  # ranks draw different dropout masks (rank 0: as before)
                        result = trainer.train(resume_from_checkpoint=resume)
                except job_signals.TrainingInterrupted:
                    self._drop_shared_dir(trainer)   # every rank stopped at the same step: none reads the files now
                    raise
                self._drop_shared_dir(trainer)
                self.history.extend(_history(trainer.state.log_history))
                self.policy = self._trained_policy(trainer)
                self.policy.requires_grad_(False)
                self.policy.eval()
                if phase is not None:
                    # The RNG as it is after training (outside fork_rng), which a finished phase puts back.
                    phase.save({**_param_tensors(self.policy), **training_checkpoint.rng_tensors()},
                               {"step": total, "total": total, "done": True, "history": list(self.history),
                                **training_checkpoint.rng_meta()})
            del trainer
        if phase is not None and (stop := job_signals.stop_requested()):
            # signalled during the last step: leave with the result saved
            raise job_signals.TrainingInterrupted(stop, f"after the last step of {self.name}")
        self.fit_summary = {"train_pairs": len(train), "optimizer_steps": int(result.global_step),
                            "seconds_reference_and_tokenize": round(t_ref, 2),
                            "seconds_training": round(time.perf_counter() - t1, 2),
                            "final_train_loss": self.history[-1]["loss"] if self.history else float("nan")}
        # ``eval`` is not scored here: the run scores every eval set right after fit, and MC scoring is not free.
        return self.fit_summary

    def _take_finished(self, saved, phase, n_pairs: int) -> dict:
        """A finished checkpoint phase as the result of fit: its trained weights, history and final RNG states."""
        log.info("%s: already trained (%s); not training again", self.name, phase.path)
        policy = self._ensure_policy()
        _load_params(policy, saved)
        policy.requires_grad_(False)
        policy.eval()
        training_checkpoint.restore_rng(saved)
        self.history.extend(saved.meta["history"])
        self.fit_summary = {"train_pairs": n_pairs, "optimizer_steps": saved.step,
                            "seconds_reference_and_tokenize": 0.0, "seconds_training": 0.0,   # neither ran again
                            "final_train_loss": self.history[-1]["loss"] if self.history else float("nan")}
        return self.fit_summary

    def _drop_shared_dir(self, trainer) -> None:
        """Delete the torchrun ranks' shared datasets folder (see :meth:`_shared_dataset`) once no rank reads it."""
        if self._shared_dir is None:
            return
        trainer.accelerator.wait_for_everyone()  # no rank still reads the shared arrow files
        if trainer.accelerator.is_main_process:
            shutil.rmtree(self._shared_dir, ignore_errors=True)
        self._shared_dir = None

    def _trained_policy(self, trainer):
        """The trained causal LM with whole weights on this process.

        Under FSDP (``accelerate launch --config_file slurm/accelerate/fsdp_4gpu.yaml``) each process holds a shard of
        every weight; scoring calls the body and the LM head directly, each process on its own rows, and ``save``
        writes one file, so the shards are gathered into a plain model on every process (the trainer is dropped
        right after, which frees the sharded copy and the optimiser state).
        """
        if not trainer.is_fsdp_enabled:
            return trainer.accelerator.unwrap_model(trainer.model)
        policy = load_causal_lm(self.backbone, dtype=self._train_dtype())
        policy.load_state_dict(full_weights(trainer.model))
        return policy.to(self.device)

    # ------------------------------------------------------------------ scoring
    def _batches(self, prompts, completions):
        """(indices, ids, attention, completion mask, mask seeds, completion starts) per batch of
        ``score_batch_size`` sequences."""
        tok = self.tokenizer
        encoded = [tokenize_completion(tok, _messages(p), _messages(c)) for p, c in zip(prompts, completions)]
        # little padding, and where prompts repeat, batches of one prompt (run once per batch)
        order = batch_order([ids for ids, _ in encoded], [start for _, start in encoded], self.score_batch_size)
        pad = tok.pad_token_id
        for s in range(0, len(order), self.score_batch_size):
            idx = order[s:s + self.score_batch_size]
            width = max(len(encoded[i][0]) for i in idx)
            ids = torch.full((len(idx), width), pad, dtype=torch.long)
            attn = torch.zeros((len(idx), width), dtype=torch.long)
            comp = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                seq, start = encoded[i]
                ids[row, :len(seq)] = torch.tensor(seq)
                attn[row, :len(seq)] = 1
                comp[row, start:len(seq)] = 1
            seeds = [row_seed(self.seed, encoded[i][0]) for i in idx]
            starts = [encoded[i][1] for i in idx]
            yield idx, ids.to(self.device), attn.to(self.device), comp.to(self.device), seeds, starts

    def _autocast(self):
        # The same bf16 autocast as training (accelerate's, see _make_trainer), on the model's device type: CPU
        # autocast runs this path in tests.
        if self._bf16():
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return torch.autocast(self.device.type, enabled=False)

    @torch.no_grad()
    def sample_rewards(self, prompts, completions) -> np.ndarray:
        """(n, K) implicit rewards, one column per dropout mask. The masks of a sequence are seeded from the method's
        seed and the sequence's tokens, so its rewards do not depend on the other texts of the call."""
        policy, reference = self._ensure_policy().eval(), self._ensure_reference()
        prompts, completions = list(prompts), list(completions)
        out = np.zeros((len(prompts), self.num_samples))
        n_batches = math.ceil(len(prompts) / self.score_batch_size)
        batches = progress(self._batches(prompts, completions), total=n_batches, desc="mcd_dpo scoring",
                           unit="batches", show=self.show_progress, quiet=not is_main())
        for idx, ids, attn, comp, seeds, starts in batches:
            with self._autocast():
                hidden = shared_prefix_hidden(policy.get_decoder(), ids, attn, starts)
                logps = mc_completion_logps(hidden, policy.lm_head, ids, comp, self.num_samples, self.dropout,
                                            row_generators(seeds, self.device), self.logprob_chunk)  # (K, B)
                ref_hidden = shared_prefix_hidden(reference.get_decoder(), ids, attn, starts)
                ref = completion_logps(ref_hidden, reference.lm_head, ids, comp, self.logprob_chunk)  # (B,)
            out[idx] = (self.dpo_beta * (logps - ref.unsqueeze(0))).T.double().cpu().numpy()
        return out

    def score(self, prompts, completions) -> Scores:
        samples = self.sample_rewards(prompts, completions)
        reward, u = samples.mean(1), samples.std(1, ddof=1)     # unbiased std over the K masks
        return Scores(reward=reward, lower=reward - self.beta * u, upper=reward + self.beta * u)

    def score_pairs(self, frame: pd.DataFrame) -> tuple[Scores, Scores]:
        prompts = list(frame["prompt"])
        return self.score(prompts, list(frame["chosen"])), self.score(prompts, list(frame["rejected"]))

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | os.PathLike) -> None:
        """The fine-tuned policy weights (safetensors) + method.json; the reference is the base checkpoint."""
        from safetensors.torch import save_model

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_path(directory / WEIGHTS_FILE) as tmp:
            save_model(self._ensure_policy(), str(tmp))   # handles the tied LM head / embeddings
        extra = {"backbone": self.backbone.identity()} if self.encoder is not None else {}
        write_method_info(directory, self, weights=WEIGHTS_FILE, **extra)

    def load(self, directory: str | os.PathLike) -> McdDpo:
        from safetensors.torch import load_model

        directory = Path(directory)
        info = read_method_info(directory, self.name)
        weights = info.get("weights", WEIGHTS_FILE)
        if weights != WEIGHTS_FILE:  # a name from the file: anything else could point outside the run folder
            raise UserError(one_line(f"{directory / 'method.json'}: field \"weights\" is {weights!r}; a saved "
                                     f"{self.name} keeps its weights in {WEIGHTS_FILE}"))
        path = directory / WEIGHTS_FILE
        check_safetensors(path)  # a missing or cut-short file: one line naming it, before the base model loads
        policy = load_causal_lm(self.backbone, dtype=self._train_dtype())
        try:
            load_model(policy, str(path), device="cpu")
        except Exception as err:  # noqa: BLE001 (SafetensorError, or tensors of another model: neither names the file)
            raise UserError(one_line(f"{path} does not hold the weights of model '{self.backbone.name}' "
                                     f"({type(err).__name__}: {str(err)[:200]}); the run folder is damaged or was "
                                     "trained on another backbone")) from None
        policy.requires_grad_(False)
        self.policy = policy.to(self.device).eval()
        self.fit_summary = info.get("fit_summary", {})
        return self
