"""The tiny offline backbone: a reproducible checkpoint, a tokenizer fit for the synthetic world, Backbone loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.hashing import stable_hash
from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.data.vocabulary import WORDS
from rewarduq_exp.models.backbone import Backbone
from rewarduq_exp.models.tiny_qwen3 import build_spec, ensure_tiny_qwen3


def build_kwargs(cfg) -> dict:
    return dict(cfg.build)


def weights(folder) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no safetensors in {folder}"
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


def vocab(folder) -> tuple[dict, list]:
    model = json.loads((folder / "tokenizer.json").read_text())["model"]
    return model["vocab"], model["merges"]


# ---------------------------------------------------------------------------------------------- the checkpoint
def test_build_is_deterministic_across_cache_dirs(tmp_path, tiny_model_cfg):
    """Two independent builds give the same folder name, bit-identical weights and the same tokenizer.

    Feature caches are keyed by the build spec, so the same spec must mean the same numbers on every machine.
    """
    a = ensure_tiny_qwen3(tmp_path / "a", **build_kwargs(tiny_model_cfg))
    b = ensure_tiny_qwen3(tmp_path / "b", **build_kwargs(tiny_model_cfg))
    assert a.name == b.name and a != b
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and len(wa) > 5
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    assert vocab(a) == vocab(b)
    assert json.loads((a / "build_spec.json").read_text()) == build_spec(**build_kwargs(tiny_model_cfg))


def test_build_depends_on_seed(tmp_path, tiny_model_cfg):
    """A different seed is a different checkpoint (different folder and weights): the seed really seeds the init."""
    kw = build_kwargs(tiny_model_cfg)
    a = ensure_tiny_qwen3(tmp_path, **kw)
    b = ensure_tiny_qwen3(tmp_path, **(kw | {"seed": kw["seed"] + 1}))
    assert a != b
    wa, wb = weights(a), weights(b)
    key = next(k for k in wa if k.endswith("embed_tokens.weight"))
    assert not torch.equal(wa[key], wb[key])


def test_build_is_cached(tmp_path):
    """A second call finds the finished folder and does not rebuild it."""
    a = ensure_tiny_qwen3(tmp_path, hidden_size=32, num_heads=2, num_kv_heads=2)
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_qwen3(tmp_path, hidden_size=32, num_heads=2, num_kv_heads=2) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp
    assert (a / "build_spec.json").is_file()
    assert not list(tmp_path.glob("models/.tiny-qwen3-*"))  # no leftover temp folder


def test_attention_is_softened(tiny_backbone):
    """The q/k norm gains are sqrt(attention_temperature), as the build promises."""
    w = weights(Path(tiny_backbone.source))
    gains = [v for k, v in w.items() if k.endswith(("q_norm.weight", "k_norm.weight"))]
    assert gains
    for g in gains:
        assert torch.allclose(g, torch.full_like(g, 0.01 ** 0.5))


def test_build_does_not_move_global_rng(tmp_path):
    """Building the model runs under fork_rng: the caller's torch RNG stream is exactly where it was."""
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    ensure_tiny_qwen3(tmp_path, hidden_size=64, num_heads=2, num_kv_heads=2, seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    after_draw = torch.rand(3)
    torch.manual_seed(1234)
    assert torch.equal(torch.rand(3), after_draw)


# ---------------------------------------------------------------------------------------------- the tokenizer
def test_tokenizer_special_tokens(tokenizer):
    """pad is <|endoftext|>, distinct from eos <|im_end|>; right padding; a chat template is present."""
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.padding_side == "right"
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    for tok in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tokenizer.encode(tok, add_special_tokens=False)) == 1


def test_synthetic_words_mostly_single_tokens(tokenizer):
    """Inside a sentence (after a space) the world's words are single tokens; a sanity floor on the BPE merges."""
    singles = [w for w in WORDS[:64] if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1]
    assert len(singles) >= 60
    assert len(set(tokenizer.encode(" " + " ".join(singles), add_special_tokens=False))) == len(singles)


def test_every_synthetic_word_after_a_space_is_one_token(tokenizer):
    """Each of the 64 default words, preceded by a space, is exactly one token."""
    multi = [w for w in WORDS[:64] if len(tokenizer.encode(" " + w, add_special_tokens=False)) != 1]
    assert multi == []


def test_rendered_synthetic_completion_has_one_token_per_word(tokenizer):
    """The assistant part of a rendered synthetic pair has exactly one token per word (plus the template's tokens)."""
    f = SyntheticWorld(n_train=20, n_eval=1, n_ood=1).load("train")
    head = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for msgs in f["chosen"]:
        text = msgs[0]["content"]
        ids = tokenizer.encode("<|im_start|>assistant\n" + text + "<|im_end|>", add_special_tokens=False)
        assert len(ids) - len(head) - 1 == len(text.split(" ")), text


