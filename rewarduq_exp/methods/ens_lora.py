"""ENS-LoRA: an ensemble of K LoRA adapters on one frozen backbone, each with its own linear reward head
(RewardUQ section 4.2, Appendix B.2).

All K members live on ONE frozen base model as a batched multi-LoRA module
(:mod:`rewarduq_exp.models.multi_lora`): PEFT builds the adapters (``get_peft_model`` + ``add_adapter``, each member
under its own seed) and their weights move into stacked tensors. A member's reward is its linear
head applied to the final hidden state (after the last RMSNorm) of the last real token of the chat-template-rendered
prompt + completion. Members differ from the start: member k's LoRA A matrices and head come from a seed derived from
(seed, k). (LoRA B starts at zero, so with a pretrained Skywork head all members start from the same rewards and
diverge through their different A matrices.)

Loss of member k (eq. 11): Bradley-Terry NLL (weighted by the pair weight) + lambda * anchor_k + gamma * mean
(r_c + r_r)^2, where the anchor pulls the member's trainable parameters theta_k (LoRA + head) towards their initial
values theta_k0 in one of two forms (``anchor``):

* ``l2`` (default): ``||theta_k - theta_k0||_2``, the unsquared L2 norm over all of the member's trainable
  parameters, not divided by their count. This is what the authors' code trains with (their LoRA trainer:
  ``lambda * torch.norm(weights - initial_weights, p=2)``), so Table 1's lambdas (0.01, 0.001 for 4B) and the
  sweep grid {0.001, 0.01, 0.1} mean this form. Its gradient has norm lambda wherever theta != theta_0 (a constant
  pull); at theta = theta_0 the norm is computed as a norm of per-tensor norms, whose (sub)gradient there is 0, not
  NaN.
* ``mean_squared``: the mean over those parameters of (theta - theta_0)^2, the form ENS-MLP's eq. 11 uses (per
  parameter, so the same lambda is a much weaker pull: tune lambda anew when choosing it).

The ensemble's loss is the SUM of the member losses, so each member gets exactly the gradient of its own
independent run (the authors trained each member in its own run); gradients are clipped per member
(``max_grad_norm``, the HF Trainer default 1.0 the authors trained with). Every member sees the same minibatch (one
job trains the whole ensemble).

One forward serves all members (``mixed_adapter_training`` / ``mixed_adapter_scoring``: "all members in one batched
forward"): the batch is replicated K times member-major, every frozen base projection runs once over the K x B rows
and the K low-rank updates run as one batched matmul over the stacked adapters. Otherwise each member runs its own
pass of B rows (one backward per member in training). Both give the same rewards and gradients (the tests check them
against PEFT's ``set_adapter`` passes), in train mode, with LoRA dropout and with activation checkpointing (the
routing is kept for the recomputation). Both settings default to ``auto``: the batched forward, except in training
where K members of one pair do not fit the device even checkpointed (``_training_batches``). A training step runs in
micro-batches sized from the device's free memory (``micro_batch_size``, ``gradient_checkpointing``: ``auto``), whose
gradients add up to the step's: the pair weights are normalised by the whole batch, the anchor is added once.

The prompt of a batch's texts runs once per batch and member (``shared_prefix_hidden``): chosen and rejected share
it, so a training step runs the prompt once per pair instead of twice, in either path. The rewards equal the plain
forward's to float rounding. In training this needs ``lora_dropout=0`` (the default): with dropout the rows that
share a prompt would also share its dropout mask, so there every row runs in full.

reward = mean over members, u = unbiased std over members, bounds reward ± beta * u (eq. 9).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn

from rewarduq_exp.core import distributed
from rewarduq_exp.core.atomic_write import atomic_dir, atomic_path
from rewarduq_exp.core.checks import check_positive
from rewarduq_exp.core.errors import UserError, first_line, one_line
from rewarduq_exp.core.payload_bounds import MAX_FEATURE_DIM, AtMost, Expected, check_tensors, declared_tensors
from rewarduq_exp.core.progress import progress
from rewarduq_exp.core.saved_files import check_safetensors, load_safetensors, read_json_object
from rewarduq_exp.data.contract import render_all, render_prompt_heads
from rewarduq_exp.methods.base import (
    RewardMethod,
    Scores,
    TrainingSchedule,
    bradley_terry_nll,
    read_method_info,
    run_training,
    write_method_info,
)
from rewarduq_exp.models.backbone import resolve_device
from rewarduq_exp.models.multi_lora import MultiLoRAModel, from_peft, quiet_peft
from rewarduq_exp.models.shared_prefix import share_lengths, shared_prefix_hidden, token_batches
from rewarduq_exp.models.token_budget import check_setting

HEAD_INITS = ("auto", "pretrained", "fresh")
ANCHORS = ("l2", "mean_squared")


def _mixed_flag(value, key: str, auto: bool) -> bool:
    """A ``mixed_adapter_*`` setting as a bool: true/false as given, ``auto`` (the default) as the caller's ``auto``
    (``EnsLoRA.__init__`` passes True for both settings: all members in one batched forward; in training ``auto``
    may still fall back to one member per pass, see ``_training_batches``)."""
    if value == "auto":
        return auto
    if isinstance(value, bool):
        return value
    raise UserError(f"{key}={value!r} is invalid; allowed: auto, true, false")


def member_seed(seed: int, k: int) -> int:
    return (int(seed) * 1_000_003 + 7919 * (k + 1)) % (2**31 - 1)


class EnsLoRA(RewardMethod):
    name = "ens_lora"
    fine_tunes_backbone = True  # LoRA adapters on the frozen base model, one per member

    def __init__(self, encoder=None, num_members: int = 8, lora_rank: int = 16, lora_alpha: float = 32,
                 lora_dropout: float = 0.0, target_modules="all-linear", learning_rate: float = 1e-4,
                 reg_lambda: float = 0.01, anchor: str = "l2", center_gamma: float = 0.01, beta: float = 2.0,
                 batch_size: int = 16,
                 num_epochs: float = 1.0, warmup_ratio: float = 0.05, weight_decay: float = 0.0,
                 adam_betas=(0.9, 0.999), adam_eps: float = 1e-8, max_grad_norm: float | None = 1.0,
                 head_init: str = "auto", mixed_adapter_training="auto", mixed_adapter_scoring="auto",
                 gradient_checkpointing="auto", micro_batch_size="auto", score_batch_size="auto",
                 score_batch_tokens="auto", seed: int = 0, device: str = "auto", show_progress: bool = True,
                 log_every: int = 10):
        self.encoder = encoder
        self.num_members = int(check_positive(num_members, "method.num_members", integer=True, minimum=2,
                                              inclusive=True))
        self.lora_rank = int(check_positive(lora_rank, "method.lora_rank", integer=True, minimum=1, inclusive=True))
        self.lora_alpha = float(check_positive(lora_alpha, "method.lora_alpha"))
        if not 0 <= lora_dropout < 1:
            raise UserError(f"method.lora_dropout={lora_dropout} is invalid: must be in [0, 1)")
        self.lora_dropout = float(lora_dropout)
        if isinstance(target_modules, str):
            self.target_modules = target_modules
        else:
            self.target_modules = [str(m) for m in target_modules]
            if not self.target_modules:
                raise UserError("method.target_modules is empty: use all-linear or a list of module names")
        self.reg_lambda = float(check_positive(reg_lambda, "method.reg_lambda", inclusive=True))
        if anchor not in ANCHORS:
            raise UserError(f"method.anchor={anchor!r} is invalid; allowed: {', '.join(ANCHORS)}")
        self.anchor = anchor
        self.center_gamma = float(check_positive(center_gamma, "method.center_gamma", inclusive=True))
        self.beta = float(check_positive(beta, "method.beta"))
        self.schedule = TrainingSchedule(learning_rate, batch_size, num_epochs, warmup_ratio, weight_decay,
                                         tuple(adam_betas), adam_eps, max_grad_norm)
        self.schedule.validate()
        if head_init not in HEAD_INITS:
            raise UserError(f"method.head_init={head_init!r} is invalid; allowed: {', '.join(HEAD_INITS)}")
        self.head_init = head_init
        checkpointing = {"auto": "auto", "true": True, "false": False}.get(str(gradient_checkpointing).lower())
        if checkpointing is None:
            raise UserError(f"method.gradient_checkpointing={gradient_checkpointing} is invalid; allowed: auto, true, "
                            "false")
        self.gradient_checkpointing = checkpointing   # auto: on where a micro-batch of one pair needs it to fit
        self.micro_setting = check_setting(micro_batch_size, "method.micro_batch_size")
        rows = check_setting(score_batch_size, "method.score_batch_size")
        self.score_batch_size = None if rows == "auto" else rows   # texts per scoring forward at most
        self.score_batch_tokens = check_setting(score_batch_tokens, "method.score_batch_tokens")
        self.training_plan: dict = {}
        self.seed = int(seed)
        self.device = resolve_device(device)
        # auto = all members in one batched forward, on every device: it runs the FLOPs of K passes in larger GEMMs
        # and saves K-1 launches of every other op (in training also K-1 backward passes). scripts/bench_lora.py on a
        # 2-core CPU (K=8, the tiny Qwen3, batches of 16 texts or pairs): scoring 1.04-1.38x and training 1.57-1.84x
        # with the default 2 threads; on one thread training 1.09x but scoring 0.74-0.82x at 128 rows a forward (the
        # body's elementwise ops fall out of the cache; 1.63x at 32 rows). Memory is the micro-batch's business: a
        # batched micro-batch of m pairs holds what one member's pass of K x m pairs holds (the token budget).
        self.mixed_adapter_training = _mixed_flag(mixed_adapter_training, "method.mixed_adapter_training",
                                                  auto=True)
        # auto also falls back to one member per pass where K members of one pair do not fit even checkpointed
        self._mixed_training_auto = mixed_adapter_training == "auto"
        self.mixed_adapter_scoring = _mixed_flag(mixed_adapter_scoring, "method.mixed_adapter_scoring", auto=True)
        self.show_progress = show_progress and not os.environ.get("TQDM_DISABLE")
        self.log_every = int(check_positive(log_every, "method.log_every", integer=True, minimum=1, inclusive=True))
        self.history: list[dict] = []
        self.fit_summary: dict = {}
        self.model: MultiLoRAModel | None = None  # the frozen body with the K members' stacked LoRA weights
        self.head: nn.Parameter | None = None  # (K, d) linear heads, no bias (a shift cancels in every BT margin)
        self.head_init_used: str | None = None

    @classmethod
    def plan_memory(cls, ctx):
        from rewarduq_exp.methods.ens_lora_memory import plan

        return plan(ctx)

    @property
    def member_names(self) -> list[str]:
        return [f"m{k}" for k in range(self.num_members)]

    def hyperparameters(self) -> dict:
        return {"num_members": self.num_members, "lora_rank": self.lora_rank, "lora_alpha": self.lora_alpha,
                "lora_dropout": self.lora_dropout, "target_modules": self.target_modules,
                "reg_lambda": self.reg_lambda, "anchor": self.anchor, "center_gamma": self.center_gamma,
                "beta": self.beta, **vars(self.schedule), "micro_batch_size": self.micro_setting,
                "head_init": self.head_init, "head_init_used": self.head_init_used, "seed": self.seed}

    # ------------------------------------------------------------------ building
    def _backbone(self):
        if self.encoder is None:
            raise RuntimeError(f"{type(self).__name__} needs an encoder with a backbone (set .encoder)")
        return self.encoder.backbone

    def _resolve_head_init(self) -> str:
        if self.head_init != "auto":
            return self.head_init
        return "pretrained" if self._backbone().name.startswith("skywork-") else "fresh"

    def _load_base(self, with_score_head: bool):
        """The frozen transformer body (and, for Skywork-style checkpoints, its (1, d) score weight)."""
        from transformers import AutoModel, AutoModelForSequenceClassification

        bb = self._backbone()
        bb.require_decoder("ens_lora")  # last-token rewards need a causal body (an encoder's last token sees all)
        if with_score_head:
            seq = bb.from_pretrained(AutoModelForSequenceClassification, dtype=bb.dtype)
            score = getattr(seq, "score", None)
            if score is None or score.weight.shape[0] != 1:
                raise UserError(f"method.head_init=pretrained needs a single-output sequence classifier, but model "
                                f"'{bb.name}' has no 1-logit score head; use method.head_init=fresh")
            weight = score.weight.detach().float().clone()
            base = getattr(seq, seq.base_model_prefix)
        else:
            base, weight = bb.from_pretrained(AutoModel, dtype=bb.dtype), None
        base.requires_grad_(False)
        return base.to(self.device), weight

    def _lora_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.lora_rank, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                          target_modules=self.target_modules, bias="none")

    def _build(self) -> None:
        from peft import get_peft_model

        self.head_init_used = self._resolve_head_init()
        base, pretrained = self._load_base(self.head_init_used == "pretrained")
        cfg = self._lora_config()
        d = int(base.config.hidden_size)
        heads = []
        peft_model = None
        for k, name in enumerate(self.member_names):
            # Member k's LoRA A init (global RNG inside PEFT) and its head come from its own seed. PEFT itself builds
            # the adapters (LoraConfig validation, all-linear resolution, its init and RNG use) and from_peft then
            # moves the weights into the stacked module: the same initial weights as ENS-LoRA on PEFT had.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(member_seed(self.seed, k))
                if k == 0:
                    with quiet_peft():
                        peft_model = get_peft_model(base, cfg, adapter_name=name)
                else:
                    peft_model.add_adapter(name, cfg)
            if pretrained is not None:
                heads.append(pretrained[0].clone())
            else:
                # Xavier-normal for a (d -> 1) layer: initial rewards of order 1 that differ between members.
                g = torch.Generator().manual_seed(member_seed(self.seed, k) + 1)
                heads.append(torch.randn(d, generator=g) * math.sqrt(2.0 / (d + 1)))
        self.model = from_peft(peft_model, self.member_names)
        self.head = nn.Parameter(torch.stack(heads).to(self.device))
        self._finish_model()

    def _finish_model(self) -> None:
        self.model.requires_grad_(False)
        self.model.eval()

    def _lora_params(self) -> list[list[torch.Tensor]]:
        """Per member, its LoRA weights (views of the stacked tensors, PEFT's shapes and order)."""
        return [self.model.member_parameters(k) for k in range(self.num_members)]

    # ------------------------------------------------------------------ forward
    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        # The template already holds the special tokens; the data was length-filtered, so nothing is truncated.
        return self._backbone().tokenizer(list(texts), add_special_tokens=False, truncation=False)["input_ids"]

    def _shareable(self, prompts, seqs: list[list[int]]) -> np.ndarray:
        """Per text, its leading tokens that its prompt accounts for: texts with one prompt share them."""
        tok = self._backbone().tokenizer
        return share_lengths(tok, seqs, render_prompt_heads(tok, prompts))

    def _pad(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        pad_id = self._backbone().tokenizer.pad_token_id or 0
        length = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), length), dtype=torch.long)
        for i, s in enumerate(seqs):  # right padding: the last real token sits at mask.sum - 1
            ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, :len(s)] = 1
        return ids.to(self.device), mask.to(self.device)

    def _autocast(self):
        """Matmuls in the backbone's dtype (bf16 on GPU) while the LoRA weights and heads stay fp32 (PEFT keeps
        adapters in fp32 on a bf16 base). On CPU the backbone is fp32 unless model.keep_dtype_on_cpu=true, which
        runs this same bf16 path here (the tests use it)."""
        dtype = self._backbone().dtype
        if dtype != torch.float32:
            return torch.autocast(self.device.type, dtype=dtype)
        return torch.autocast(self.device.type, enabled=False)

    def _pooled(self, ids, mask, adapter_names: list[str], shared=None) -> torch.Tensor:
        """Final hidden state of each row's last real token, row ``b`` under member ``adapter_names[b]`` (rows in
        equal member blocks); ``shared[b]``: leading tokens of row ``b`` that rows with the same tokens (and member)
        compute once (``None``: a plain forward). Both passes of a shared forward keep the member blocks: the prefix
        pass runs U distinct prefixes per member, K x U rows member-major."""
        with self._autocast():
            if shared is not None:
                hidden = shared_prefix_hidden(self.model, ids, mask, shared, adapter_names=adapter_names)
            else:
                hidden = self.model(input_ids=ids, attention_mask=mask, use_cache=False,
                                    adapter_names=adapter_names).last_hidden_state
        last = mask.sum(1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()

    def member_rewards_ids(self, ids, mask, mixed: bool, shared=None) -> torch.Tensor:
        """Rewards (K, B) of a right-padded batch: all members in one batched forward of the K x B rows
        (member-major), or one pass of the B rows per member; ``shared``: per row, its leading tokens that rows with
        the same ones compute once (see ``_pooled``)."""
        K, B = self.num_members, ids.shape[0]
        if mixed:
            names = [n for n in self.member_names for _ in range(B)]
            z = self._pooled(ids.repeat(K, 1), mask.repeat(K, 1), names,
                             None if shared is None else np.tile(shared, K)).view(K, B, -1)
            return (z * self.head[:, None, :]).sum(-1)
        return torch.stack([self._pooled(ids, mask, [name] * B, shared) @ self.head[k]
                            for k, name in enumerate(self.member_names)])

    # ------------------------------------------------------------------ training
    def _anchor(self, member: int | None = None) -> torch.Tensor:
        """The anchor over the trainable parameters (LoRA + head) of every member (``(K,)``) or of ``member`` (a
        scalar), differentiable: the L2 norm ||theta - theta_0|| (``anchor=l2``) or the mean of (theta - theta_0)^2
        (``anchor=mean_squared``). ``theta_0``: ``self._lora0`` / ``self._head0``, set by ``fit``."""
        pick = slice(None) if member is None else slice(member, member + 1)
        diffs = [self.head[pick] - self._head0[pick]]
        diffs += [(p[pick] - p0[pick]).flatten(1) for p, p0 in zip(self.model.lora_parameters(), self._lora0)]
        if self.anchor == "l2":
            # A norm of per-tensor norms: vector_norm's (sub)gradient at 0 is 0, where sqrt(sum of squares) would
            # give 0 * inf = NaN at the first step (theta = theta_0).
            value = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d, dim=1) for d in diffs]), dim=0)
        else:
            value = sum(d.pow(2).sum(1) for d in diffs) / sum(d.shape[1] for d in diffs)
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
            if mixed:   # all K members in one forward and one backward
                r = self.member_rewards_ids(ids, mask, mixed=True, shared=rows)   # (K, 2b)
                bt_m = (bradley_terry_nll(r[:, :b] - r[:, b:]) * w).sum(1)
                center_m = ((r[:, :b] + r[:, b:]).pow(2) * w).sum(1)
                (bt_m + self.center_gamma * center_m).sum().backward()
            else:       # one pass (and one backward) per member: its 2b rows under member k only
                bt_m, center_m = [], []
                for k, name in enumerate(self.member_names):
                    rk = self._pooled(ids, mask, [name] * (2 * b), shared=rows) @ self.head[k]
                    bt_k = (bradley_terry_nll(rk[:b] - rk[b:]) * w).sum()
                    center_k = ((rk[:b] + rk[b:]).pow(2) * w).sum()
                    (bt_k + self.center_gamma * center_k).backward()
                    bt_m.append(bt_k.detach())
                    center_m.append(center_k.detach())
                bt_m, center_m = torch.stack(bt_m), torch.stack(center_m)
            bt, center = bt + bt_m.detach(), center + center_m.detach()
        return torch.stack([bt, anchor.detach(), center])

    def _training_batches(self, chosen, rejected, mixed: bool) -> dict:
        """Pairs per micro-batch and activation checkpointing: as configured, or (``auto``) the largest micro-batch
        that the device's free memory holds at the planner's per-token cost (one pair = its two rows x K members in
        the batched forward), without checkpointing where that holds a micro-batch large enough to keep the device
        busy (:func:`choose_micro_batch`). Every micro-batch size gives the same step (``_backward_step``)."""
        from rewarduq_exp.models.activation_memory import lora_training_reserved, training_token_bytes
        from rewarduq_exp.models.shapes import architecture_of_model
        from rewarduq_exp.models.token_budget import choose_micro_batch, fits_in_memory, free_bytes

        per_rank = max(1, math.ceil(self.schedule.batch_size / distributed.world_size()))
        longest = max(max(map(len, chosen)), max(map(len, rejected)))
        a = architecture_of_model(self._backbone().name, self.model)
        act = torch.finfo(self._backbone().dtype).bits // 8
        costs = [training_token_bytes(a, longest, act, self.device.type != "cuda", ckpt) for ckpt in (False, True)]
        reserved = lora_training_reserved(sum(p.numel() for p in self.model.lora_parameters()) + self.head.numel())
        free = free_bytes(self.device)
        if mixed and self._mixed_training_auto:
            # K members of one pair (checkpointed unless that is switched off) must fit; else one member per pass,
            # which holds K x fewer activations
            cost = costs[0] if self.gradient_checkpointing is False else costs[1]
            mixed = fits_in_memory(free, reserved, 2 * longest * self.num_members, cost)
        item = 2 * longest * (self.num_members if mixed else 1)
        micro, ckpt = choose_micro_batch(per_rank, item, free, reserved, *costs, self.device.type,
                                         self.gradient_checkpointing, micro=self.micro_setting)
        self.training_plan = {"micro_batch_size": micro, "gradient_checkpointing": bool(ckpt),
                              "longest_row_tokens": longest, "mixed_adapter_training": mixed}
        return self.training_plan

    @staticmethod
    def _sum_over_processes(params, parts: torch.Tensor) -> torch.Tensor:
        """Sum the gradients and the loss parts over the processes, in ONE all-reduce of a flat buffer.

        Not DDP: the per-member path runs K backward passes per step and each touches one member's slices only,
        which DDP's once-per-backward bucketed reduction does not support without find_unused_parameters and
        no_sync juggling; the trainable parameters are small (LoRA + heads), so one flat reduction per step is cheap.
        """
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [parts.reshape(-1).to(grads[0].dtype)])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        return flat[offset:].view_as(parts).to(parts.dtype)

    def _clip_per_member(self) -> None:
        """Clip each member's gradient (its LoRA slices + its head) to ``max_grad_norm`` on its own."""
        if self.schedule.max_grad_norm is None:
            return
        grads = [p.grad for p in self.model.lora_parameters() if p.grad is not None]
        if self.head.grad is None:
            self.head.grad = torch.zeros_like(self.head)
        sq = self.head.grad.pow(2).sum(1) + sum(g.flatten(1).pow(2).sum(1) for g in grads)   # (K,)
        scale = (self.schedule.max_grad_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.view(-1, *([1] * (g.dim() - 1))))
        self.head.grad.mul_(scale[:, None])

    def fit(self, train: pd.DataFrame, eval: pd.DataFrame | None = None) -> EnsLoRA:  # noqa: A002
        """Train all K members in one job. ``eval`` is not scored here: the run scores every eval set right after
        fit, and scoring K members is a full pass over the data."""
        t0 = time.perf_counter()
        self._build()
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

        lora = self.model.lora_parameters()
        for p in lora:
            p.requires_grad_(True)
        self._lora0 = [p.detach().clone() for p in lora]
        self._head0 = self.head.detach().clone()
        plan = self._training_batches(chosen, rejected, self.mixed_adapter_training)
        mixed, checkpointing = plan["mixed_adapter_training"], plan["gradient_checkpointing"]
        if checkpointing:   # the routing of each checkpointed layer is kept for its recomputation
            self.model.checkpointing(True)
        params = [*lora, self.head]
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
                             clip=self._clip_per_member, synchronized=world > 1)
        if checkpointing:
            self.model.checkpointing(False)
        self._finish_model()
        self.head.requires_grad_(False)
        self.fit_summary = {"train_pairs": n, "num_members": self.num_members, "steps": total,
                            **self.training_plan, "head_init": self.head_init_used,
                            "seconds_tokenize": round(t_tok, 3), "seconds_training": time.perf_counter() - t1}
        if world > 1:
            self.fit_summary["processes"] = world
        if self.history:
            self.fit_summary["final_train_loss"] = self.history[-1]["loss"]
        return self

    # ------------------------------------------------------------------ scoring
    @torch.no_grad()
    def member_rewards(self, texts: list[str], mixed: bool | None = None, prompts=None) -> torch.Tensor:
        """Rewards (K, N) of rendered texts; ``prompts[i]`` (optional) the prompt of ``texts[i]``, run once per
        batch for the texts that share it. Batches hold at most ``score_batch_tokens`` member-token positions (auto:
        what the device's free memory holds; a text runs under K members in the batched forward) and
        ``score_batch_size`` texts, sorted by length or grouped by prompt (``token_batches``)."""
        if self.model is None:
            raise RuntimeError("ENS-LoRA is not trained or loaded yet (call fit or load)")
        mixed = self.mixed_adapter_scoring if mixed is None else mixed
        self.model.eval()
        seqs = self._tokenize(texts)
        if not seqs:
            return torch.empty(self.num_members, 0, dtype=torch.float64)
        shared = self._shareable(prompts, seqs) if prompts is not None else None
        cut = shared if shared is not None else np.zeros(len(seqs), dtype=np.int64)
        per_text = self.num_members if mixed else 1
        tokens = max(1, self.score_tokens(max(map(len, seqs)), shared is not None) // per_text)
        batches = token_batches(seqs, cut, tokens, self.score_batch_size)
        out = torch.empty(self.num_members, len(seqs), dtype=torch.float64)
        for idx in progress(batches, desc=f"{self.name} scoring", unit="batches", show=self.show_progress,
                            quiet=not distributed.is_main()):
            ids, mask = self._pad([seqs[j] for j in idx])
            rows = None if shared is None else shared[idx]
            out[:, torch.as_tensor(idx)] = self.member_rewards_ids(ids, mask, mixed, rows).double().cpu()
        return out

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

    def _scores(self, rewards: torch.Tensor) -> Scores:
        reward = rewards.mean(0).numpy()
        u = rewards.std(0, unbiased=True).numpy()
        return Scores(reward=reward, lower=reward - self.beta * u, upper=reward + self.beta * u)

    def score(self, prompts, completions) -> Scores:
        prompts = list(prompts)
        texts = render_all(self._backbone().tokenizer, prompts, list(completions))
        return self._scores(self.member_rewards(texts, prompts=prompts))

    def score_pairs(self, frame: pd.DataFrame) -> tuple[Scores, Scores]:
        """Chosen and rejected scores of a preference frame, in one length-sorted pass over both."""
        n = len(frame)
        prompts = list(frame["prompt"]) * 2
        texts = render_all(self._backbone().tokenizer, prompts, list(frame["chosen"]) + list(frame["rejected"]))
        rewards = self.member_rewards(texts, prompts=prompts)
        return self._scores(rewards[:, :n]), self._scores(rewards[:, n:])

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | os.PathLike) -> None:
        """Adapters (PEFT's layout: one folder per member, adapter_config.json + adapter_model.safetensors, which
        ``PeftModel.from_pretrained`` + ``load_adapter`` load) + heads (safetensors) + method.json; no base."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_dir(directory / "adapters", replace=True) as tmp:
            self.model.save_adapters(tmp)
        with atomic_path(directory / "heads.safetensors") as tmp:
            save_file({"weight": self.head.detach().float().cpu().contiguous()}, str(tmp))
        extra = {"backbone": self._backbone().identity()} if self.encoder is not None else {}
        write_method_info(directory, self, members=self.member_names, **extra)

    # adapter_config.json fields that a saved ENS-LoRA adapter leaves empty (null, false, {} or []): each makes PEFT
    # allocate or do more than the LoRA of the hyperparameters (per-module ranks, copies of whole modules, repeated
    # layers, DoRA magnitudes, trainable tokens, initialisations from the base's weights, an imported module).
    # (auto_mapping, which PEFT's own save_pretrained writes, is read by AutoPeftModel only, never by PeftModel.)
    ADAPTER_FIELDS_UNSET = ("rank_pattern", "alpha_pattern", "modules_to_save", "layer_replication",
                            "megatron_config", "trainable_token_indices", "target_parameters",
                            "use_dora", "use_qalora", "use_bdlora", "loftq_config", "eva_config", "corda_config",
                            "arrow_config", "lora_ga_config", "kasa_config", "monteclora_config", "velora_config",
                            "alora_invocation_tokens", "layers_to_transform", "layers_pattern", "fan_in_fan_out")

    def _check_adapter_config(self, config: dict, path: Path) -> None:
        """Refuse (one line naming the file and the field) an adapter config that is not the LoRA of these
        hyperparameters, before PEFT reads it."""
        fix = "refused before PEFT reads it; the run folder is damaged: copy it again or retrain"

        def refuse(field: str, value, why: str):
            raise UserError(one_line(f"{path}: field \"{field}\" is {value!r}; {why}; {fix}"))

        if config.get("peft_type") != "LORA":
            refuse("peft_type", config.get("peft_type"), "an ENS-LoRA adapter is LORA")
        rank = config.get("r")
        if type(rank) is not int or rank != self.lora_rank:
            refuse("r", rank, f"method.json says lora_rank={self.lora_rank}")
        alpha = config.get("lora_alpha")
        if type(alpha) not in (int, float) or float(alpha) != self.lora_alpha:
            refuse("lora_alpha", alpha, f"method.json says lora_alpha={self.lora_alpha:g}")
        dropout = config.get("lora_dropout", 0.0)
        if type(dropout) not in (int, float) or not 0 <= dropout < 1:
            refuse("lora_dropout", dropout, "must be a number in [0, 1)")
        if config.get("bias", "none") != "none":
            refuse("bias", config.get("bias"), "an ENS-LoRA adapter has no bias")
        if type(config.get("init_lora_weights", True)) is not bool:
            refuse("init_lora_weights", config.get("init_lora_weights"), "must be true or false")
        targets = config.get("target_modules")
        if not (isinstance(targets, str) or (isinstance(targets, list) and targets
                                             and all(isinstance(t, str) for t in targets))):
            refuse("target_modules", targets, "must be a module name or a list of them")
        for field in self.ADAPTER_FIELDS_UNSET:
            if config.get(field) not in (None, False, {}, []):
                refuse(field, config.get(field), "a saved ENS-LoRA adapter never sets it")

    def _expected_adapter(self, base, declared: dict) -> dict:
        """{tensor: Expected} of one member's ``adapter_model.safetensors``: for every LoRA module the file names,
        ``lora_A`` (r, in_features) and ``lora_B`` (out_features, r) of the base's Linear at that path (a name that is
        not a Linear of the base is left out, so the file is refused for holding it)."""
        from rewarduq_exp.models.multi_lora import PEFT_PREFIX

        expected = {}
        for key in declared:
            if not key.startswith(PEFT_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
                continue
            path = key[len(PEFT_PREFIX):-len(".lora_A.weight")]
            try:
                module = base.get_submodule(path)
            except AttributeError:
                continue
            if not isinstance(module, nn.Linear):
                continue
            why = f"lora_rank={self.lora_rank} and the Linear {path} of model '{self._backbone().name}'"
            r = self.lora_rank
            expected[f"{PEFT_PREFIX}{path}.lora_A.weight"] = Expected((r, module.in_features), "f", why)
            expected[f"{PEFT_PREFIX}{path}.lora_B.weight"] = Expected((module.out_features, r), "f", why)
        return expected

    def load(self, directory: str | os.PathLike) -> EnsLoRA:
        from peft import PeftModel

        directory = Path(directory)
        info = read_method_info(directory, self.name)
        members = info.get("members")
        if members != self.member_names:
            # The folder names come from the file: anything but the members this method saves (m0, m1, ...) could
            # point outside the run folder.
            raise UserError(one_line(f"{directory / 'method.json'}: field \"members\" is {members!r}; a saved "
                                     f"{self.name} with num_members={self.num_members} has {self.member_names}"))
        saved_bb = info.get("backbone", {}).get("name") if isinstance(info.get("backbone"), dict) else None
        if saved_bb is not None and saved_bb != self._backbone().name:
            raise UserError(f"{directory} was trained on backbone '{saved_bb}', not model={self._backbone().name}")
        # Every file PEFT reads is checked first: a missing or cut-short adapter is one line naming it, before the
        # base model is loaded, and PEFT never falls back to the hub or to a pickled adapter_model.bin. An adapter
        # config must describe the LoRA of these hyperparameters (rank, alpha) and nothing PEFT would act on beyond
        # it (other ranks per module, extra modules, imports): PEFT allocates what the config says.
        adapters = directory / "adapters"
        for name in members:
            config_path = adapters / name / "adapter_config.json"
            self._check_adapter_config(read_json_object(config_path, f"adapter of member {name}"), config_path)
            check_safetensors(adapters / name / "adapter_model.safetensors")
        heads_path = directory / "heads.safetensors"
        heads = load_safetensors(heads_path, expected={"weight": Expected(
            (self.num_members, AtMost(MAX_FEATURE_DIM)), "f", f"num_members={self.num_members}, at most "
            f"{MAX_FEATURE_DIM} features")})
        base, _ = self._load_base(with_score_head=False)  # the trained heads replace any pretrained one
        hidden = int(base.config.hidden_size)
        if heads["weight"].shape[1] != hidden:
            raise UserError(one_line(f"{heads_path}: tensor 'weight' has shape {tuple(heads['weight'].shape)}, but "
                                     f"model '{self._backbone().name}' has hidden size {hidden}; the run folder is "
                                     "damaged or was trained on another backbone"))
        for name in members:  # each LoRA tensor's shape, from the rank and the base's Linear it belongs to
            weights = adapters / name / "adapter_model.safetensors"
            check_tensors(weights, self._expected_adapter(base, declared_tensors(weights)))
        # Local folders only, loaded as safetensors: nothing is executed. PEFT reads its own format (run folders of
        # either implementation), then the weights move into the stacked module.
        peft_model = None
        for name in members:
            try:
                if peft_model is None:
                    with quiet_peft():
                        peft_model = PeftModel.from_pretrained(base, str(adapters / name), adapter_name=name)
                else:
                    peft_model.load_adapter(str(adapters / name), adapter_name=name)
            except ValueError as err:  # PEFT's NoMatchingPeftModuleError is a ValueError (its message: older PEFT)
                if "not found in the base model" not in str(err):
                    raise
                raise UserError(one_line(f"{adapters / name / 'adapter_config.json'}: field \"target_modules\" "
                                         f"names no layer of model '{self._backbone().name}' ({first_line(err)}); "
                                         "the run folder is damaged or was trained on another backbone")) from None
        self.model = from_peft(peft_model, members).to(self.device)
        self.head = nn.Parameter(heads["weight"].to(self.device), requires_grad=False)
        self.head_init_used = info.get("hyperparameters", {}).get("head_init_used")
        self.fit_summary = info.get("fit_summary", {})
        self._finish_model()
        return self
