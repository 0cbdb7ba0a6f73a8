"""The fine-tuning base of the LoRA reward models (:class:`LoRARewardMethod`): K >= 1 members on one frozen backbone,
each a LoRA adapter + a linear reward head on the last real token, trained with the Bradley-Terry loss.

ENS-LoRA (K members in one batched multi-LoRA forward, :mod:`rewarduq_exp.methods.ens_lora`) and LA-LoRA (one PEFT
adapter with a Laplace posterior, :mod:`rewarduq_exp.methods.lora.la_lora`) share everything here: the settings and
their checks, the body and head initialisation, tokenisation with the prompts shared, padding, pooling, the training
loop (``run_training``: AdamW, cosine schedule, checkpoints and resumption), micro-batches sized by the one memory
function the planner uses too (:func:`~rewarduq_exp.methods.lora.memory.choose_training`), the data-parallel
all-reduce, the scoring batches of the token budget and the checks of saved adapters. A subclass says what its
members are (``_build``, ``_lora_stacked``, ``_trainable``), how a micro-batch's loss is run backward
(``_micro_backward``) and how it scores and saves.

Loss of member k (RewardUQ eq. 11): Bradley-Terry NLL (weighted by the pair weight) + lambda * anchor_k + gamma *
mean (r_c + r_r)^2 (the anchor: :mod:`~rewarduq_exp.methods.lora.steps`). A step's loss is the SUM of the member
losses, so each member gets exactly the gradient of its own independent run. A step runs in micro-batches whose
gradients add up to the step's: the pair weights are normalised by the whole batch, the anchor is added once. The
prompt of a batch's texts runs once per batch and member (``shared_prefix_hidden``) where ``lora_dropout=0``: with
dropout the rows that share a prompt would also share its dropout mask, so there every row runs in full.
"""

from __future__ import annotations

import math
import os
import time
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import rewarduq_exp.methods.lora.adapters as adapters  # the module, not the package __init__
import rewarduq_exp.methods.lora.body as body  # the module, not the package __init__
import rewarduq_exp.methods.lora.texts as texts  # the module, not the package __init__
from rewarduq_exp.core import distributed
from rewarduq_exp.core.errors import UserError, one_line
from rewarduq_exp.core.payload_bounds import MAX_FEATURE_DIM, AtMost, Expected
from rewarduq_exp.core.saved_files import load_safetensors
from rewarduq_exp.core.setting_bounds import Bound
from rewarduq_exp.data.contract import render_all
from rewarduq_exp.methods.base import RewardMethod, read_method_info, run_training, write_method_info
from rewarduq_exp.methods.lora.memory import choose_training
from rewarduq_exp.methods.lora.steps import ANCHORS, anchor_value, sum_over_processes
from rewarduq_exp.methods.losses import bradley_terry_loss
from rewarduq_exp.methods.settings import (
    LOG_EVERY,
    PAIRS_PER_FORWARD,
    ROWS_PER_SCORING_FORWARD,
    TOKENS_PER_SCORING_FORWARD,
    AdamWSettings,
    auto_flag,
    cast,
    listed,
    positive,
    setting,
)
from rewarduq_exp.models.backbone import resolve_device
from rewarduq_exp.models.shared_prefix import shared_prefix_hidden, token_batches


def _dropout(value, key):
    if not 0 <= value < 1:
        raise UserError(f"{key}={value} is invalid: must be in [0, 1)")
    return float(value)


def _target_modules(value, key):
    if isinstance(value, str):
        return value
    modules = [str(m) for m in value]
    if not modules:
        raise UserError(f"{key} is empty: use all-linear or a list of module names")
    return modules