# ---------------------------------------------------------------------------------------------- Backbone
def test_load_encoder_is_frozen_eval_with_configured_hidden_size(tiny_backbone, tiny_model_cfg, tokenizer):
    """The encoder is headless, frozen, in eval mode, float32 on CPU, and its hidden size is the configured one."""
    model = tiny_backbone.load_encoder()
    assert not model.training
    params = list(model.parameters())
    assert params and not any(p.requires_grad for p in params)
    assert model.config.hidden_size == tiny_model_cfg.hidden_size == 256
    assert params[0].dtype == torch.float32 and params[0].device.type == "cpu"
    assert not hasattr(model, "lm_head")
    ids = tokenizer("<|im_start|>user\n baba<|im_end|>", return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model(**ids).last_hidden_state
    assert out.shape == (1, ids["input_ids"].shape[1], 256)
    assert torch.isfinite(out).all()


def test_load_encoder_rejects_wrong_hidden_size(cache_dir, tiny_model_cfg, tiny_backbone):
    """A model.hidden_size that disagrees with the checkpoint is a UserError, not a silent shape bug later."""
    cfg = OmegaConf.merge(tiny_model_cfg, {"hidden_size": 128})
    with pytest.raises(UserError, match=r"model\.hidden_size=128 .*hidden size 256"):
        Backbone(cfg, cache_dir=cache_dir, device="cpu").load_encoder()


def test_identity_includes_build_spec(tiny_backbone, tiny_model_cfg):
    """identity() names the model and carries the build spec read from the checkpoint folder."""
    ident = tiny_backbone.identity()
    assert ident["name"] == "tiny-qwen3"
    assert ident["source"] == "tiny-qwen3"
    assert ident["dtype"] == "torch.float32"
    assert ident["build"] == build_spec(**build_kwargs(tiny_model_cfg))


def test_identity_is_read_once_per_dtype_and_callers_cannot_change_it(cache_dir, tiny_model_cfg, monkeypatch):
    """Every scoring call asks for the identity: the checkpoint's record is read once, again only when the dtype
    changes, and a caller editing the dict it got changes nothing."""
    backbone = Backbone(tiny_model_cfg, cache_dir=cache_dir, device="cpu")
    first = backbone.identity()
    reads = []
    read_text = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: reads.append(self) or read_text(self, *a, **k))
    first["build"]["seed"] = -1
    assert backbone.identity() == {**first, "build": build_spec(**build_kwargs(tiny_model_cfg))} and reads == []
    backbone.dtype = torch.float64
    assert backbone.identity()["dtype"] == "torch.float64" and len(reads) == 1


@pytest.mark.parametrize("change", [{"seed": 1}, {"attention_temperature": 0.5}, {"num_layers": 2}])
def test_identity_changes_with_build_parameters(cache_dir, tiny_model_cfg, tiny_backbone, change):
    """Any build parameter that changes the numbers changes the identity (so stale features are never reused);
    the same config gives the same identity."""
    same = Backbone(tiny_model_cfg, cache_dir=cache_dir, device="cpu")
    assert stable_hash(same.identity()) == stable_hash(tiny_backbone.identity())
    cfg = OmegaConf.merge(tiny_model_cfg, {"build": change})
    other = Backbone(cfg, cache_dir=cache_dir, device="cpu")
    assert other.identity()["build"] != tiny_backbone.identity()["build"]
    assert stable_hash(other.identity()) != stable_hash(tiny_backbone.identity())


def test_bf16_on_cpu_falls_back_to_float32(cache_dir, tiny_model_cfg):
    """On CPU a bfloat16 config runs in float32 unless keep_dtype_on_cpu is set; identity reflects the real dtype."""
    cfg = OmegaConf.merge(tiny_model_cfg, {"dtype": "bfloat16"})
    assert Backbone(cfg, cache_dir=cache_dir, device="cpu").dtype == torch.float32
    cfg = OmegaConf.merge(cfg, {"keep_dtype_on_cpu": True})
    b = Backbone(cfg, cache_dir=cache_dir, device="cpu")
    assert b.dtype == torch.bfloat16 and b.identity()["dtype"] == "torch.bfloat16"


def test_model_without_source_raises_on_source(tmp_path):
    """Neither hub_id nor path nor builder: constructing is fine (lazy), asking for .source is a UserError."""
    cfg = OmegaConf.create({"name": "mystery", "dtype": "float32", "hub_id": None, "path": None, "revision": None})
    b = Backbone(cfg, cache_dir=tmp_path, device="cpu")
    with pytest.raises(UserError, match=r"model 'mystery' has neither hub_id nor path.*model\.path="):
        b.source


def test_model_source_prefers_path_over_hub_id(tmp_path):
    """A local path wins over a hub id (no download is attempted just to resolve the source)."""
    cfg = OmegaConf.create({"name": "m", "dtype": "float32", "hub_id": "org/model", "path": str(tmp_path)})
    assert Backbone(cfg, cache_dir=tmp_path, device="cpu").source == str(tmp_path)
    cfg.path = None
    assert Backbone(cfg, cache_dir=tmp_path, device="cpu").source == "org/model"


@pytest.mark.parametrize("dtype", ["float8", "fp32", "int8"])
def test_unknown_dtype_raises(tmp_path, tiny_model_cfg, dtype):
    """An unknown dtype fails at construction, naming the key and the allowed values."""
    cfg = OmegaConf.merge(tiny_model_cfg, {"dtype": dtype})
    with pytest.raises(UserError, match=rf"model\.dtype={dtype} is invalid; allowed: float32, bfloat16, float16"):
        Backbone(cfg, cache_dir=tmp_path, device="cpu")
