"""LA-LoRA: a Bayesian LoRA reward model (Yang et al. 2024, "Bayesian reward models for LLM alignment", after
Laplace-LoRA, Yang et al. 2023): one LoRA adapter + a linear reward head on the last real token, trained with the
Bradley-Terry loss exactly like one ENS-LoRA member (the fine-tuning base, :mod:`rewarduq_exp.methods.lora.method`:
the same loss, anchor, schedule, micro-batches, checkpoints), then a Laplace posterior over the adapter's and the
head's weights.

* The adapter is a plain PEFT LoRA (one ``default`` adapter), not the batched multi-LoRA module: its ``lora_A`` /
  ``lora_B`` are ``nn.Linear`` layers, the layers laplace-torch's Kronecker backends and the curvature hooks see.
  With the same seed its initial weights are ENS-LoRA member 0's, and so is its training (tested).
* Curvature: the K-FAC GGN of the BT likelihood at the trained weights over the training pairs
  (:mod:`~rewarduq_exp.methods.lora.kfac`: laplace-torch's "kron" K-FAC on the real tokens), each text weighted by
  w^2 = p (1 - p) x its pair's weight, p from a reward pass over the pairs. Posterior precision H + delta I with a
  zero prior mean; delta = ``prior_precision``: a number, or ``marglik``, the maximiser of the Laplace evidence
  (:class:`~rewarduq_exp.methods.posteriors.KronPosterior`).
* Scoring: the linearised (GLM) predictive, reward = r(theta*), u = sqrt(J P^-1 J^T), bounds reward ± beta u; J
  from one backward per batch of texts, its blocks taken by laplace-torch's ``KronDecomposed`` as backward makes them.
  Texts run in plain forwards (a prompt shared between texts would mix their Jacobians).

Saved: the adapter in PEFT's layout (``adapter/``), the head (``head.safetensors``), the posterior's
eigendecompositions and prior precision (``laplace.safetensors``, checked against the shapes the adapter's layers
give before it is read) and method.json; nothing pickled, no code from the folder.
"""

from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn

import rewarduq_exp.methods.lora.adapters as adapters  # the module, not the package __init__
import rewarduq_exp.methods.lora.texts as texts  # the module, not the package __init__
from rewarduq_exp.core import distributed, heap
from rewarduq_exp.core.atomic_write import atomic_dir, atomic_path
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.progress import progress
from rewarduq_exp.core.saved_files import check_safetensors, load_safetensors
from rewarduq_exp.data.contract import render_all
from rewarduq_exp.methods.base import Scores, bradley_terry_nll
from rewarduq_exp.methods.lora.body import fresh_head, member_seed
from rewarduq_exp.methods.lora.kfac import KroneckerFactors, RowJacobians
from rewarduq_exp.methods.lora.la_lora_memory import JACOBIAN_COPIES, laplace_tokens
from rewarduq_exp.methods.lora.method import LoRARewardMethod, LoRASettings
from rewarduq_exp.methods.posteriors import KronPosterior, prior_precision_setting, require_laplace
from rewarduq_exp.methods.settings import setting
from rewarduq_exp.models.multi_lora import quiet_peft
from rewarduq_exp.models.shared_prefix import token_batches

ADAPTER, HEAD, LAPLACE = "adapter", "head.safetensors", "laplace.safetensors"


