"""The MCD-DPO method (:class:`McdDpo`): its settings, the policy and the frozen reference, ``fit`` (the Trainer of
:mod:`.trainer` as one checkpoint phase of the run), MC-dropout scoring, and ``save`` / ``load``.

A bf16 backbone (a GPU, or CPU with ``model.keep_dtype_on_cpu=true``) trains and scores under bf16 autocast with fp32
weights (policy and reference). Gradients are clipped to a total norm of ``max_grad_norm`` (1.0, the HF Trainer
default the authors trained with, so Table 1's values hold with it; null = off), passed to TRL's config explicitly.

Scoring runs the transformer body once per batch; only dropout + LM head + log-softmax are repeated K times, over
chunks of completion positions (:func:`~.logprobs.mc_completion_logps`), so no (K, B, L, V) logits tensor ever
exists. The reference model (no dropout) is run once per batch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from rewarduq_exp.core import job_signals, training_checkpoint
from rewarduq_exp.core.atomic_write import atomic_path
from rewarduq_exp.core.distributed import is_main, rank, world_size
from rewarduq_exp.core.errors import UserError, one_line
from rewarduq_exp.core.payload_bounds import Expected, check_tensors
from rewarduq_exp.core.progress import progress
from rewarduq_exp.core.saved_files import check_finite, check_safetensors
from rewarduq_exp.core.setting_bounds import AUTO, BATCH_ROWS, Bound
from rewarduq_exp.methods.base import (
    RewardMethod,
    Scores,
    TrainingSchedule,
    read_method_info,
    write_method_info,
)
from rewarduq_exp.methods.mcd_dpo.callbacks import _phase_checkpoint_class
from rewarduq_exp.methods.mcd_dpo.logprobs import (
    _messages,
    completion_logps,
    mc_completion_logps,
    row_generators,
    row_seed,
    tokenize_completion,
)
from rewarduq_exp.methods.mcd_dpo.memory import (
    auto_chunk,
    scoring_head,
    scoring_token,
    training_reserved,
    training_token,
)
from rewarduq_exp.methods.mcd_dpo.trainer import _checkpointing_key, _history, _make_trainer_class
from rewarduq_exp.methods.mcd_dpo.weights import _load_params, _param_tensors, full_weights, load_causal_lm
from rewarduq_exp.methods.settings import (
    LOG_EVERY,
    PAIRS_PER_FORWARD,
    PAIRS_PER_STEP,
    ROWS_PER_SCORING_FORWARD,
    TOKENS_PER_SCORING_FORWARD,
    MethodSettings,
    auto_flag,
    cast,
    epochs,
    grad_norm,
    positive,
    setting,
)
from rewarduq_exp.models.backbone import resolve_device
from rewarduq_exp.models.shared_prefix import shared_prefix_hidden, token_batches
from rewarduq_exp.models.token_budget import budget_from_memory

log = logging.getLogger("rewarduq_exp")

WEIGHTS_FILE = "policy.safetensors"


def _dropout(value, key):
    if not (isinstance(value, (int, float)) and 0 <= value < 1):
        raise UserError(f"{key}={value} is invalid: must be in [0, 1)")
    return float(value)


@dataclass(kw_only=True)
class McdDpoSettings(MethodSettings, config="mcd_dpo"):
    """Defaults and comments: ``conf/method/mcd_dpo.yaml``. The schedule: AdamW as TRL's DPOTrainer runs it."""

    learning_rate: float = setting(check=cast(float), doc="eta")
    dpo_beta: float = setting(check=positive(cast=float), doc="beta of the DPO loss and the implicit reward")
    dropout: float = setting(check=_dropout, doc="p: dropout before the LM head (train and MC inference)")
    num_samples: int = setting(bound=Bound(2, 10_000, "dropout masks", "the paper's K is 20; each mask is one more "
                                           "pass of every scored token through the LM head"), doc="K masks")
    beta: float = setting(check=positive(cast=float), doc="bounds reward +- beta * u (0 leaves no interval)")
    batch_size: int = setting(bound=PAIRS_PER_STEP, doc="effective batch")
    micro_batch_size: int | str = setting(bound=PAIRS_PER_FORWARD,
                                          doc="pairs per forward (auto: what fits)")
    num_epochs: float = setting(check=epochs, doc="passes over the training pairs")
    warmup_ratio: float = setting(check=cast(float))
    weight_decay: float = setting(check=cast(float))
    # None (no clipping) or a number > 0; it reaches DPOConfig explicitly (see _make_trainer)
    max_grad_norm: float | None = setting(check=grad_norm, doc="clip the total gradient norm (null: off)")
    score_batch_size: int | str = setting(runtime=True, bound=ROWS_PER_SCORING_FORWARD,
                                          doc="sequences per scoring forward")
    score_batch_tokens: int | str = setting(runtime=True, bound=TOKENS_PER_SCORING_FORWARD,
                                            doc="padded tokens per forward")
    logprob_chunk: int | str = setting(runtime=True, doc="positions per log-softmax chunk",
                                       bound=Bound(1, BATCH_ROWS, "positions", "each position holds a whole "
                                                   "vocabulary of logits: 65,536 positions of Qwen3's 151,936 words "
                                                   "are 40 GB in float32; auto takes 64M logits", allow=(AUTO,)))
    gradient_checkpointing: bool | str = setting(runtime=True, check=auto_flag, doc="auto | true | false")
    seed: int = setting(default=0, check=cast(int), doc="initialisation, data order, dropout masks")
    device: str = setting(default="auto", runtime=True, doc="auto | cpu | cuda | cuda:<i>")
    show_progress: bool = setting(default=True, runtime=True, doc="progress bars")
    log_every: int = setting(default=1, runtime=True, bound=LOG_EVERY,
                             doc="a training-log record every this many steps")

    def validate(self) -> None:
        super().validate()
        TrainingSchedule.of(self).validate()
        micro, batch = self.micro_batch_size, self.batch_size
        if micro != "auto" and batch % micro and batch > micro:
            raise UserError(f"method.batch_size={batch} must be a multiple of method.micro_batch_size={micro} "
                            "(gradient accumulation)")


