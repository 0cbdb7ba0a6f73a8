"""Batches by a token budget: the split, the budget from memory, the feature encoder's batches and the planner's
agreement with what a run decides."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.models import token_budget
from rewarduq_exp.models.shared_prefix import token_batches
from rewarduq_exp.models.token_budget import budget_from_memory, check_setting, split_by_tokens


def _padded(batches, lengths):
    return [len(b) * int(lengths[b].max()) for b in batches]


def test_split_by_tokens_keeps_every_row_once_in_order_under_the_budget():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=500)
    order = np.argsort(-lengths, kind="stable")
    batches = split_by_tokens(order, lengths, max_tokens=2048)
    assert np.array_equal(np.concatenate(batches), order)
    assert all(p <= 2048 for p in _padded(batches, lengths))
    # greedy: no batch could have taken the next row
    for batch, nxt in zip(batches, batches[1:]):
        assert (len(batch) + 1) * max(int(lengths[batch].max()), int(lengths[nxt[0]])) > 2048


def test_a_row_longer_than_the_budget_is_a_batch_of_its_own_and_rows_are_capped():
    lengths = np.array([50, 10, 10, 10, 10, 10])
    batches = split_by_tokens(np.arange(6), lengths, max_tokens=40)
    assert [b.tolist() for b in batches] == [[0], [1, 2, 3, 4], [5]]
    capped = split_by_tokens(np.arange(6), lengths, max_tokens=10_000, max_rows=2)
    assert [len(b) for b in capped] == [2, 2, 2]
    assert split_by_tokens(np.array([], dtype=np.int64), lengths, 10) == []


def test_token_batches_group_by_prompt_where_that_runs_fewer_positions():
    prompt = list(range(100, 130))   # 30 shared tokens
    ids = [prompt + [i, i + 1] for i in range(40)] + [[7] * 31 + [i] for i in range(40)]
    cut = np.array([30] * 40 + [0] * 40)
    batches = token_batches(ids, cut, max_tokens=32 * 16)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(80))
    # the 40 rows of one prompt are batched together (their prompt then runs once per batch)
    assert any(set(b.tolist()) <= set(range(40)) and len(b) == 16 for b in batches)
    assert token_batches([], np.zeros(0), 10) == []


def test_budget_from_memory_and_its_caps():
    mib = 2**20
    # 0.8 x (1000 MiB - 200 MiB reserved) at 1 MiB a token
    assert budget_from_memory(1000 * mib, mib, "cuda", reserved=200 * mib) == 640
    assert budget_from_memory(10**15, 1.0, "cuda") == token_budget.GPU_TOKENS_CAP
    assert budget_from_memory(10**15, 1.0, "cpu") == token_budget.CPU_TOKENS_CAP
    assert budget_from_memory(mib, 10 * mib, "cuda") == 1   # never zero: one row per batch then


@pytest.mark.parametrize("bad", [0, -3, "many", 2.5, True, "1e3"])
def test_settings_are_auto_or_a_positive_integer(bad):
    assert check_setting("auto", "probe.batch_tokens") == "auto"
    assert check_setting(512, "probe.batch_tokens") == 512
    assert check_setting("512", "probe.batch_tokens") == 512
    with pytest.raises(UserError, match=r"probe.batch_tokens=.*allowed: auto or an integer >= 1"):
        check_setting(bad, "probe.batch_tokens")


def _probe(**kw):
    return OmegaConf.create({"name": "last_token", "layer": -1, "pooling": "last", "batch_size": "auto",
                             "batch_tokens": "auto", **kw})


def test_feature_batches_follow_the_token_budget_with_the_same_features(tiny_backbone, tmp_path):
    from rewarduq_exp.data.synthetic import SyntheticWorld
    from rewarduq_exp.models.features import FeatureEncoder

    frame = SyntheticWorld(seed=3, n_train=60, n_eval=1, n_ood=1).load("train")
    small = FeatureEncoder(tiny_backbone, _probe(batch_tokens=256), tmp_path / "a", 2048, show_progress=False)
    large = FeatureEncoder(tiny_backbone, _probe(), tmp_path / "b", 2048, show_progress=False)
    rows = FeatureEncoder(tiny_backbone, _probe(batch_size=7), tmp_path / "c", 2048, show_progress=False)
    a, b, c = (enc.encode(frame["prompt"], frame["chosen"]) for enc in (small, large, rows))
    # the same rows in different batches: float32 sums over other paddings (CPU kernels here; a GPU run of both
    # batchings differs by its own reduction order, ~1e-6 relative)
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(c.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)
    assert small.last_batching["batch_tokens"] == 256
    assert large.last_batching["batch_tokens"] == token_budget.CPU_TOKENS_CAP   # a CPU with GiBs free: the cap
    assert small.stats["backbone_forward_passes"] > large.stats["backbone_forward_passes"] == 1
    assert rows.stats["backbone_forward_passes"] == int(np.ceil(60 / 7))
    with pytest.raises(UserError, match="probe.batch_size"):
        FeatureEncoder(tiny_backbone, _probe(batch_size=0), tmp_path, 2048)


def test_the_plan_budgets_extraction_as_the_run_does(monkeypatch):
    """At the same free memory the planner's extraction batch is the run's: both take the budget of
    :mod:`token_budget` at the per-token cost of :mod:`activation_memory`."""
    from rewarduq_exp.models.activation_memory import inference_token_bytes
    from rewarduq_exp.runner.plan import compose_points, make_plan

    gib = 24
    (_, cfg), = compose_points(["method=ens_mlp", "model=qwen3-4b", f"plan.device_memory_gib={gib}",
                                "max_length=2048"])
    plan = make_plan(cfg)
    extraction = next(p for p in plan.phases if p.name == "extraction")
    weights = extraction.parts["backbone weights"]
    (label, activations), = [(k, v) for k, v in extraction.parts.items() if k.startswith("activations")]
    from rewarduq_exp.models.shapes import architecture

    a = architecture(cfg.model)
    per_token = inference_token_bytes(a, 2048, 2, math_kernel=False, kv_cache=True)
    # what a run sees: the GPU's memory less the loaded weights
    monkeypatch.setattr(token_budget, "free_bytes", lambda device: gib * 2**30 - weights)
    tokens = token_budget.resolve_tokens("auto", "probe.batch_tokens", torch.device("cpu"), per_token)
    expected = budget_from_memory(gib * 2**30 - weights, per_token, "cuda")
    assert f"{expected:,} tokens" in label and activations == pytest.approx(expected * per_token)
    assert tokens == min(expected, token_budget.CPU_TOKENS_CAP)   # resolved for a CPU here: its cap
    assert expected < token_budget.GPU_TOKENS_CAP   # 24 GiB binds before the cap at 4B


def test_a_launcher_run_refuses_a_device_that_names_one_gpu(monkeypatch):
    from rewarduq_exp.runner.validation import check_device_per_rank

    check_device_per_rank("cuda:1")                      # one process: any GPU it names
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_device_per_rank("cuda")                        # each rank its cuda:LOCAL_RANK
    with pytest.raises(UserError, match=r"device=cuda:0 names one GPU, but this run has 2 processes.*device=cuda"):
        check_device_per_rank("cuda:0")