class RewardNetwork(nn.Module):
    """The PEFT body and the head as one module, so that the curvature hooks and laplace-torch see the same Linear
    layers in the same order (the adapter's, in module order, then ``head``). Called with a batch dict
    (``input_ids``, ``attention_mask``; laplace-torch's dict inputs): rewards (rows, 1), or with ``labels`` (a pair
    batch, rows = its chosen texts, then its rejected ones) laplace-torch's reward-modelling logits (pairs, 2) =
    (r_rejected, r_chosen), label 1 = the chosen one preferred."""

    def __init__(self, body: nn.Module, head: nn.Linear, autocast):
        super().__init__()
        self.body, self.head = body, head
        self._autocast = autocast

    def rewards(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            hidden = self.body(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        return self.head(texts.last_token(hidden, mask))[:, 0]

    def forward(self, batch: dict) -> torch.Tensor:
        r = self.rewards(batch["input_ids"], batch["attention_mask"])
        if "labels" not in batch:
            return r[:, None]
        n = r.shape[0] // 2
        return torch.stack([r[n:], r[:n]], 1)


@dataclass(kw_only=True)
class LaLoRASettings(LoRASettings, config="la_lora"):
    """Defaults and comments: ``conf/method/la_lora.yaml``."""

    prior_precision: str | float = setting(check=prior_precision_setting(), doc="marglik or a number > 0")


class LaLoRA(LoRARewardMethod):
    name = "la_lora"
    label = "LA-LoRA"

    settings_class = LaLoRASettings

    def __init__(self, encoder=None, **values):
        """``values``: the settings (:class:`LaLoRASettings`: those of every LoRA reward model and
        ``prior_precision``, ``marglik`` or a number > 0; module docstring)."""
        super().__init__(encoder, **values)
        self.network: RewardNetwork | None = None
        self.posterior: KronPosterior | None = None

    @classmethod
    def plan_memory(cls, ctx):
        from rewarduq_exp.methods.lora.la_lora_memory import plan

        return plan(ctx)

    # ------------------------------------------------------------------ building
    def _build(self) -> None:
        from peft import get_peft_model

        require_laplace()   # before any work: one line naming the install command
        self.head_init_used = self._resolve_head_init()
        base, pretrained = self._load_base(self.head_init_used == "pretrained")
        with torch.random.fork_rng(devices=[]):   # ENS-LoRA member 0's seed: its initial LoRA A and head
            torch.manual_seed(member_seed(self.seed, 0))
            with quiet_peft():
                peft_model = get_peft_model(base, self._lora_config())
        d = int(base.config.hidden_size)
        weight = pretrained[0].clone() if pretrained is not None else fresh_head(d, member_seed(self.seed, 0) + 1)
        self._attach(peft_model, weight)

    def _attach(self, peft_model, head_weight: torch.Tensor) -> None:
        head = nn.Linear(head_weight.shape[0], 1, bias=False)
        with torch.no_grad():
            head.weight.copy_(head_weight[None])
        self.model = peft_model.to(self.device)
        self.network = RewardNetwork(self.model, head.to(self.device), self._autocast)
        self.head = self.network.head.weight   # (1, d): the base's member-stacked heads, K = 1
        self._finish_model()

    def _lora_weights(self) -> list[nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if "lora_" in n]

    def _lora_stacked(self) -> list[torch.Tensor]:
        return [p.unsqueeze(0) for p in self._lora_weights()]

    def _trainable(self) -> list[nn.Parameter]:
        return [*self._lora_weights(), self.head]

    def _layers(self) -> dict[str, nn.Linear]:
        """The trained Linear layers, laplace-torch's block order (:class:`RewardNetwork`)."""
        trained = {id(p) for p in self._trainable()}
        return {name: m for name, m in self.network.named_modules()
                if isinstance(m, nn.Linear) and id(m.weight) in trained}

    def _finish_model(self) -> None:
        super()._finish_model()
        self.network.requires_grad_(False)

    # ------------------------------------------------------------------ training
    def _micro_backward(self, ids, mask, rows, w, b: int, mixed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        # ENS-LoRA's pass of one member (its per-member path), K = 1
        bt, center = self._pairs_backward(self._pooled(ids, mask, None, shared=rows) @ self.head[0], b, w)
        return bt[None], center[None]

    # ------------------------------------------------------------------ the Laplace posterior
    def _pass_tokens(self, longest: int, jacobians: bool) -> int:
        """Token positions per forward + backward of a Laplace pass (la_lora_memory.laplace_tokens, as planned)."""
        from rewarduq_exp.models import token_budget
        from rewarduq_exp.models.shapes import architecture_of_model

        if self.score_batch_tokens != "auto":
            return self.score_batch_tokens
        a = architecture_of_model(self._backbone().name, self.model)
        act = torch.finfo(self._backbone().dtype).bits // 8
        largest = max(m.weight.numel() for m in self._layers().values())
        row_bytes = JACOBIAN_COPIES * 4.0 * largest if jacobians else 0.0
        return laplace_tokens(a, longest, act, self.device.type != "cuda", self.device.type,
                              token_budget.free_bytes(self.device), 0.0, row_bytes)

    def _grad_passes(self, seqs, jacobians: bool) -> list[np.ndarray]:
        """Batches of texts for passes with a backward: plain forwards, longest first, the token budget."""
        if self.device.type == "cpu":
            heap.return_large_frees_to_os()   # the budget counts on one pass's frees being free for the next
        tokens = self._pass_tokens(max(map(len, seqs)), jacobians)
        return token_batches(seqs, np.zeros(len(seqs), dtype=np.int64), tokens, self.score_batch_size)

    @torch.no_grad()
    def _rewards(self, seqs, shared) -> torch.Tensor:
        """(N,) float64 rewards at the trained weights (prompts shared where given)."""
        out = torch.empty(len(seqs), dtype=torch.float64)
        for idx in self._score_batches(seqs, shared, 1):
            ids, mask = self._pad([seqs[j] for j in idx])
            r = self._pooled(ids, mask, None, None if shared is None else shared[idx]) @ self.head[0]
            out[torch.as_tensor(idx)] = r.double().cpu()
        return out

    def _curvature(self, chosen, rejected, shared, weight_all: torch.Tensor):
        """({layer: (G, A)}, log-likelihood of the pairs at the trained weights): this process's pairs (every
        world-th), summed over the processes."""
        world, me = distributed.world_size(), distributed.rank()
        pairs = np.arange(me, len(chosen), world)
        seqs = [chosen[i] for i in pairs] + [rejected[i] for i in pairs]
        rows = None if shared is None else np.concatenate([shared[0][pairs], shared[1][pairs]])
        r = self._rewards(seqs, rows) if seqs else torch.zeros(0, dtype=torch.float64)   # fewer pairs than processes
        n = len(pairs)
        margin, weight = r[:n] - r[n:], weight_all[torch.as_tensor(pairs)].double()
        p = torch.sigmoid(margin)
        row_weight = (weight * p * (1 - p)).sqrt().repeat(2).float().to(self.device)
        log_lik = -(weight * bradley_terry_nll(margin)).sum().reshape(1)
        params = self._trainable()
        factors = KroneckerFactors(self._layers())   # allocated before the budget: the passes fit beside them
        for p_ in params:
            p_.requires_grad_(True)
        try:
            for idx in progress(self._grad_passes(seqs, jacobians=False) if seqs else [], desc=f"{self.name} curvature",
                                unit="batches", show=self.show_progress, quiet=not distributed.is_main()):
                ids, mask = self._pad([seqs[j] for j in idx])
                with torch.enable_grad(), factors.recording(mask):
                    r_rows = self.network.rewards(ids, mask)
                    torch.autograd.grad((r_rows * row_weight[torch.as_tensor(idx, device=self.device)]).sum(),
                                        params)
        finally:
            for p_ in params:
                p_.requires_grad_(False)
        if world > 1:
            import torch.distributed as dist

            factors.sum_over_processes()
            log_lik = log_lik.to(self.device)
            dist.all_reduce(log_lik)
        return factors.factors(), float(log_lik.item())

    def _after_training(self, chosen, rejected, shared, weight_all: torch.Tensor) -> None:
        t0 = time.perf_counter()
        factors, log_lik = self._curvature(chosen, rejected, shared, weight_all)
        self.posterior = KronPosterior.from_factors(factors)
        theta_sq = float(sum(p.double().pow(2).sum() for p in self._trainable()))
        self.posterior.apply_prior_precision(self.prior_precision, theta_sq)   # the number, or marglik's
        evidence, effective = self.posterior.log_evidence(log_lik, theta_sq), self.posterior.effective_parameters()
        self.fit_summary.update({
            "laplace_parameters": int(sum(p.numel() for p in self._trainable())),
            "laplace_blocks": len(self.posterior.blocks), "prior_precision_used": self.posterior.prior_precision,
            "log_marginal_likelihood": evidence, "effective_parameters": effective, "train_log_likelihood": log_lik,
            "seconds_laplace": time.perf_counter() - t0})

    # ------------------------------------------------------------------ scoring
    def reward_and_u(self, seqs) -> tuple[np.ndarray, np.ndarray]:
        """(reward, u) of tokenised texts: r at the trained weights and the linearised predictive's standard
        deviation (module docstring)."""
        if self.posterior is None:
            raise RuntimeError("LA-LoRA is not trained or loaded yet (call fit or load)")
        reward, var = np.zeros(len(seqs)), np.zeros(len(seqs))
        if not seqs:
            return reward, var
        params, layers = self._trainable(), self._layers()
        parts: dict[str, torch.Tensor] = {}   # per block, summed in block order (not as backward reaches them)
        jacobians = RowJacobians(layers, lambda name, j: parts.__setitem__(name,
                                                                          self.posterior.block_variance(name, j)))
        for p in params:
            p.requires_grad_(True)
        try:
            for idx in progress(self._grad_passes(seqs, jacobians=True), desc=f"{self.name} scoring",
                                unit="batches", show=self.show_progress, quiet=not distributed.is_main()):
                ids, mask = self._pad([seqs[j] for j in idx])
                parts.clear()
                with torch.enable_grad(), jacobians.recording():
                    r = self.network.rewards(ids, mask)
                    torch.autograd.grad(r.sum(), params)
                reward[idx] = r.detach().double().cpu().numpy()
                var[idx] = torch.stack([parts[name] for name in layers]).double().sum(0).cpu().numpy()
        finally:
            for p in params:
                p.requires_grad_(False)
        return reward, np.sqrt(np.clip(var, 0.0, None))

    def score(self, prompts, completions) -> Scores:
        text_list = render_all(self._backbone().tokenizer, list(prompts), list(completions))
        reward, u = self.reward_and_u(self._tokenize(text_list))
        return Scores(reward=reward, u=u, beta=self.beta)

    def score_pairs(self, frame: pd.DataFrame) -> tuple[Scores, Scores]:
        """Chosen and rejected scores of a preference frame, in one length-sorted pass over both."""
        n = len(frame)
        reward, u = self.reward_and_u(self._tokenize(render_all(
            self._backbone().tokenizer, list(frame["prompt"]) * 2, list(frame["chosen"]) + list(frame["rejected"]))))
        return (Scores(reward=reward[:n], u=u[:n], beta=self.beta),
                Scores(reward=reward[n:], u=u[n:], beta=self.beta))

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | os.PathLike) -> None:
        """The adapter in PEFT's layout (adapter/adapter_config.json + adapter_model.safetensors, which
        ``PeftModel.from_pretrained`` loads), the head and the posterior as safetensors, method.json; no base."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_dir(directory / ADAPTER, replace=True) as tmp:
            state = get_peft_model_state_dict(self.model)
            save_file({k: v.detach().cpu().contiguous() for k, v in state.items()},
                      str(Path(tmp) / adapters.WEIGHTS), metadata={"format": "pt"})
            config = copy.deepcopy(self.model.peft_config["default"])
            config.inference_mode = True
            config.save_pretrained(str(tmp))
        with atomic_path(directory / HEAD) as tmp:
            save_file({"weight": self.head.detach().float().cpu().contiguous()}, str(tmp))
        with atomic_path(directory / LAPLACE) as tmp:
            save_file(self.posterior.tensors(), str(tmp))
        self._write_info(directory)

    heads_file = HEAD

    def load(self, directory: str | os.PathLike) -> LaLoRA:
        require_laplace()
        return super().load(directory)

    def _saved_adapters(self, info: dict, directory: Path) -> dict[str, Path]:
        return {"default": directory / ADAPTER}

    def _adapter_what(self, name: str) -> str:
        return "the LA-LoRA adapter"

    def _check_saved_files(self, directory: Path) -> None:
        check_safetensors(directory / LAPLACE)

    def _attach_saved(self, peft_model, heads: torch.Tensor, directory: Path) -> None:
        self._attach(peft_model, heads[0])
        layers = self._layers()
        why = f"lora_rank={self.lora_rank} on model '{self._backbone().name}'"
        tensors = load_safetensors(directory / LAPLACE, expected=KronPosterior.expected(
            {name: (m.out_features, m.in_features) for name, m in layers.items()}, why))
        delta = float(tensors["prior_precision"][0])
        if not 0 < delta < math.inf:
            raise UserError(f"{directory / LAPLACE}: tensor 'prior_precision' is {delta!r}, not a number > 0; the run "
                            "folder is damaged: copy it again or retrain")
        self.posterior = KronPosterior.from_tensors(tensors, list(layers), self.device)