@dataclass(kw_only=True)
class LoRASettings(AdamWSettings):
    """What every LoRA reward model has; the defaults are each method's own (``conf/method/ens_lora.yaml``,
    ``conf/method/la_lora.yaml``)."""

    lora_rank: int = setting(bound=Bound(1, 8192, "", "a rank beyond the backbone's width adds nothing, and "
                                         "Qwen3-32B is 5120 wide; the paper's is 16"), doc="r")
    lora_alpha: float = setting(check=positive(cast=float), doc="LoRA scaling alpha / r")
    lora_dropout: float = setting(check=_dropout, doc="LoRA dropout (training only)")
    target_modules: str | list = setting(check=_target_modules, doc="all-linear or a list of module names")
    reg_lambda: float = setting(check=positive(cast=float, inclusive=True), doc="lambda: weight of the anchor")
    anchor: str = setting(check=listed(ANCHORS), doc="l2 | mean_squared")
    center_gamma: float = setting(check=positive(cast=float, inclusive=True), doc="gamma: mean (r_c + r_r)^2")
    beta: float = setting(check=positive(cast=float), doc="bounds reward +- beta * u")
    head_init: str = setting(check=listed(body.HEAD_INITS), doc="auto | pretrained | fresh")
    micro_batch_size: int | str = setting(bound=PAIRS_PER_FORWARD,
                                          doc="pairs per forward + backward (auto: what fits)")
    gradient_checkpointing: bool | str = setting(runtime=True, check=auto_flag, doc="auto | true | false")
    score_batch_size: int | str = setting(runtime=True, bound=ROWS_PER_SCORING_FORWARD,
                                          doc="texts per scoring forward")
    score_batch_tokens: int | str = setting(runtime=True, bound=TOKENS_PER_SCORING_FORWARD,
                                            doc="tokens per scoring forward")
    log_every: int = setting(runtime=True, bound=LOG_EVERY, doc="a training-log record every this many steps")
    seed: int = setting(default=0, check=cast(int), doc="initialisation, minibatch order, dropout")
    device: str = setting(default="auto", runtime=True, doc="auto | cpu | cuda | cuda:<i>")
    show_progress: bool = setting(default=True, runtime=True, doc="progress bars")


