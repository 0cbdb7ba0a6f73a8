"""ENS-LoRA: an ensemble of K LoRA adapters on one frozen backbone, each with its own linear reward head
(RewardUQ section 4.2, Appendix B.2).

What the members share with every LoRA reward model (settings, body and head initialisation, tokenisation with the
prompts shared, micro-batches, the training loop, the anchor, the data-parallel all-reduce, scoring batches, adapter
checks) is the fine-tuning base, :mod:`rewarduq_exp.methods.lora`. This module holds what is ensemble-specific.

All K members live on ONE frozen base model as a batched multi-LoRA module
(:mod:`rewarduq_exp.models.multi_lora`): PEFT builds the adapters (``get_peft_model`` + ``add_adapter``, each member
under its own seed) and their weights move into stacked tensors. Members differ from the start: member k's LoRA A
matrices and head come from a seed derived from (seed, k). (LoRA B starts at zero, so with a pretrained Skywork head
all members start from the same rewards and diverge through their different A matrices.)

The ensemble's loss is the SUM of the member losses (RewardUQ eq. 11 each), so each member gets exactly the gradient
of its own independent run (the authors trained each member in its own run); gradients are clipped per member
(``max_grad_norm``, the HF Trainer default 1.0 the authors trained with). Every member sees the same minibatch (one
job trains the whole ensemble).

One forward serves all members (``mixed_adapter_training`` / ``mixed_adapter_scoring``: "all members in one batched
forward"): the batch is replicated K times member-major, every frozen base projection runs once over the K x B rows
and the K low-rank updates run as one batched matmul over the stacked adapters. Otherwise each member runs its own
pass of B rows (one backward per member in training). Both give the same rewards and gradients (the tests check them
against PEFT's ``set_adapter`` passes), in train mode, with LoRA dropout and with activation checkpointing (the
routing is kept for the recomputation). Both settings default to ``auto``: the batched forward, except in training
where K members of one pair do not fit the device even checkpointed (:func:`~rewarduq_exp.methods.lora.memory.
choose_training`, which the planner calls too).

reward = mean over members, u = unbiased std over members, bounds reward ± beta * u (eq. 9).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn

from rewarduq_exp.core import distributed
from rewarduq_exp.core.atomic_write import atomic_dir, atomic_path
from rewarduq_exp.core.errors import UserError, one_line
from rewarduq_exp.core.progress import progress
from rewarduq_exp.core.setting_bounds import Bound
from rewarduq_exp.data.contract import render_all
from rewarduq_exp.methods.base import Scores
from rewarduq_exp.methods.lora.body import fresh_head, member_seed
from rewarduq_exp.methods.lora.memory import mixed_setting
from rewarduq_exp.methods.lora.method import LoRARewardMethod, LoRASettings
from rewarduq_exp.methods.settings import auto_flag, setting
from rewarduq_exp.models.multi_lora import MultiLoRAModel, from_peft, quiet_peft

__all__ = ["EnsLoRA", "member_seed"]


@dataclass(kw_only=True)
class EnsLoRASettings(LoRASettings, config="ens_lora"):
    """Defaults and comments: ``conf/method/ens_lora.yaml``."""

    num_members: int = setting(bound=Bound(2, 256, "members", "the paper's K is 8; each member is a LoRA adapter on "
                                           "every Linear of the backbone, with a replica of every batch"), doc="K")
    mixed_adapter_training: bool | str = setting(runtime=True, check=auto_flag, doc="all members in one batched "
                                                                                  "forward in training")
    mixed_adapter_scoring: bool | str = setting(runtime=True, check=auto_flag, doc="... and in scoring")


class EnsLoRA(LoRARewardMethod):
    name = "ens_lora"
    label = "ENS-LoRA"

    settings_class = EnsLoRASettings

    def __init__(self, encoder=None, **values):
        """``values``: the settings (:class:`EnsLoRASettings`; those of every LoRA reward model: rank, alpha,
        learning rate, anchor, batches, device, ...)."""
        super().__init__(encoder, **values)
        # auto = all members in one batched forward, on every device: it runs the FLOPs of K passes in larger GEMMs
        # and saves K-1 launches of every other op (in training also K-1 backward passes). scripts/bench_lora.py on a
        # 2-core CPU (K=8, the tiny Qwen3, batches of 16 texts or pairs): scoring 1.04-1.38x and training 1.57-1.84x
        # with the default 2 threads; on one thread training 1.09x but scoring 0.74-0.82x at 128 rows a forward (the
        # body's elementwise ops fall out of the cache; 1.63x at 32 rows). Memory is the micro-batch's business: a
        # batched micro-batch of m pairs holds what one member's pass of K x m pairs holds (the token budget).
        training = self.settings.mixed_adapter_training
        self.mixed_adapter_training = mixed_setting(training, "method.mixed_adapter_training")
        # auto also falls back to one member per pass where K members of one pair do not fit even checkpointed
        self._mixed_training_auto = training == "auto"
        self.mixed_adapter_scoring = mixed_setting(self.settings.mixed_adapter_scoring, "method.mixed_adapter_scoring")
        self.model: MultiLoRAModel | None = None  # the frozen body with the K members' stacked LoRA weights

    @classmethod
    def plan_memory(cls, ctx):
        from rewarduq_exp.methods.ens_lora_memory import plan

        return plan(ctx)

    @property
    def member_names(self) -> list[str]:
        return [f"m{k}" for k in range(self.num_members)]

    def _summary_members(self) -> dict:
        return {"num_members": self.num_members}

    # ------------------------------------------------------------------ building
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
                heads.append(fresh_head(d, member_seed(self.seed, k) + 1))
        self.model = from_peft(peft_model, self.member_names)
        self.head = nn.Parameter(torch.stack(heads).to(self.device))
        self._finish_model()

    def _lora_stacked(self) -> list[torch.Tensor]:
        return self.model.lora_parameters()

    def _trainable(self) -> list[nn.Parameter]:
        return [*self.model.lora_parameters(), self.head]

    def _lora_params(self) -> list[list[torch.Tensor]]:
        """Per member, its LoRA weights (views of the stacked tensors, PEFT's shapes and order)."""
        return [self.model.member_parameters(k) for k in range(self.num_members)]

    def _set_checkpointing(self, on: bool) -> None:
        self.model.checkpointing(on)   # the routing of each checkpointed layer is kept for its recomputation

    # ------------------------------------------------------------------ forward
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
    def _micro_backward(self, ids, mask, rows, w, b: int, mixed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if mixed:   # all K members in one forward and one backward
            return self._pairs_backward(self.member_rewards_ids(ids, mask, mixed=True, shared=rows), b, w)  # (K, 2b)
        # one pass (and one backward) per member: its 2b rows under member k only
        parts = [self._pairs_backward(self._pooled(ids, mask, [name] * (2 * b), shared=rows) @ self.head[k], b, w)
                 for k, name in enumerate(self.member_names)]
        return torch.stack([bt for bt, _ in parts]), torch.stack([center for _, center in parts])

    def _clip(self):
        return self._clip_per_member

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
        batches = self._score_batches(seqs, shared, self.num_members if mixed else 1)
        out = torch.empty(self.num_members, len(seqs), dtype=torch.float64)
        for idx in progress(batches, desc=f"{self.name} scoring", unit="batches", show=self.show_progress,
                            quiet=not distributed.is_main()):
            ids, mask = self._pad([seqs[j] for j in idx])
            rows = None if shared is None else shared[idx]
            out[:, torch.as_tensor(idx)] = self.member_rewards_ids(ids, mask, mixed, rows).double().cpu()
        return out

    def _scores(self, rewards: torch.Tensor) -> Scores:
        reward = rewards.mean(0).numpy()
        u = rewards.std(0, unbiased=True).numpy()
        return Scores(reward=reward, u=u, beta=self.beta)

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
        with atomic_path(directory / self.heads_file) as tmp:
            save_file({"weight": self.head.detach().float().cpu().contiguous()}, str(tmp))
        self._write_info(directory, members=self.member_names)

    def _saved_adapters(self, info: dict, directory: Path) -> dict[str, Path]:
        members = info.get("members")
        if members != self.member_names:
            # The folder names come from the file: anything but the members this method saves (m0, m1, ...) could
            # point outside the run folder.
            raise UserError(one_line(f"{directory / 'method.json'}: field \"members\" is {members!r}; a saved "
                                     f"{self.name} with num_members={self.num_members} has {self.member_names}"))
        return {name: directory / "adapters" / name for name in members}

    def _attach_saved(self, peft_model, heads: torch.Tensor, directory: Path) -> None:
        # the weights move from PEFT's layout into the stacked module
        self.model = from_peft(peft_model, self.member_names).to(self.device)
        self.head = nn.Parameter(heads.to(self.device), requires_grad=False)
        self._finish_model()
