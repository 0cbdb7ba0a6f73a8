"""A batch whose rows share prompts, run with each distinct prompt once, gives the hidden states (at every real
position, at an intermediate and at the last layer) and the gradients of one plain forward; the batching picks the
grouped order only where it runs fewer positions; features and MCD-DPO's log-probs come out the same."""

import copy

import numpy as np
import pytest
import torch
from conftest import ROOT
from omegaconf import OmegaConf

from rewarduq_exp.models import prefix_cache
from rewarduq_exp.models.backbone import Backbone
from rewarduq_exp.models.features import FeatureEncoder
from rewarduq_exp.models.shared_prefix import (
    batch_order,
    can_share,
    common_prefix_lengths,
    prefix_groups,
    shared_prefix_hidden,
)

# (prompt ids, completion ids): rows 0-2 share a prompt, rows 3-4 share a shorter one, row 5 is alone, row 6's
# "prompt" covers the whole row (clipped so that one token is left to its suffix).
ROWS = [
    ([5, 6, 7, 8, 9, 10], [11, 12]),
    ([5, 6, 7, 8, 9, 10], [13, 14, 15, 16, 17]),
    ([5, 6, 7, 8, 9, 10], [18]),
    ([20, 21, 22], [23, 24, 25, 26]),
    ([20, 21, 22], [27]),
    ([30, 31, 32, 33, 34, 35, 36, 37], [38, 39, 40]),
    ([41, 42, 43, 44], []),
]


@pytest.fixture(scope="module")
def backbone(cache_dir):
    cfg = OmegaConf.load(ROOT / "conf" / "model" / "tiny-qwen3.yaml")
    cfg.build.num_layers = 3  # an intermediate layer exists
    return Backbone(cfg, cache_dir=cache_dir, device="cpu")


@pytest.fixture(scope="module")
def body(backbone):
    return backbone.load_encoder()


def batch(rows):
    seqs = [p + c for p, c in rows]
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, :len(s)], mask[r, :len(s)] = torch.tensor(s), 1
    return ids, mask, [len(p) for p, _ in rows]


def real(hidden, mask):
    return hidden[mask.bool()]