class McdDpo(RewardMethod):
    """MCD-DPO: DPO full fine-tune + MC dropout on the final hidden states (RewardUQ eq. 13)."""

    name = "mcd_dpo"
    settings_class = McdDpoSettings
    fine_tunes_backbone = True  # the whole causal LM, with DPO

    @classmethod
    def plan_memory(cls, ctx):
        from rewarduq_exp.methods.mcd_dpo.memory import plan

        return plan(ctx)

    def __init__(self, encoder=None, **values):
        super().__init__(encoder, **values)
        self.schedule = TrainingSchedule.of(self.settings)
        # "auto": chosen at fit from the device's free memory (:meth:`_training_batches`); a number: as given
        self.micro_setting = self.settings.micro_batch_size
        self.micro_batch_size = None if self.micro_setting == "auto" else min(self.micro_setting, self.batch_size)
        self.device = resolve_device(self.settings.device)
        self.show_progress = self.settings.show_progress and not os.environ.get("TQDM_DISABLE")
        self.score_batch_size = None if self.score_batch_size == "auto" else self.score_batch_size  # rows cap
        # gradient_checkpointing: "auto" (from the plan of the micro-batch), True or False
        self.training_plan: dict = {}                 # what fit chose: micro-batch, checkpointing, chunk, budget
        self._arch = None                             # the policy's sizes, for the token budgets
        self.policy = None
        self.reference = None
        self.stats = {"reference_pairs_precomputed": 0}
        self._shared_dir: str | None = None  # torchrun: the ranks' common datasets cache (see _shared_dataset)

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

    def _architecture(self):
        from rewarduq_exp.models.shapes import architecture_of_model

        if self._arch is None:
            self._arch = architecture_of_model(self.backbone.name, self._ensure_policy())
        return self._arch

    def _longest_row(self, prompts, completions) -> int:
        """Tokens of the longest prompt + completion (the template rendered as training and scoring see it, plus a
        few for the generation prompt's split): the width a micro-batch pads to at most."""
        from rewarduq_exp.data.contract import render_all

        texts = render_all(self.tokenizer, list(prompts), list(completions))
        return max(len(x) for x in self.tokenizer(texts, add_special_tokens=False)["input_ids"]) + 8

    def _chunk(self, a, rows: int) -> int:
        return self.logprob_chunk if self.logprob_chunk != "auto" else auto_chunk(a.vocab, rows)

    def _training_batches(self, train: pd.DataFrame) -> dict:
        """The micro-batch (pairs per forward, a divisor of this process's share of ``batch_size``), activation
        checkpointing and chunk of this fit: as configured, or (``auto``) the largest micro-batch that the device's
        free memory holds at the per-token cost of :mod:`.memory`, without checkpointing where that holds a
        micro-batch large enough to keep the device busy. Every micro-batch size gives the same step: each row's
        masks are its own and the loss is the whole step's weighted mean (:mod:`.trainer`)."""
        from rewarduq_exp.models.token_budget import choose_micro_batch, free_bytes

        per_rank = max(1, self.schedule.batch_size // world_size())
        a = self._architecture()
        cuda = self.device.type == "cuda"
        chunk = self._chunk(a, 1)
        longest = self._longest_row(list(train["prompt"]) * 2, list(train["chosen"]) + list(train["rejected"]))
        free = free_bytes(self.device)
        reserved = training_reserved(a, self._bf16(), chunk, cuda)
        costs = [training_token(a, longest, self._bf16(), not cuda, ckpt) for ckpt in (False, True)]
        micro, checkpointing = choose_micro_batch(per_rank, 2 * longest, free, reserved, *costs, self.device.type,
                                                  self.gradient_checkpointing, divides=True, micro=self.micro_setting)
        # the reference pass (no grad, before training): pairs of the scoring budget without the K-mask head
        ref_tokens = budget_from_memory(free, scoring_token(a, longest, not cuda), self.device.type,
                                        reserved=3.0 * chunk * a.vocab * 4)
        self.micro_batch_size = micro
        self.training_plan = {"micro_batch_size": micro, "gradient_checkpointing": bool(checkpointing),
                              "logprob_chunk": chunk, "longest_row_tokens": longest,
                              "reference_batch_pairs": max(1, ref_tokens // (2 * longest)),
                              "free_bytes_at_start": int(free)}
        return self.training_plan

    def _make_trainer(self, train: pd.DataFrame, output_dir: str):
        from trl import DPOConfig

        from rewarduq_exp.core import distributed

        # Under torchrun with a CPU device, accelerate's state must be the one whose barriers stay on the CPU
        # (train.py sets it up first; a direct call of fit under a launcher gets it here).
        distributed.setup(self.device.type)
        model = self._ensure_policy()
        s = self.schedule
        cuda = self.device.type == "cuda"
        plan = self.training_plan or self._training_batches(train)
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
            precompute_ref_log_probs=True, precompute_ref_batch_size=plan["reference_batch_pairs"],
            max_length=None,                        # the run already drops over-long pairs (never truncate)
            disable_dropout=True,                   # Qwen3's own dropouts off; our head dropout is separate
            # bf16=True -> accelerate's bf16 autocast (CPU autocast under use_cpu=True; transformers 5.23 accepts it)
            bf16=self._bf16(), use_cpu=not cuda,
            # as _training_batches chose it (auto: where the micro-batch needs it)
            **{_checkpointing_key(DPOConfig): plan["gradient_checkpointing"]},
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
                              processing_class=self.tokenizer, dropout=self.dropout,
                              logprob_chunk=plan["logprob_chunk"], show_progress=self.show_progress,
                              mask_seed=self.seed)
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
        self._training_batches(train)
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
                            **{k: v for k, v in self.training_plan.items() if k != "free_bytes_at_start"},
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
    def _batches(self, prompts, completions) -> list[tuple]:
        """(indices, ids, attention, completion mask, mask seeds, completion starts) per scoring batch: at most
        ``score_batch_tokens`` padded tokens (auto: what the device's free memory holds, :meth:`score_tokens`) and
        ``score_batch_size`` rows, sorted by length or grouped by prompt (prompts that repeat run once per batch)."""
        tok = self.tokenizer
        encoded = [tokenize_completion(tok, _messages(p), _messages(c)) for p, c in zip(prompts, completions)]
        if not encoded:
            return []
        ids_list = [ids for ids, _ in encoded]
        max_tokens = self.score_tokens(max(len(x) for x in ids_list))
        batches = token_batches(ids_list, [start for _, start in encoded], max_tokens, self.score_batch_size)
        pad = tok.pad_token_id
        out = []
        for idx in batches:
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
            out.append((idx, ids, attn, comp, seeds, starts))
        return out

    def score_tokens(self, longest: int) -> int:
        """Padded tokens per scoring batch: ``score_batch_tokens``, or (auto) what the device's free memory holds,
        with the policy and the reference loaded, at :func:`~.memory.scoring_token` per token after the K-mask head
        step's :func:`~.memory.scoring_head`."""
        from rewarduq_exp.models.token_budget import resolve_tokens

        if self.score_batch_tokens != "auto":
            return self.score_batch_tokens
        self._ensure_policy(), self._ensure_reference()
        a = self._architecture()
        cpu = self.device.type != "cuda"
        return resolve_tokens("auto", "method.score_batch_tokens", self.device, scoring_token(a, longest, cpu),
                              reserved=scoring_head(a, self.num_samples, self._chunk(a, self.num_samples),
                                                    self._bf16()))

    def _autocast(self):
        # The same bf16 autocast as training (accelerate's, see _make_trainer), on the model's device type: CPU
        # autocast runs this path in tests. Without autocast's weight cache: it keeps the bf16 cast of every float32
        # leaf that requires grad (grad mode or not) until the region ends, i.e. a bf16 copy of the whole policy
        # (2 bytes a parameter, 8 GB at 4B) whenever its parameters still require grad (an untrained policy, or one
        # handed in by a caller). Scoring uses each body weight once per batch and the LM head once per chunk: the
        # cache would only spare the LM head's re-casts, at the price of that copy.
        if self._bf16():
            return torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=False)
        return torch.autocast(self.device.type, enabled=False)

    @torch.no_grad()
    def sample_rewards(self, prompts, completions) -> np.ndarray:
        """(n, K) implicit rewards, one column per dropout mask. The masks of a sequence are seeded from the method's
        seed and the sequence's tokens, so its rewards do not depend on the other texts of the call."""
        self._ensure_policy().eval()
        prompts, completions = list(prompts), list(completions)
        out = np.zeros((len(prompts), self.num_samples))
        batches = progress(self._batches(prompts, completions), desc="mcd_dpo scoring", unit="batches",
                           show=self.show_progress, quiet=not is_main())
        for idx, ids, attn, comp, seeds, starts in batches:
            ids, attn, comp = (t.to(self.device, non_blocking=True) for t in (ids, attn, comp))
            rewards = self.mask_rewards_ids(ids, attn, comp, row_generators(seeds, self.device), starts)  # (K, B)
            out[idx] = rewards.T.double().cpu().numpy()
        return out

    @torch.no_grad()
    def mask_rewards_ids(self, ids, attn, comp, generators, starts) -> torch.Tensor:
        """(K, B) implicit rewards of one batch of right-padded token ids: ``comp`` marks each row's completion
        tokens, ``generators`` are the rows' mask generators (:func:`~.logprobs.row_generators`), ``starts`` the rows'
        first completion tokens (shared prompts run once). One body forward of the policy with K masks through the LM
        head, one of the reference; what :meth:`sample_rewards` runs per batch (and ``scripts/bench_gpu.py`` measures).
        """
        policy, reference = self._ensure_policy(), self._ensure_reference()
        a = self._architecture()
        with self._autocast():
            hidden = shared_prefix_hidden(policy.get_decoder(), ids, attn, starts)
            logps = mc_completion_logps(hidden, policy.lm_head, ids, comp, self.num_samples, self.dropout,
                                        generators, self._chunk(a, self.num_samples))  # (K, B)
            del hidden   # not alive while the reference runs (the budget counts one body's states)
            ref_hidden = shared_prefix_hidden(reference.get_decoder(), ids, attn, starts)
            ref = completion_logps(ref_hidden, reference.lm_head, ids, comp, self._chunk(a, 1))  # (B,)
        return self.dpo_beta * (logps - ref.unsqueeze(0))

    def score(self, prompts, completions) -> Scores:
        samples = self.sample_rewards(prompts, completions)
        reward, u = samples.mean(1), samples.std(1, ddof=1)     # unbiased std over the K masks
        return Scores(reward=reward, u=u, beta=self.beta)

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
        # Every tensor the file declares must be one of the policy's, of its shape, before any is read (a tied
        # weight is saved once, so any may be absent here; load_model then names what is missing).
        why = f"the parameters of model '{self.backbone.name}'"
        state = policy.state_dict()
        check_tensors(path, {k: Expected(tuple(v.shape), "f", why) for k, v in state.items()}, optional=state)
        try:
            load_model(policy, str(path), device="cpu")
        except Exception as err:  # noqa: BLE001 (SafetensorError, or tensors of another model: neither names the file)
            raise UserError(one_line(f"{path} does not hold the weights of model '{self.backbone.name}' "
                                     f"({type(err).__name__}: {str(err)[:200]}); the run folder is damaged or was "
                                     "trained on another backbone")) from None
        check_finite(dict(policy.named_parameters()), path)
        policy.requires_grad_(False)
        self.policy = policy.to(self.device).eval()
        self.fit_summary = info.get("fit_summary", {})
        return self
