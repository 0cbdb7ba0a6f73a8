"""Suffix-only scoring (BoRP section 3.4): reusing a prefix's KV cache for several suffixes gives the hidden states of
running every prefix + suffix from scratch, at an intermediate and at the final layer, for conversations of
different lengths, with and without prefixes batched (padded) together."""

import copy

import pytest
import torch
from conftest import ROOT
from omegaconf import OmegaConf

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.models import prefix_cache
from rewarduq_exp.models.backbone import Backbone

# A Qwen3-like template (our own minimal Jinja): the generation prefix gets the empty think block when thinking is off.
QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONVERSATIONS = [
    ([{"role": "user", "content": "What is the capital of France?"}],
     [{"role": "assistant", "content": "Paris."}]),
    ([{"role": "system", "content": "You are a helpful assistant."},
      {"role": "user", "content": "Write a short poem about the sea."}],
     [{"role": "assistant", "content": "The quick brown fox jumps over the lazy dog. " * 6}]),
    ([{"role": "user", "content": "Please answer the question below carefully."},
      {"role": "assistant", "content": "Sure, what is it?"},
      {"role": "user", "content": "What is the capital of France? Explain your reasoning step by step."}],
     [{"role": "assistant", "content": "Paris is the capital of France. Thank you, that is a good point. " * 3}]),
    ([{"role": "user", "content": "topic reply"}], [{"role": "assistant", "content": "write about"}]),
]


@pytest.fixture(scope="module")
def deep_backbone(cache_dir):
    """The tiny model with 3 layers, so that an intermediate layer exists."""
    cfg = OmegaConf.load(ROOT / "conf" / "model" / "tiny-qwen3.yaml")
    cfg.build.num_layers = 3
    return Backbone(cfg, cache_dir=cache_dir, device="cpu")


@pytest.fixture(scope="module")
def encoder(deep_backbone):
    return deep_backbone.load_encoder()


@pytest.fixture(scope="module")
def pieces(deep_backbone):
    tok = deep_backbone.tokenizer
    prefixes = [prefix_cache.render_prefix(tok, p, r) for p, r in CONVERSATIONS]
    suffixes = [prefix_cache.render_suffix(tok, "How satisfied is the user?", f"Performance is {w}")
                for w in ("Excellent", "Terrible", "average")]
    return prefix_cache.tokenize_pieces(tok, prefixes), prefix_cache.tokenize_pieces(tok, suffixes)


@pytest.mark.parametrize("mode", ["packed", "repeat"])
@pytest.mark.parametrize("batch_size", [3, 100], ids=["one-prefix-per-batch", "padded-prefix-batch"])
def test_prefix_reuse_equals_full_recompute(encoder, pieces, deep_backbone, batch_size, mode):
    pre, suf = pieces
    assert len({len(p) for p in pre}) == len(pre) and len({len(s) for s in suf}) > 1  # different lengths
    layers = [1, 3]  # an intermediate layer and the last one (after the final norm)
    pad = deep_backbone.tokenizer.pad_token_id
    stats = {}
    reused = prefix_cache.suffix_states(encoder, pre, suf, layers, pad_id=pad, batch_size=batch_size, mode=mode,
                                        stats=stats)
    full = prefix_cache.full_recompute(encoder, pre, suf, layers, pad_id=pad, batch_size=batch_size)
    assert reused.shape == (len(pre), len(suf), 2, 256)
    torch.testing.assert_close(reused, full, atol=1e-4, rtol=0)
    # the suffixes really differ, and so do the layers
    assert (reused[:, 0] - reused[:, 1]).abs().max() > 1e-3
    assert (reused[:, :, 0] - reused[:, :, 1]).abs().max() > 1e-3
    # each prefix was computed once per batch, not once per suffix
    assert stats["prefix_tokens"] <= max(len(p) for p in pre) * len(pre)


@pytest.mark.parametrize("mode", ["packed", "repeat"])
def test_the_cache_goes_in_under_the_installed_releases_keyword(encoder, pieces, mode):
    """transformers 5.24 renamed forward's ``past_key_values`` to ``cache``: the old name warns on every batch (and
    is removed in 5.40); the prefix reuse passes whichever name the installed model's forward declares."""
    import inspect
    import warnings

    pre, suf = pieces
    declared = inspect.signature(type(encoder).forward).parameters
    assert prefix_cache._cache_keyword(type(encoder)) in declared
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prefix_cache.suffix_states(encoder, pre, suf, [1, -1], mode=mode)
    assert not [w for w in caught if "past_key_values" in str(w.message)], [str(w.message) for w in caught]


