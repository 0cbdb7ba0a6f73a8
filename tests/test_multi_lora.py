"""The batched multi-LoRA module (rewarduq_exp.models.multi_lora) against PEFT itself: the same hidden states and
gradients as PEFT's one-adapter-at-a-time ``set_adapter`` passes, in float32 and in bf16 autocast, with and without
shared prompts, in eval and train mode, with activation checkpointing; dropout masks per member; PEFT's file format
both ways; the routing's errors.

Tolerances (``TOL``): the batched path sums the same products as PEFT in another order (one ``bmm`` / ``baddbmm``
over stacked adapters against one ``mm`` per adapter, the update added in one kernel rather than after a separate
scaling), and the shared-prompt path runs attention over a cached prefix instead of the whole row.

* float32: about 1e-7 relative per op, amplified by the tiny model's sharp attention (``attention_temperature:
  0.01``: logits x100): up to ~1e-6 seen on CPU. CUDA float32 keeps TF32 off for matmuls by default (PyTorch's
  ``allow_tf32=False``) but picks other kernels and reduction orders; 1e-4 (absolute and relative) leaves two orders
  of magnitude for that.
* bf16 autocast (a bf16 base, float32 adapters, matmuls in bf16 as PEFT runs them under autocast): bf16 keeps 8
  significant bits (eps 2^-8 = 3.9e-3); one rounding placed differently moves a value by an ulp, and the tiny
  model's sharp attention turns that into a different attention pattern: PEFT's own bf16 states are 0.22 away from
  its float32 ones (values up to 3.5), its LoRA gradients 7 % of their largest entry. The batched path is held to
  that yardstick: its error against PEFT's float32 passes at most twice PEFT's bf16 error (measured on CPU: states
  1.03x, gradients 0.7x). One member alone runs PEFT's own sequence of operations: equal to PEFT's bf16 states
  (bit for bit on CPU; the float32 tolerance here).
"""

import numpy as np
import pytest
import torch

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.models.multi_lora import MultiLoRALinear, from_peft, quiet_peft
from rewarduq_exp.models.shared_prefix import shared_prefix_hidden

K, RANK, ALPHA = 3, 4, 8
NAMES = [f"m{k}" for k in range(K)]
TOL = {"atol": 1e-4, "rtol": 1e-4}


def _body(backbone, dtype):
    from transformers import AutoModel

    return backbone.from_pretrained(AutoModel, dtype=dtype).requires_grad_(False)


def _peft(backbone, dtype=torch.float32, dropout=0.0):
    """K members on the tiny body, built as ENS-LoRA builds them, then every LoRA weight drawn at random (PEFT starts
    B at 0, where every member is the base model itself)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=dropout, target_modules="all-linear", bias="none")
    with quiet_peft():
        model = get_peft_model(_body(backbone, dtype), cfg, adapter_name=NAMES[0])
    for name in NAMES[1:]:
        model.add_adapter(name, cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def _load_peft(backbone, folder, dtype=torch.float32):
    """PEFT's own loader on a fresh body: ``from_pretrained`` of the first member, ``load_adapter`` of the rest."""
    from peft import PeftModel

    with quiet_peft():
        model = PeftModel.from_pretrained(_body(backbone, dtype), str(folder / NAMES[0]), adapter_name=NAMES[0])
    for name in NAMES[1:]:
        model.load_adapter(str(folder / name), adapter_name=name)
    return model.eval()


@pytest.fixture
def pair(tiny_backbone, tmp_path):
    """(PEFT reference, the batched module), built per test: the reference saved in PEFT's format and loaded into
    the batched module as ENS-LoRA's ``load`` does (an old run folder read by the new module)."""

    def make(dtype=torch.float32, dropout=0.0):
        reference = _peft(tiny_backbone, dtype, dropout)
        reference.save_pretrained(str(tmp_path / "peft"), selected_adapters=NAMES, safe_serialization=True)
        return reference, from_peft(_load_peft(tiny_backbone, tmp_path / "peft", dtype), NAMES).eval()

    return make


