"""A backbone's architecture without its weights: parameter counts and layer sizes, for planning a run.

The shapes of the paper's backbones ship as small ``config.json``-style files in ``conf/model/shapes/<model
name>.json`` (the fields of the checkpoints' own ``config.json`` that fix the architecture). The model is built from
such a config on PyTorch's ``meta`` device (``AutoModel*.from_config`` inside ``torch.device("meta")``): every
parameter has its real shape and no storage, so a 32B model is counted in about a second without loading or
allocating anything, and the counts are those of the very classes the methods train.

Where there is no shape file, the model's own ``config.json`` is read when the config names a local checkpoint
(``model.path``), and the offline tiny model (``builder: tiny-qwen3``) is described from its build settings.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.registry import CONF_DIR

SHAPES_DIR = CONF_DIR / "model" / "shapes"


@dataclass(frozen=True)
class Architecture:
    """What the planner needs to know about a decoder-only transformer (counts in elements, not bytes)."""

    name: str
    classifier: bool          # a sequence classifier checkpoint (Skywork-Reward-V2): no LM head of its own
    hidden: int               # d
    intermediate: int         # I, of the SwiGLU MLP
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool                # LM head = input embedding
    params_body: int          # the transformer (embedding included): what AutoModel holds
    params_causal_lm: int     # body + LM head (the head counted once when tied)
    lora_fan_sum: int         # sum over every Linear of the body of (in + out): a rank-r LoRA adds r * this

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def params_embedding(self) -> int:
        return self.vocab * self.hidden

    def lora_params(self, rank: int) -> int:
        """Parameters of one rank-``rank`` LoRA adapter on every Linear of the body (``target_modules=all-linear``)."""
        return rank * self.lora_fan_sum


def shape_config(model_cfg, cache_dir: str | Path | None = None) -> dict:
    """The ``config.json`` fields of the configured model, from a shape file, a local checkpoint or the tiny model's
    build settings; a one-line error when none is known."""
    name = str(model_cfg.name)
    path = SHAPES_DIR / f"{name}.json"
    if path.is_file():
        return json.loads(path.read_text())
    if model_cfg.get("builder") == "tiny-qwen3":
        from rewarduq_exp.models.tiny_qwen3 import checked_build

        return _tiny_config(checked_build(model_cfg.get("build")), cache_dir)
    local = model_cfg.get("path")
    if local and (Path(str(local)).expanduser() / "config.json").is_file():
        return json.loads((Path(str(local)).expanduser() / "config.json").read_text())
    known = sorted(p.stem for p in SHAPES_DIR.glob("*.json"))
    raise UserError(f"no architecture known for model '{name}': add conf/model/shapes/{name}.json (the checkpoint's "
                    f"config.json fields) or set model.path to a local checkpoint; shapes shipped: {', '.join(known)}")


def _tiny_config(build: dict, cache_dir) -> dict:
    """The tiny model's config: read from its built checkpoint when it is in the cache, else from the build settings
    (its tokenizer is trained at build time, so the vocabulary is then the configured upper bound)."""
    if cache_dir is not None:
        built = sorted((Path(cache_dir) / "models").glob("tiny-qwen3-*/build_spec.json"))
        for spec_path in built:
            spec = json.loads(spec_path.read_text())
            if all(spec.get(k) == v for k, v in build.items()):
                return json.loads((spec_path.parent / "config.json").read_text())
    hidden, heads = int(build.get("hidden_size", 256)), int(build.get("num_heads", 4))
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_hidden_layers": int(build.get("num_layers", 1)),
            "num_attention_heads": heads, "num_key_value_heads": int(build.get("num_kv_heads", heads)),
            "head_dim": hidden // heads, "vocab_size": int(build.get("vocab_size", 2048)),
            "tie_word_embeddings": True, "max_position_embeddings": 4096}


def architecture(model_cfg, cache_dir: str | Path | None = None) -> Architecture:
    """The :class:`Architecture` of the configured model (built on the meta device, cached per config)."""
    config = shape_config(model_cfg, cache_dir)
    return _architecture(str(model_cfg.name), json.dumps(config, sort_keys=True))


@functools.lru_cache(maxsize=32)
def _architecture(name: str, config_json: str) -> Architecture:
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    fields = json.loads(config_json)
    kind = fields.pop("model_type", "qwen3")
    fields.pop("architectures", None)
    classifier = any("ForSequenceClassification" in a for a in json.loads(config_json).get("architectures") or [])
    config = AutoConfig.for_model(kind, **fields)
    with torch.device("meta"):
        body = AutoModel.from_config(config)
        causal = AutoModelForCausalLM.from_config(config)
    lora_fan_sum = sum(m.in_features + m.out_features for m in body.modules() if isinstance(m, torch.nn.Linear))
    return Architecture(
        name=name, classifier=classifier, hidden=int(config.hidden_size), intermediate=int(config.intermediate_size),
        layers=int(config.num_hidden_layers), heads=int(config.num_attention_heads),
        kv_heads=int(config.num_key_value_heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
        vocab=int(config.vocab_size), tied=bool(getattr(config, "tie_word_embeddings", False)),
        params_body=sum(p.numel() for p in body.parameters()),
        params_causal_lm=sum(p.numel() for p in causal.parameters()),   # a tied head is one Parameter: counted once
        lora_fan_sum=int(lora_fan_sum))


def architecture_of_model(name: str, model) -> Architecture:
    """The :class:`Architecture` of a model already loaded (a headless body or a causal LM; any device and dtype):
    its config's sizes and its own parameter counts, for token budgets at run time."""
    import torch

    config = model.config
    body = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(body, getattr(body, "base_model_prefix", ""), body) if hasattr(body, "lm_head") else body
    params_body = sum(p.numel() for p in body.parameters())
    params_all = sum(p.numel() for p in model.parameters())
    lora_fan_sum = sum(m.in_features + m.out_features for m in body.modules() if type(m) is torch.nn.Linear)
    return Architecture(
        name=name, classifier=False, hidden=int(config.hidden_size), intermediate=int(config.intermediate_size),
        layers=int(config.num_hidden_layers), heads=int(config.num_attention_heads),
        kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
        vocab=int(config.vocab_size), tied=bool(getattr(config, "tie_word_embeddings", False)),
        params_body=params_body, params_causal_lm=max(params_all, params_body), lora_fan_sum=int(lora_fan_sum))
