"""The frozen backbone body a LoRA reward model fine-tunes, its LoRA configuration and the initial linear reward
heads.

The reward of a text is a linear head on the final hidden state (after the last RMSNorm) of its last real token, so
the body is loaded headless (``AutoModel``) and frozen; a Skywork-style checkpoint (``...ForSequenceClassification``
with one logit) also gives its pretrained score weight, which ``head_init=pretrained`` starts every head from.
"""

from __future__ import annotations

import math

import torch

from rewarduq_exp.core.errors import UserError

HEAD_INITS = ("auto", "pretrained", "fresh")


def resolve_head_init(head_init: str, backbone) -> str:
    """``auto``: Skywork's pretrained score head for ``skywork-*`` backbones, else a fresh head."""
    if head_init != "auto":
        return head_init
    return "pretrained" if backbone.name.startswith("skywork-") else "fresh"


def load_body(backbone, method: str, device, with_score_head: bool):
    """(the frozen transformer body on ``device``, the checkpoint's (1, d) score weight or None)."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    backbone.require_decoder(method)  # last-token rewards need a causal body (an encoder's last token sees all)
    if with_score_head:
        seq = backbone.from_pretrained(AutoModelForSequenceClassification, dtype=backbone.dtype)
        score = getattr(seq, "score", None)
        if score is None or score.weight.shape[0] != 1:
            raise UserError(f"method.head_init=pretrained needs a single-output sequence classifier, but model "
                            f"'{backbone.name}' has no 1-logit score head; use method.head_init=fresh")
        weight = score.weight.detach().float().clone()
        base = getattr(seq, seq.base_model_prefix)
    else:
        base, weight = backbone.from_pretrained(AutoModel, dtype=backbone.dtype), None
    base.requires_grad_(False)
    return base.to(device), weight


def lora_config(rank: int, alpha: float, dropout: float, target_modules):
    """PEFT's LoRA of these settings on a headless body (no task type: the reward head is ours, not PEFT's)."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, bias="none")


def fresh_head(d: int, seed: int) -> torch.Tensor:
    """A (d,) head drawn Xavier-normal for a (d -> 1) layer from ``seed``: initial rewards of order 1."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d, generator=g) * math.sqrt(2.0 / (d + 1))


def member_seed(seed: int, k: int) -> int:
    """The seed of member k's LoRA A initialisation (its head's is this + 1)."""
    return (int(seed) * 1_000_003 + 7919 * (k + 1)) % (2**31 - 1)