def test_packed_mode_with_eager_attention(deep_backbone, pieces):
    from transformers import AutoModel

    eager = deep_backbone.from_pretrained(AutoModel, attn_implementation="eager").eval()
    assert prefix_cache.packed_supported(eager)
    pre, suf = pieces
    packed = prefix_cache.suffix_states(eager, pre, suf, [2, 3], mode="packed", batch_size=100)
    torch.testing.assert_close(packed, prefix_cache.full_recompute(eager, pre, suf, [2, 3]), atol=1e-4, rtol=0)


def test_matches_a_plain_forward_of_the_concatenated_text(encoder, pieces):
    pre, suf = pieces
    with torch.no_grad():
        out = encoder(input_ids=torch.tensor([pre[2] + suf[1]]), output_hidden_states=True)
    got = prefix_cache.suffix_states(encoder, pre, suf, [1, -1])
    torch.testing.assert_close(got[2, 1, 0], out.hidden_states[1][0, -1], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[2, 1, 1], out.last_hidden_state[0, -1], atol=1e-4, rtol=0)


def test_token_boundary_is_clean(deep_backbone, pieces):
    tok = deep_backbone.tokenizer
    pre, suf = pieces
    prefix_text = prefix_cache.render_prefix(tok, *CONVERSATIONS[1])
    suffix_text = prefix_cache.render_suffix(tok, "How satisfied is the user?", "Performance is Excellent")
    assert prefix_text.endswith("<|im_end|>\n") and suffix_text.startswith("<|im_start|>user\n")
    joint = tok(prefix_text + suffix_text, add_special_tokens=False)["input_ids"]
    assert joint == pre[1] + suf[0]  # separate tokenisation = tokenising the concatenated text here
    assert tok.convert_ids_to_tokens(suf[0][:1]) == ["<|im_start|>"]


def test_think_modes(deep_backbone):
    tok = copy.deepcopy(deep_backbone.tokenizer)
    tok.chat_template = QWEN3_LIKE
    auto = prefix_cache.render_suffix(tok, "Rate it.", "Score:")
    assert auto == "<|im_start|>user\nRate it.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nScore:"
    assert "<think>" not in prefix_cache.render_suffix(tok, "Rate it.", think="never")
    plain = deep_backbone.tokenizer  # ChatML without thinking: auto adds nothing, always appends the block
    assert "<think>" not in prefix_cache.render_suffix(plain, "Rate it.")
    assert prefix_cache.render_suffix(plain, "Rate it.", think="always").endswith("<think>\n\n</think>\n\n")


def test_bad_input_is_one_line(deep_backbone, encoder, pieces):
    tok = copy.deepcopy(deep_backbone.tokenizer)
    # A template whose system turn changes when more turns follow: its default system prompt cannot be cut off.
    tok.chat_template = DEFAULT_SYSTEM.replace("{{ m['content'] }}<|im_end|>", "{{ m['content'] }}{% if not loop.last "
                                               "%}<|sep|>{% endif %}<|im_end|>")
    with pytest.raises(UserError, match="renders a system turn differently .*probe.default_system_prompt=keep"):
        prefix_cache.render_suffix(tok, "Rate it.")
    tok.chat_template = DEFAULT_SYSTEM  # the usual kind (SmolLM2, Qwen2.5) is handled, not refused
    turn = "<|im_start|>user\nRate it.<|im_end|>\n<|im_start|>assistant\n"
    assert prefix_cache.render_suffix(tok, "Rate it.") == turn
    with pytest.raises(UserError, match="probe prompt .* is empty"):
        prefix_cache.render_suffix(deep_backbone.tokenizer, "  ")
    with pytest.raises(UserError, match="think='maybe' is invalid; allowed: auto, always, never"):
        prefix_cache.render_suffix(deep_backbone.tokenizer, "Rate it.", think="maybe")
    pre, suf = pieces
    with pytest.raises(UserError, match=r"probe layer=4 is out of range for a model with 3 layers; allowed 0..3") as e:
        prefix_cache.suffix_states(encoder, pre, suf, [1, 4])
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="mode='fast' is invalid; allowed: auto, packed, repeat"):
        prefix_cache.suffix_states(encoder, pre, suf, [1], mode="fast")
    with pytest.raises(UserError, match="have no tokens"):
        prefix_cache.suffix_states(encoder, pre, [suf[0], []], [1])
    assert prefix_cache.normalize_layers([-1, -4, 0, 2], 3) == [3, 0, 0, 2]


def test_mean_pooled_states(encoder, pieces):
    pre, _ = pieces
    got = prefix_cache.mean_pooled_states(encoder, pre, [2, -1], batch_size=2)
    with torch.no_grad():
        out = encoder(input_ids=torch.tensor([pre[0]]), output_hidden_states=True)
    torch.testing.assert_close(got[0, 0], out.hidden_states[2][0].mean(0), atol=1e-4, rtol=0)
    torch.testing.assert_close(got[0, 1], out.last_hidden_state[0].mean(0), atol=1e-4, rtol=0)
