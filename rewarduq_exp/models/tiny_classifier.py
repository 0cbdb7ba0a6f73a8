"""A tiny Skywork-style reward-model checkpoint (``Qwen3ForSequenceClassification``), built offline for tests.

Skywork-Reward-V2 checkpoints are sequence classifiers: transformer body + a 1-logit score head, no LM head. Methods
that need an LM head (MCD-DPO) must tie it to the input embeddings or refuse the checkpoint; this builder makes both
kinds from the tiny Qwen3 (same body weights, same tokenizer).
"""

from __future__ import annotations

import os
from pathlib import Path

from rewarduq_exp.core.atomic_write import atomic_dir
from rewarduq_exp.models.tiny_qwen3 import save_checkpoint


def build_tiny_sequence_classifier(causal_lm_dir: str | os.PathLike, target: str | os.PathLike, *,
                                   tie_word_embeddings: bool, seed: int = 0) -> Path:
    """Save a ``Qwen3ForSequenceClassification`` with the body of the causal LM at ``causal_lm_dir`` to ``target``."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen3ForCausalLM, Qwen3ForSequenceClassification

    target = Path(target)
    if (target / "config.json").exists():
        return target
    config = AutoConfig.from_pretrained(causal_lm_dir)
    config.num_labels = 1
    config.tie_word_embeddings = bool(tie_word_embeddings)
    config.architectures = ["Qwen3ForSequenceClassification"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForSequenceClassification(config)
    lm = Qwen3ForCausalLM.from_pretrained(causal_lm_dir)
    model.model.load_state_dict(lm.model.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(target) as tmp:
        save_checkpoint(model, tmp)
        AutoTokenizer.from_pretrained(causal_lm_dir).save_pretrained(tmp)
    return target