class LoRARewardMethod(RewardMethod):
    """LoRA members + linear heads on one frozen backbone (module docstring)."""

    fine_tunes_backbone = True  # LoRA adapters on the frozen base model
    label = "LoRA"              # the method in messages (ENS-LoRA, LA-LoRA)
    num_members = 1
    mixed_adapter_training = False   # all members in one batched forward (ENS-LoRA's setting)
    _mixed_training_auto = False

    settings_class = LoRASettings

    def __init__(self, encoder=None, **values):
        super().__init__(encoder, **values)
        self.schedule = self.settings.schedule()
        self.micro_setting = self.settings.micro_batch_size   # auto: chosen at fit (choose_training)
        self.score_batch_size = None if self.score_batch_size == "auto" else self.score_batch_size  # texts at most
        self.training_plan: dict = {}
        self.device = resolve_device(self.settings.device)
        self.show_progress = self.settings.show_progress and not os.environ.get("TQDM_DISABLE")
        self.model = None      # the frozen body with the members' LoRA weights
        self.head: torch.nn.Parameter | None = None  # (K, d) linear heads, no bias (a shift cancels in every margin)
        self.head_init_used: str | None = None

    def records(self) -> dict:
        return {"lr_schedule": self.schedule.lr_schedule, "head_init_used": self.head_init_used}

    # ------------------------------------------------------------------ what a subclass says
    @abstractmethod
    def _build(self) -> None:
        """Load the body, add the members' adapters and heads (``self.model``, ``self.head``)."""

    @abstractmethod
    def _lora_stacked(self) -> list[torch.Tensor]:
        """The LoRA weights, each with a leading member dimension (K, ...), in module order (for the anchor)."""

    @abstractmethod
    def _trainable(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer trains (LoRA + heads), in a fixed order (training checkpoints keep it)."""

    @abstractmethod
    def _micro_backward(self, ids, mask, rows, weight, pairs: int, mixed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Backward of one micro-batch's BT + gamma * center loss (rows: ``pairs`` chosen, then as many rejected;
        ``weight`` per pair, already normalised); returns the detached per-member (bt, center) sums, (K,) each."""

    def _pairs_backward(self, r: torch.Tensor, pairs: int, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Backward of the BT + gamma * center loss of rewards ``r`` (..., 2 * ``pairs``: the chosen texts, then the
        rejected ones; a leading axis for members), ``weight`` per pair, already normalised
        (:func:`~rewarduq_exp.methods.losses.bradley_terry_loss`); returns the detached (bt, center) weighted sums,
        one per leading index."""
        bt, center = bradley_terry_loss(r[..., :pairs], r[..., pairs:], weight)
        (bt + self.center_gamma * center).sum().backward()
        return bt.detach(), center.detach()

    def _clip(self):
        """``run_training``'s ``clip``: None clips the total gradient norm (one member: its own)."""
        return None

    def _set_checkpointing(self, on: bool) -> None:
        """Activation checkpointing of the body (non-reentrant) on or off."""
        base = self.model.get_base_model()
        if hasattr(base, "activation_checkpointing_enable"):   # transformers 5.24 renamed gradient_checkpointing_*
            if on:
                base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                base.activation_checkpointing_disable()
        elif on:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            base.gradient_checkpointing_disable()

    def _summary_members(self) -> dict:
        return {}

    def _after_training(self, chosen, rejected, shared, weight_all: torch.Tensor) -> None:
        """What the method fits once its members are trained (LA-LoRA: the Laplace posterior), on the tokenised
        pairs (``shared``: their prompt lengths, or None) and their weights."""

    # ------------------------------------------------------------------ building
    def _backbone(self):
        if self.encoder is None:
            raise RuntimeError(f"{type(self).__name__} needs an encoder with a backbone (set .encoder)")
        return self.encoder.backbone

    def _resolve_head_init(self) -> str:
        return body.resolve_head_init(self.head_init, self._backbone())

    def _load_base(self, with_score_head: bool):
        """The frozen transformer body (and, for Skywork-style checkpoints, its (1, d) score weight)."""
        return body.load_body(self._backbone(), self.name, self.device, with_score_head)

    def _lora_config(self):
        return body.lora_config(self.lora_rank, self.lora_alpha, self.lora_dropout, self.target_modules)

    def _finish_model(self) -> None:
        self.model.requires_grad_(False)
        self.model.eval()

    # ------------------------------------------------------------------ forward
    def _tokenize(self, text_list: list[str]) -> list[list[int]]:
        return texts.tokenize(self._backbone().tokenizer, text_list)

    def _shareable(self, prompts, seqs: list[list[int]]) -> np.ndarray:
        return texts.shareable(self._backbone().tokenizer, prompts, seqs)

    def _pad(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return texts.pad(seqs, self._backbone().tokenizer.pad_token_id or 0, self.device)

    def _autocast(self):
        return texts.autocast(self.device, self._backbone().dtype)

    def _pooled(self, ids, mask, adapter_names: list[str] | None = None, shared=None) -> torch.Tensor:
        """Final hidden state of each row's last real token, row ``b`` under member ``adapter_names[b]`` (rows in
        equal member blocks; None: the model's one adapter); ``shared[b]``: leading tokens of row ``b`` that rows with
        the same tokens (and member) compute once (``None``: a plain forward)."""
        route = {} if adapter_names is None else {"adapter_names": adapter_names}
        with self._autocast():
            if shared is not None:
                hidden = shared_prefix_hidden(self.model, ids, mask, shared, adapter_names=adapter_names)
            else:
                hidden = self.model(input_ids=ids, attention_mask=mask, use_cache=False, **route).last_hidden_state
        return texts.last_token(hidden, mask)

    # ------------------------------------------------------------------ training
    def _anchor(self, member: int | None = None) -> torch.Tensor:
        """The anchor over the trainable parameters (LoRA + head) of every member (``(K,)``) or of ``member`` (a
        scalar), differentiable (:func:`~rewarduq_exp.methods.lora.steps.anchor_value`). ``theta_0``:
        ``self._lora0`` / ``self._head0``, set by ``fit``."""
        pick = slice(None) if member is None else slice(member, member + 1)
        diffs = [self.head[pick] - self._head0[pick]]
        diffs += [(p[pick] - p0[pick]).flatten(1) for p, p0 in zip(self._lora_stacked(), self._lora0)]
        value = anchor_value(diffs, self.anchor)
        return value if member is None else value[0]

    def _backward_step(self, local, chosen, rejected, weight, mixed: bool, world: int, shared=None) -> torch.Tensor:
        """Backward of this process's part of one step's loss; returns the detached (3, K) parts (bt, anchor,
        center) that, summed over the processes, are the step's per-member loss terms.

        ``weight`` is already divided by the GLOBAL batch's weight total and the anchor (which every process
        computes in full, once per step) by the number of processes, so the gradients summed over the micro-batches
        (``training_plan["micro_batch_size"]`` pairs, longest first; chosen and rejected together) and the processes
        are exactly those of one process training on the whole batch in one forward. With one process this is the
        plain eq. 11. ``shared``: the (chosen, rejected) prompt lengths of every pair (``_shareable``), or ``None``.
        """
        K, device = self.num_members, self.device
        anchor = (self._anchor() if self.reg_lambda > 0 else torch.zeros(K, device=device)) / world
        if anchor.requires_grad:
            (self.reg_lambda * anchor.sum()).backward()
        bt, center = torch.zeros(K, device=device), torch.zeros(K, device=device)
        micro = self.training_plan.get("micro_batch_size") or max(1, len(local))
        order = sorted(range(len(local)), key=lambda j: -max(len(chosen[local[j]]), len(rejected[local[j]])))
        for start in range(0, len(order), micro):
            part = order[start:start + micro]
            pairs, w, b = [local[j] for j in part], weight[part], len(part)
            ids, mask = self._pad([chosen[i] for i in pairs] + [rejected[i] for i in pairs])
            rows = None if shared is None else np.concatenate([shared[0][pairs], shared[1][pairs]])
            bt_m, center_m = self._micro_backward(ids, mask, rows, w, b, mixed)
            bt, center = bt + bt_m.detach(), center + center_m.detach()
        return torch.stack([bt, anchor.detach(), center])

    def _training_batches(self, chosen, rejected, mixed: bool) -> dict:
        """Pairs per micro-batch and activation checkpointing (and for K > 1 members the batched forward): as
        configured, or (``auto``) what :func:`~rewarduq_exp.methods.lora.memory.choose_training` picks on the
        device's free memory now, the planner's choice for the same sizes. Every micro-batch size gives the same
        step (``_backward_step``)."""
        from rewarduq_exp.models import token_budget
        from rewarduq_exp.models.shapes import architecture_of_model

        per_rank = max(1, math.ceil(self.schedule.batch_size / distributed.world_size()))
        longest = max(max(map(len, chosen)), max(map(len, rejected)))
        a = architecture_of_model(self._backbone().name, self.model)
        act = torch.finfo(self._backbone().dtype).bits // 8
        choice = choose_training(a, longest, act, self.device.type != "cuda", self.device.type,
                                 token_budget.free_bytes(self.device), sum(p.numel() for p in self._trainable()),
                                 per_rank, self.num_members, mixed, self._mixed_training_auto,
                                 self.gradient_checkpointing, self.micro_setting)
        self.training_plan = {"micro_batch_size": choice.micro_batch_size,
                              "gradient_checkpointing": choice.gradient_checkpointing, "longest_row_tokens": longest}
        if self.num_members > 1:
            self.training_plan["mixed_adapter_training"] = choice.mixed
        return self.training_plan

    _sum_over_processes = staticmethod(sum_over_processes)

    def fit(self, train: pd.DataFrame, eval: pd.DataFrame | None = None):  # noqa: A002
        """Train all members in one job. ``eval`` is not scored here: the run scores every eval set right after
        fit."""
        t0 = time.perf_counter()
        self._build()   # the backbone loaded and the adapters added: its own time, not the tokenizer's
        t_build = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.history = []
        tok = self._backbone().tokenizer
        n = len(train)
        chosen = self._tokenize(render_all(tok, train["prompt"], train["chosen"]))
        rejected = self._tokenize(render_all(tok, train["prompt"], train["rejected"]))
        # Dropout would give the rows that share a prompt one mask for it: every row then runs in full.
        shared = None
        if self.lora_dropout == 0:
            shared = (self._shareable(train["prompt"], chosen), self._shareable(train["prompt"], rejected))
        weight_all = torch.tensor(train["weight"].to_numpy(dtype=np.float32))
        t_tok = time.perf_counter() - t0

        params = self._trainable()
        for p in params:
            p.requires_grad_(True)
        self._lora0 = [p.detach().clone() for p in self._lora_stacked()]
        self._head0 = self.head.detach().clone()
        plan = self._training_batches(chosen, rejected, self.mixed_adapter_training)
        mixed, checkpointing = plan.get("mixed_adapter_training", False), plan["gradient_checkpointing"]
        if checkpointing:
            self._set_checkpointing(True)
        # Every process draws the same order (same seed) and takes every world-th pair of each global batch, so
        # method.batch_size stays the total batch whatever the number of processes.
        world, me = distributed.world_size(), distributed.rank()

        def step(index: torch.Tensor) -> dict:
            local = index[me::world].tolist()
            weight = (weight_all[local] / weight_all[index].sum()).to(self.device)
            parts = self._backward_step(local, chosen, rejected, weight, mixed, world, shared)
            if world > 1:
                parts = self._sum_over_processes(params, parts)
            bt, anchor, center = parts
            losses = bt + self.reg_lambda * anchor + self.center_gamma * center
            return {"loss": losses.mean(), "loss_bt": bt.mean(), "loss_anchor": anchor.mean(),
                    "loss_center": center.mean()}

        self.model.train()
        t1 = time.perf_counter()
        total = run_training(params, n, self.schedule, step, seed=self.seed, desc=f"{self.name} training",
                             history=self.history, show_progress=self.show_progress, log_every=self.log_every,
                             clip=self._clip(), synchronized=world > 1)
        if checkpointing:
            self._set_checkpointing(False)
        self._finish_model()
        self.head.requires_grad_(False)
        self.fit_summary = {"train_pairs": n, **self._summary_members(), "steps": total, **self.training_plan,
                            "head_init": self.head_init_used, "seconds_build": round(t_build, 3),
                            "seconds_tokenize": round(t_tok, 3),
                            "seconds_training": time.perf_counter() - t1}
        if world > 1:
            self.fit_summary["processes"] = world
        if self.history:
            self.fit_summary["final_train_loss"] = self.history[-1]["loss"]
        self._after_training(chosen, rejected, shared, weight_all)
        return self

    # ------------------------------------------------------------------ scoring
    def score_tokens(self, longest: int, shared: bool) -> int:
        """Member-token positions per scoring forward: ``score_batch_tokens``, or (auto) what the device's free
        memory holds at the planner's inference cost per token (the shared prompts' KV cache counted)."""
        from rewarduq_exp.models.activation_memory import inference_token_bytes
        from rewarduq_exp.models.shapes import architecture_of_model
        from rewarduq_exp.models.token_budget import resolve_tokens

        if self.score_batch_tokens != "auto":
            return self.score_batch_tokens
        a = architecture_of_model(self._backbone().name, self.model)
        act = torch.finfo(self._backbone().dtype).bits // 8
        per_token = inference_token_bytes(a, longest, act, self.device.type != "cuda", kv_cache=shared)
        return resolve_tokens("auto", "method.score_batch_tokens", self.device, per_token)

    def _score_batches(self, seqs, shared, per_text: int, tokens: int | None = None) -> list[np.ndarray]:
        """Batches of ``seqs`` of at most ``tokens`` padded positions (default: ``score_tokens`` divided by the
        ``per_text`` members each text runs under) and ``score_batch_size`` texts, sorted by length or grouped by
        prompt (``token_batches``)."""
        cut = shared if shared is not None else np.zeros(len(seqs), dtype=np.int64)
        if tokens is None:
            tokens = max(1, self.score_tokens(max(map(len, seqs)), shared is not None) // per_text)
        return token_batches(seqs, cut, tokens, self.score_batch_size)

    # ------------------------------------------------------------------ persistence
    def _write_info(self, directory: Path, **extra) -> None:
        if self.encoder is not None:
            extra = {"backbone": self._backbone().identity(), **extra}
        write_method_info(directory, self, **extra)

    def _read_info(self, directory: Path) -> dict:
        return read_method_info(directory, self.name)

    def _check_backbone(self, info: dict, directory: Path) -> None:
        """Refuse (one line) a saved run trained on another backbone than this method's."""
        saved_bb = info.get("backbone", {}).get("name") if isinstance(info.get("backbone"), dict) else None
        if saved_bb is not None and saved_bb != self._backbone().name:
            raise UserError(f"{directory} was trained on backbone '{saved_bb}', not model={self._backbone().name}")

    heads_file = "heads.safetensors"   # the (K, d) heads a saved run holds beside its adapters

    @abstractmethod
    def _saved_adapters(self, info: dict, directory: Path) -> dict[str, Path]:
        """The adapter folders a saved run holds, by adapter name, after the method's own checks of its
        ``method.json`` (``info``): never a name the file chose, which could point outside the run folder."""

    def _adapter_what(self, name: str) -> str:
        """The adapter ``name`` in messages."""
        return f"adapter of member {name}"

    def _check_saved_files(self, directory: Path) -> None:
        """Check the method's own files (LA-LoRA: its posterior) before the base model is loaded."""

    @abstractmethod
    def _attach_saved(self, peft_model, heads: torch.Tensor, directory: Path) -> None:
        """Take the loaded PEFT model (the saved adapters on the frozen body) and the saved (K, d) heads as the
        method's members, and load what else the run saved."""

    def load(self, directory: str | os.PathLike):
        """Rebuild the trained members from a saved run (``save``): every file PEFT reads is checked first
        (:mod:`~rewarduq_exp.methods.lora.adapters`), before the base model is loaded, then each LoRA tensor's shape
        against the rank and the base's Linear it belongs to; a bad file is one line naming it."""
        directory = Path(directory)
        info = self._read_info(directory)
        folders = self._saved_adapters(info, directory)
        self._check_backbone(info, directory)
        for name, folder in folders.items():
            adapters.check_adapter_files(folder, self.lora_rank, self.lora_alpha, self.label, self._adapter_what(name))
        heads_path = directory / self.heads_file
        K = self.num_members
        heads = load_safetensors(heads_path, expected={"weight": Expected(
            (K, AtMost(MAX_FEATURE_DIM)), "f", f"one head of at most {MAX_FEATURE_DIM} features" if K == 1
            else f"num_members={K}, at most {MAX_FEATURE_DIM} features")})["weight"]
        self._check_saved_files(directory)
        base, _ = self._load_base(with_score_head=False)  # the trained heads replace any pretrained one
        hidden = int(base.config.hidden_size)
        if heads.shape[1] != hidden:
            raise UserError(one_line(f"{heads_path}: tensor 'weight' has shape {tuple(heads.shape)}, but model "
                                     f"'{self._backbone().name}' has hidden size {hidden}; the run folder is damaged "
                                     "or was trained on another backbone"))
        for folder in folders.values():
            adapters.check_adapter_shapes(base, folder, self.lora_rank, self._backbone().name)
        # PEFT reads its own format (run folders of either ENS-LoRA implementation)
        self._attach_saved(adapters.load_peft(base, folders, self._backbone().name), heads, directory)
        self.head_init_used = info.get("hyperparameters", {}).get("head_init_used")
        self.fit_summary = info.get("fit_summary", {})
        return self