def _batch(vocab: int):
    """Four right-padded rows: two prompts of 6 and 9 tokens with two completions each (shareable prefixes)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (6,), generator=g), torch.randint(3, vocab, (9,), generator=g)]
    rows = [torch.cat([prompts[i // 2], torch.randint(3, vocab, (n,), generator=g)])
            for i, n in enumerate((3, 5, 2, 4))]
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    return ids, mask, np.array([6, 6, 9, 9])


def _autocast(dtype):
    return torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else torch.autocast("cpu", enabled=False)


def _reference_pass(reference, ids, mask, weights, dtype):
    """Per member (``set_adapter``): hidden states (B, L, H) and the LoRA gradients of sum(last state . w_k)."""
    states, grads = [], []
    last = mask.sum(1) - 1
    for k, name in enumerate(NAMES):
        reference.set_adapter(name)   # only this adapter's weights require grad
        reference.zero_grad(set_to_none=True)
        with _autocast(dtype):
            h = reference(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        (h[torch.arange(len(ids)), last].float() @ weights[k]).sum().backward()
        states.append(h.detach().float())
        layers = [m for m in reference.base_model.model.modules() if hasattr(m, "lora_A") and name in m.lora_A]
        grads.append([g for m in layers for g in (m.lora_A[name].weight.grad, m.lora_B[name].weight.grad)])
    return states, grads


def _batched_pass(model, ids, mask, weights, dtype, shared=None, stats=None):
    b = len(ids)
    names = [n for n in NAMES for _ in range(b)]
    last = (mask.sum(1) - 1).repeat(K)
    model.zero_grad(set_to_none=True)
    with _autocast(dtype):
        if shared is None:
            h = model(input_ids=ids.repeat(K, 1), attention_mask=mask.repeat(K, 1), use_cache=False,
                      adapter_names=names).last_hidden_state
        else:
            h = shared_prefix_hidden(model, ids.repeat(K, 1), mask.repeat(K, 1), np.tile(shared, K), stats=stats,
                                     adapter_names=names)
    pooled = h[torch.arange(K * b), last].float().view(K, b, -1)
    (pooled * weights[:, None, :]).sum().backward()
    return h.detach().float().view(K, b, *h.shape[1:])


def _assert_states(ours, theirs, mask, what):
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], **TOL, msg=what)


def _relative_errors(states, grads, exact_states, exact_grads, mask):
    """Largest error of the states (absolute) and of the gradients (relative to each tensor's largest entry)
    against the float32 reference, over every member."""
    real = mask.bool()
    state_err = max(float((s[real] - e[real]).abs().max()) for s, e in zip(states, exact_states))
    grad_err = max(float((g - e).abs().max() / e.abs().max())
                   for member, exact in zip(grads, exact_grads) for g, e in zip(member, exact))
    return state_err, grad_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared-prompts"])
@pytest.mark.parametrize("mode", ["eval", "train", "train-checkpointed"])
def test_batched_forward_and_gradients_equal_peft_set_adapter(pair, tiny_backbone, dtype, shared, mode):
    reference, model = pair(dtype)
    ids, mask, prefixes = _batch(tiny_backbone.tokenizer.vocab_size)
    weights = torch.randn(K, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    lora = model.lora_parameters()
    assert {p.dtype for p in lora} == {torch.float32}   # float32 adapters on the bf16 base, as PEFT keeps them
    model.requires_grad_(False)
    for p in lora:
        p.requires_grad_(True)
    if mode != "eval":
        reference.train()
        model.train()
    if mode == "train-checkpointed":
        model.checkpointing(True)
    stats = {}
    ours = _batched_pass(model, ids, mask, weights, dtype, prefixes if shared else None, stats)
    if shared and mode != "train-checkpointed":   # transformers turns the cache off under checkpointing: plain
        assert stats["tokens_run"] < stats["tokens_without_sharing"]
    theirs, grads = _reference_pass(reference, ids, mask, weights, dtype)
    ours_grads = [[p.grad[k] for p in lora] for k in range(K)]
    if dtype == torch.float32:
        for k in range(K):
            _assert_states(ours[k], theirs[k], mask, f"member {k} hidden states")
            for i, (mine, g) in enumerate(zip(ours_grads[k], grads[k])):
                scale = float(g.abs().max())   # gradients compared relative to their largest entry
                torch.testing.assert_close(mine / scale, g / scale, **TOL, msg=f"member {k} grad {i}")
    else:   # no worse than PEFT's own bf16 passes, both measured against PEFT's float32 passes (module docstring)
        exact, exact_grads = _reference_pass(_peft(tiny_backbone, torch.float32), ids, mask, weights, torch.float32)
        ours_err = _relative_errors(ours, ours_grads, exact, exact_grads, mask)
        peft_err = _relative_errors(theirs, grads, exact, exact_grads, mask)
        assert ours_err[0] <= 2 * peft_err[0] and ours_err[1] <= 2 * peft_err[1], (ours_err, peft_err)
    # one member per pass (the sequential path) gives PEFT's states
    model.eval()
    reference.eval()
    with torch.no_grad(), _autocast(dtype):
        for k in range(K):
            h = model(input_ids=ids, attention_mask=mask, use_cache=False, members=k).last_hidden_state.float()
            _assert_states(h, theirs[k], mask, f"member {k} alone")


def test_checkpointed_recomputation_keeps_each_calls_routing_and_dropout_masks(pair, tiny_backbone):
    """Under activation checkpointing the layers run again in backward, after the call returned. Three calls with
    different routing (all members; member 1 alone; all members in reverse order, the same shapes as the first)
    before one backward: each recomputation must see its own call's routing and dropout masks, so the gradients
    equal those without checkpointing (same RNG seed). A routing read at backward time (the last call's, as a sticky
    ``set_adapter`` would be) recomputes the first call under the reversed order: same shapes, other gradients."""
    _, model = pair(dropout=0.3)
    ids, mask, _ = _batch(tiny_backbone.tokenizer.vocab_size)
    lora = model.lora_parameters()
    model.train()
    for p in lora:
        p.requires_grad_(True)
    grads = []
    for checkpointed in (False, True):
        model.checkpointing(checkpointed)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        both = model(input_ids=ids.repeat(K, 1), attention_mask=mask.repeat(K, 1), members=range(K)).last_hidden_state
        one = model(input_ids=ids, attention_mask=mask, members=1).last_hidden_state
        rev = model(input_ids=ids.repeat(K, 1), attention_mask=mask.repeat(K, 1), members=range(K - 1, -1, -1))
        (both.square().mean() + 2 * one.square().mean() + 3 * rev.last_hidden_state.abs().mean()).backward()
        grads.append([p.grad.clone() for p in lora])
    model.checkpointing(False)
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain, atol=1e-6, rtol=1e-5)


def test_lora_dropout_draws_its_own_mask_per_member(pair, tiny_backbone):
    """Every member's rows get their own dropout mask (one draw over all K x B rows): members with equal weights
    give different outputs in train mode and equal ones in eval mode."""
    _, model = pair(dropout=0.5)
    with torch.no_grad():
        for p in model.lora_parameters():
            p.copy_(p[:1].expand_as(p))   # every member = member 0
    ids, mask, _ = _batch(tiny_backbone.tokenizer.vocab_size)
    real = mask.bool()

    def states():
        with torch.no_grad():
            h = model(input_ids=ids.repeat(K, 1), attention_mask=mask.repeat(K, 1), members=range(K))
        return h.last_hidden_state.view(K, *ids.shape, -1)

    torch.manual_seed(0)
    model.train()
    h = states()
    for k in range(1, K):
        assert (h[k][real] - h[0][real]).abs().max() > 1e-2
    model.eval()
    h = states()
    for k in range(1, K):
        torch.testing.assert_close(h[k][real], h[0][real], atol=1e-5, rtol=1e-5)


def test_saved_adapters_load_into_peft_with_the_same_weights_and_outputs(pair, tiny_backbone, tmp_path):
    """save_adapters writes PEFT's layout: PEFT's own from_pretrained + load_adapter read it back (new run folders
    into PEFT); the fixture already loaded PEFT's save into the module (old run folders into the new module)."""
    reference, model = pair()
    with torch.no_grad():
        for p in model.lora_parameters():
            p.mul_(1.5)   # trained weights, not the reference's
    model.save_adapters(tmp_path / "ours")
    for name in NAMES:
        assert sorted(f.name for f in (tmp_path / "ours" / name).iterdir()) == ["adapter_config.json",
                                                                                 "adapter_model.safetensors"]
    loaded = _load_peft(tiny_backbone, tmp_path / "ours")
    ids, mask, _ = _batch(tiny_backbone.tokenizer.vocab_size)
    for k, name in enumerate(NAMES):
        layers = [m for m in loaded.base_model.model.modules() if hasattr(m, "lora_A") and name in m.lora_A]
        ours = model.member_parameters(k)
        assert len(ours) == 2 * len(layers) == 2 * 7   # q, k, v, o, gate, up, down of the one layer
        for mine, peft_weight in zip(ours, [w for m in layers for w in (m.lora_A[name].weight, m.lora_B[name].weight)]):
            torch.testing.assert_close(peft_weight, mine, atol=0, rtol=0)
        loaded.set_adapter(name)
        with torch.no_grad():
            theirs = loaded(input_ids=ids, attention_mask=mask).last_hidden_state
            mine = model(input_ids=ids, attention_mask=mask, members=k).last_hidden_state
        _assert_states(mine, theirs, mask, name)
    # and the module gives the same weights back as a PEFT model in memory
    back = model.to_peft()
    assert not any(isinstance(m, MultiLoRALinear) for m in back.modules())
    back.set_adapter(NAMES[2])
    with torch.no_grad():
        again = back(input_ids=ids, attention_mask=mask).last_hidden_state
    loaded.set_adapter(NAMES[2])
    with torch.no_grad():
        _assert_states(again, loaded(input_ids=ids, attention_mask=mask).last_hidden_state, mask, "to_peft")


def test_routing_is_explicit_and_checked(pair, tiny_backbone):
    _, model = pair()
    ids, mask, _ = _batch(tiny_backbone.tokenizer.vocab_size)
    assert model.resolve_members(adapter_names=["m2"] * 4 + ["m0"] * 4, rows=8) == (2, 0)
    assert model.resolve_members(adapter_names=["m1"] * 4 + ["m1"] * 2 + ["m0"] * 2, rows=8) == (1, 1, 1, 0)
    assert model.resolve_members(members=1) == (1,)
    with pytest.raises(ValueError, match="exactly one of members= and adapter_names="):
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="do not split into 3 equal member blocks"):
        model(input_ids=ids, attention_mask=mask, members=range(K))
    with pytest.raises(ValueError, match="unknown member 'x'"):
        model(input_ids=ids, attention_mask=mask, adapter_names=["x"] * 4)
    with pytest.raises(RuntimeError, match="no member routing"):
        model.base_model(input_ids=ids, attention_mask=mask)   # the body alone: nothing is routed


def test_from_peft_refuses_what_it_cannot_batch(tiny_backbone):
    from peft import LoraConfig, get_peft_model

    with quiet_peft():
        model = get_peft_model(_body(tiny_backbone, torch.float32),
                               LoraConfig(r=4, target_modules="all-linear"), adapter_name="m0")
    model.add_adapter("m1", LoraConfig(r=8, target_modules="all-linear"))
    with pytest.raises(UserError, match="the members differ in rank, alpha or dropout"):
        from_peft(model, ["m0", "m1"])
    with pytest.raises(UserError, match="has no adapter 'm2'"):
        from_peft(model, ["m0", "m2"])
    model.add_adapter("dora", LoraConfig(r=4, target_modules="all-linear", use_dora=True))
    with pytest.raises(UserError, match="LoRA variant"):
        from_peft(model, ["m0", "dora"])
