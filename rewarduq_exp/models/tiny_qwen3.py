"""The tiny offline backbone (``model=tiny-qwen3``): a random-init Qwen3 and a locally trained tokenizer.

Nothing is downloaded. The tokenizer is a byte-level BPE trained on a fixed corpus (the synthetic world's words plus
a little English) with a ChatML template; pad (``<|endoftext|>``) is distinct from eos (``<|im_end|>``) because
last-token pooling must never mistake the final ``<|im_end|>`` for padding. The weights come
from a seeded init, so every machine builds the identical model. The result is saved once, like a hub checkpoint,
under the cache folder and loaded with the same ``from_pretrained`` code path as real backbones.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from filelock import FileLock

from rewarduq_exp.core.atomic_write import atomic_dir
from rewarduq_exp.data.vocabulary import TOPIC_WORDS, WORDS

# Bump when the build below changes: it is part of the cache key of every feature computed with this model.
BUILD_VERSION = 2

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_ENGLISH = (
    "The quick brown fox jumps over the lazy dog. You are a helpful assistant. Please answer the question "
    "below carefully and explain your reasoning step by step. Thank you, that is a good point. "
    "What is the capital of France? Paris is the capital of France. Write a short poem about the sea. "
    "Human: Assistant: user assistant system topic reply write about"
)


def _corpus() -> list[str]:
    # Each synthetic word is repeated so BPE merges it into a single token, in both forms it takes in a rendered
    # conversation: after a space ("Ġword") and at the start of a line (the first word of a completion follows the
    # template's "\n"). The synthetic world's per-token utilities then map one-to-one onto backbone tokens.
    words = WORDS + TOPIC_WORDS
    lines = [" " + " ".join(words[i : i + 16]) for i in range(0, len(words), 16)] * 20
    lines += ["\n".join(words)] * 20
    lines += [_ENGLISH] * 5
    return lines


def build_tokenizer(vocab_size: int = 2048):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        padding_side="right",
    )


def model_config_dict(tokenizer, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )


def _soften_attention(model, temperature: float) -> None:
    """Scale the q/k RMSNorm gains so that attention at init is close to uniform.

    Qwen3 normalises queries and keys per head, so at random init the attention logits have a standard deviation of
    about 1 whatever the weight scale: each position attends to a random, content-dependent subset of tokens and the
    last-token state scrambles the completion. With gains of ``sqrt(temperature)`` the logits shrink by
    ``temperature`` and the last token summarises its whole context, as a trained model's does, which is what makes
    the synthetic world learnable from these features.
    """
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.fill_(temperature**0.5)
            layer.self_attn.k_norm.weight.fill_(temperature**0.5)


def build_spec(hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, seed: int, vocab_size: int,
               attention_temperature: float) -> dict:
    """Everything that determines the tiny model's numbers (its identity in every cache key)."""
    return dict(
        build_version=BUILD_VERSION,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        seed=seed,
        vocab_size=vocab_size,
        attention_temperature=attention_temperature,
        words=hashlib.sha1("\n".join(WORDS + TOPIC_WORDS).encode()).hexdigest()[:12],
    )


def save_checkpoint(model, folder: Path) -> None:
    """``config.json`` + ``model.safetensors`` that ``from_pretrained`` reads, written by THIS process.

    Not ``model.save_pretrained``: in transformers 5 it silently writes no weights on a rank other than 0 once
    torch.distributed is initialised, and under torchrun whichever rank takes the build lock first builds the model.
    """
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied to embed_tokens (which headless loaders need): stored once
    model.config.save_pretrained(folder)
    save_file(state, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})


def checked_build(build) -> dict:
    """``model.build`` of a config (the command line's or a handed run's) as keyword arguments of
    :func:`ensure_tiny_qwen3`: only its own settings, each a number; anything else is one line naming the allowed
    keys (a run folder's config is foreign input: a key such as ``_target_`` must never reach a call)."""
    import inspect

    from rewarduq_exp.core.errors import UserError

    allowed = [name for name, p in inspect.signature(ensure_tiny_qwen3).parameters.items()
               if p.kind is inspect.Parameter.KEYWORD_ONLY]
    out = {}
    for key, value in dict(build or {}).items():
        if str(key) not in allowed:
            raise UserError(f"model.build.{key} is not a setting of the tiny model; allowed: {', '.join(allowed)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"model.build.{key}={value!r} is invalid; it must be a number")
        out[str(key)] = value
    return out


def ensure_tiny_qwen3(
    cache_dir: str | os.PathLike,
    *,
    hidden_size: int = 256,
    num_layers: int = 1,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    seed: int = 0,
    vocab_size: int = 2048,
    attention_temperature: float = 0.01,
) -> Path:
    """Build the tiny checkpoint once (under a lock, written atomically) and return its folder."""
    spec = build_spec(hidden_size, num_layers, num_heads, num_kv_heads, seed, vocab_size, attention_temperature)
    digest = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    root = Path(cache_dir) / "models"
    target = root / f"tiny-qwen3-{digest}"
    if (target / "build_spec.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "build_spec.json").exists():
            return target
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        tokenizer = build_tokenizer(vocab_size)
        config = Qwen3Config(**model_config_dict(tokenizer, hidden_size=hidden_size, num_layers=num_layers,
                                                 num_heads=num_heads, num_kv_heads=num_kv_heads))
        # fork_rng: building the model must not move the caller's global RNG stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(config)
            _soften_attention(model, attention_temperature)
        with atomic_dir(target) as tmp:
            save_checkpoint(model, tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / "build_spec.json").write_text(json.dumps(spec, indent=1, sort_keys=True))
    return target