@pytest.mark.parametrize("layer", [None, 0, 2, 3])
def test_equal_to_one_plain_forward(body, layer):
    ids, mask, prompts = batch(ROWS)
    with torch.no_grad():
        plain = body(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        expected = plain.last_hidden_state if layer is None else plain.hidden_states[layer]
        stats = {}
        got = shared_prefix_hidden(body, ids, mask, prompts, layer=layer, stats=stats)
    assert got.shape == expected.shape
    torch.testing.assert_close(real(got, mask), real(expected, mask), atol=2e-5, rtol=1e-5)
    # 4 distinct prompts (8 wide) + 7 suffixes (5 wide) instead of 7 rows of 11
    assert stats == {"tokens_run": 4 * 8 + 7 * 5, "tokens_without_sharing": 7 * 11}


def test_gradients_equal_to_one_plain_forward(body):
    ids, mask, prompts = batch(ROWS)
    weights = torch.randn(*ids.shape, body.config.hidden_size, generator=torch.Generator().manual_seed(0))
    grads = []
    body = copy.deepcopy(body).requires_grad_(True).train()  # the encoder is frozen
    for shared in (False, True):
        body.zero_grad(set_to_none=True)
        hidden = (shared_prefix_hidden(body, ids, mask, prompts) if shared
                  else body(input_ids=ids, attention_mask=mask).last_hidden_state)
        (hidden * weights * mask[..., None]).sum().backward()
        grads.append({n: p.grad.clone() for n, p in body.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name in grads[0]:
        scale = grads[0][name].abs().max().item()  # sums over the batch: float rounding grows with them
        assert (grads[1][name] - grads[0][name]).abs().max().item() <= 1e-4 * scale + 1e-6, name


def test_one_pass_when_nothing_is_shared_two_otherwise(body):
    calls = []
    hook = body.register_forward_hook(lambda *a: calls.append(1))
    try:
        distinct = [ROWS[0], ROWS[3], ROWS[5]]
        ids, mask, prompts = batch(distinct)
        with torch.no_grad():
            shared_prefix_hidden(body, ids, mask, prompts)
        assert len(calls) == 1
        ids, mask, prompts = batch(ROWS[:2])
        with torch.no_grad():
            shared_prefix_hidden(body, ids, mask, prompts)
        assert len(calls) == 3
    finally:
        hook.remove()


def test_shared_only_where_exact(body, monkeypatch):
    assert can_share(body)
    monkeypatch.setattr(body.config, "_attn_implementation", "flash_attention_2")  # no masks with holes
    assert not can_share(body)
    monkeypatch.undo()
    body.gradient_checkpointing_enable()
    body.train()
    try:
        assert not can_share(body)  # transformers turns the cache off when checkpointing in training
        body.eval()
        assert can_share(body)
    finally:
        body.gradient_checkpointing_disable()
        body.eval()


def test_prefix_groups_and_common_prefix_lengths():
    ids, _, prompts = batch(ROWS)
    distinct, rows = prefix_groups(ids, prompts)
    assert rows == [0, 0, 0, 1, 1, 2, 3] and distinct[1] == (None, (20, 21, 22))
    # rows under different adapters (a PEFT mixed-adapter batch) never share a prefix
    tagged, rows = prefix_groups(ids, prompts, adapter_names=["a", "b", "a", "a", "a", "a", "a"])
    assert rows == [0, 1, 0, 2, 2, 3, 4] and tagged[1] == ("b", tagged[0][1])
    # the tokenisations diverge at the third token / the prefix covers the row: one token is left to the suffix
    assert common_prefix_lengths([[1, 2, 3, 4], [1, 2, 3], [7, 8]], [[1, 2, 9], [1, 2, 3, 4], []]).tolist() == [2, 2, 0]


def test_batch_order_groups_only_where_it_runs_fewer_positions():
    rng = np.random.default_rng(0)
    # 20 prompts of 30 tokens, 3 short answers each: longest-first batches of 8 would hold 8 distinct prompts
    prompts = [list(range(1000 + 30 * k, 1030 + 30 * k)) for k in range(20)]
    repeated = [prompts[k % 20] + list(rng.integers(1, 99, rng.integers(1, 10))) for k in range(60)]
    order = batch_order(repeated, [30] * 60, 8)
    assert sorted(order.tolist()) == list(range(60))
    groups = [k % 20 for k in order]
    assert sum(a != b for a, b in zip(groups, groups[1:])) == 19  # one run per prompt
    first = [len(repeated[i]) for i in order[:3]]
    assert first == sorted(first, reverse=True)  # longest first within a prompt
    # every prompt distinct: nothing to share, longest first
    distinct = [list(rng.integers(1, 99, 10)) + list(rng.integers(1, 99, rng.integers(1, 30))) for _ in range(40)]
    order = batch_order(distinct, [10] * 40, 8)
    assert [len(distinct[i]) for i in order] == sorted((len(x) for x in distinct), reverse=True)


def test_features_with_shared_prompts_equal_plain_extraction(backbone, tmp_path):
    probe = OmegaConf.create({"layer": 2, "pooling": "mean", "batch_size": 4})
    enc = FeatureEncoder(backbone, probe, tmp_path, max_length=512, show_progress=False)
    prompts = [[{"role": "user", "content": q}] for q in ("Name a fruit.", "Name a colour.")] * 5
    completions = [[{"role": "assistant", "content": "word " * (k + 1)}] for k in range(10)]
    features = enc.encode(prompts, completions)
    assert enc.stats["tokens_run"] < enc.stats["tokens_without_sharing"]
    texts = [backbone.tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
    plain = enc._extract(texts, "plain")  # no prompts given: longest first, one pass per batch
    torch.testing.assert_close(features, plain, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["packed", "repeat"])
def test_suffix_states_and_mean_pooling_with_shared_prompts_equal_without(body, mode):
    """BoRP: the conversations' prompts run once, the probe suffixes after the whole conversations' cache."""
    conversations = [p + c for p, c in ROWS]
    shares = [len(p) for p, _ in ROWS]
    suffixes = [[50, 51, 52], [53, 54]]
    plain_stats, shared_stats = {}, {}
    plain = prefix_cache.suffix_states(body, conversations, suffixes, [1, -1], batch_size=14, mode=mode,
                                       stats=plain_stats)
    shared = prefix_cache.suffix_states(body, conversations, suffixes, [1, -1], batch_size=14, mode=mode,
                                        stats=shared_stats, share_lengths=shares)
    torch.testing.assert_close(shared, plain, atol=2e-5, rtol=1e-5)
    assert shared_stats["prefix_tokens"] < plain_stats["prefix_tokens"]
    pooled = prefix_cache.mean_pooled_states(body, conversations, [2], batch_size=4)
    pooled_shared = prefix_cache.mean_pooled_states(body, conversations, [2], batch_size=4, share_lengths=shares)
    torch.testing.assert_close(pooled_shared, pooled, atol=2e-5, rtol=1e-5)


def test_rows_of_very_different_suffix_lengths_run_in_two_halves_with_equal_states_and_gradients(body):
    """A training batch in random order: short and long completions mixed. Two forwards by suffix length run fewer
    positions than one; states and gradients stay those of one plain forward, rows in the batch's order."""
    rng = np.random.default_rng(1)
    prompts = [[5, 6, 7, 8, 9, 10], [20, 21, 22]]
    rows = [(prompts[k % 2], [int(t) for t in rng.integers(50, 99, 1 if k % 3 else 20)]) for k in range(8)]
    ids, mask, lengths = batch(rows)
    one, two = {}, {}
    with torch.no_grad():
        expected = body(input_ids=ids, attention_mask=mask).last_hidden_state
        shared_prefix_hidden(body, ids, mask, lengths, stats=one, split=False)
        got = shared_prefix_hidden(body, ids, mask, lengths, stats=two)
    torch.testing.assert_close(real(got, mask), real(expected, mask), atol=2e-5, rtol=1e-5)
    assert two["tokens_run"] <= 0.8 * one["tokens_run"] and two["tokens_without_sharing"] == ids.numel()
    trained = copy.deepcopy(body).requires_grad_(True).train()
    weights = torch.randn(*ids.shape, body.config.hidden_size, generator=torch.Generator().manual_seed(0))
    grads = []
    for split in (False, True):
        trained.zero_grad(set_to_none=True)
        hidden = shared_prefix_hidden(trained, ids, mask, lengths, split=split)
        (hidden * weights * mask[..., None]).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in trained.parameters() if p.grad is not None]))
    assert (grads[1] - grads[0]).abs().max() <= 1e-4 * grads[0].abs().max()
