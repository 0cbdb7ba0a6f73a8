"""Texts in and rewards out of a fine-tuned body: tokenisation of chat-template-rendered texts, the prompt tokens that
texts of one prompt share, right padding, last-token pooling and the autocast of the backbone's dtype.

The template already holds the special tokens and the data was length-filtered (``max_length``), so nothing is added
or truncated here.
"""

from __future__ import annotations

import numpy as np
import torch

from rewarduq_exp.data.contract import render_prompt_heads
from rewarduq_exp.models.shared_prefix import share_lengths


def tokenize(tokenizer, texts) -> list[list[int]]:
    return tokenizer(list(texts), add_special_tokens=False, truncation=False)["input_ids"]


def shareable(tokenizer, prompts, seqs: list[list[int]]) -> np.ndarray:
    """Per text, its leading tokens that its prompt accounts for: texts with one prompt share them."""
    return share_lengths(tokenizer, seqs, render_prompt_heads(tokenizer, prompts))


def pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of ``seqs`` right-padded: the last real token of row i sits at mask[i].sum() - 1."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids.to(device), mask.to(device)


def last_token(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The float32 state of each row's last real token (right padding)."""
    last = mask.sum(1) - 1
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()


def autocast(device: torch.device, dtype: torch.dtype):
    """Matmuls in the backbone's dtype (bf16 on GPU) while the LoRA weights and heads stay float32 (PEFT keeps
    adapters in float32 on a bf16 base). On CPU the backbone is float32 unless model.keep_dtype_on_cpu=true, which
    runs this same bf16 path there (the tests use it)."""
    if dtype != torch.float32:
        return torch.autocast(device.type, dtype=dtype)
    return torch.autocast(device.type, enabled=False)
