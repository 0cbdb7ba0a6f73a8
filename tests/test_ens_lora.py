"""ENS-LoRA (paper section 4.2): K LoRA adapters on one base, all members in one batched forward or one pass per
member, in training and scoring, save/load (PEFT's format, both ways). The module itself is checked against PEFT in
tests/test_multi_lora.py.

Tolerances that compare two ways of computing the same numbers (batched vs one pass per member, shared prompts vs
plain forwards): float32 in another summation order, about 1e-7 relative per op, amplified by the tiny model's sharp
attention (``attention_temperature: 0.01``, logits x100) and by a few Adam steps; up to ~1e-6 seen on CPU. A CUDA
float32 run keeps TF32 off for matmuls by default but picks other kernels and reduction orders (an earlier 1e-5 bound
was missed there by 2e-5): 1e-4 is allowed everywhere, 2 orders of magnitude over the CPU's differences."""

import numpy as np
import pytest
import torch

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.contract import render_all
from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.methods.ens_lora import EnsLoRA

TOL = {"atol": 1e-4, "rtol": 1e-4}   # module docstring


class _Encoder:
    """train_run sets a FeatureEncoder; ENS-LoRA only reads its ``.backbone``."""

    def __init__(self, backbone):
        self.backbone = backbone


def make_method(backbone, **kw):
    defaults = {"num_members": 3, "lora_rank": 4, "lora_alpha": 8, "learning_rate": 3e-3, "batch_size": 16, "seed": 0,
                    "device": "cpu", "show_progress": False, "log_every": 1}
    return EnsLoRA(encoder=_Encoder(backbone), **{**defaults, **kw})


@pytest.fixture(scope="module")
def data():
    world = SyntheticWorld(seed=0, n_train=64, n_eval=24, n_ood=8)
    return world.load("train"), world.load("eval")


@pytest.fixture(scope="module")
def trained(tiny_backbone, data):
    train, _ = data
    m = make_method(tiny_backbone, num_epochs=2)  # 8 steps
    m.fit(train)
    return m


def fixed_batch_loss(m, frame):
    """Mean member BT NLL on a fixed batch (the training objective's data term)."""
    tok = m.encoder.backbone.tokenizer
    n = len(frame)
    r = m.member_rewards(render_all(tok, list(frame["prompt"]) * 2, list(frame["chosen"]) + list(frame["rejected"])))
    return float(-torch.nn.functional.logsigmoid(r[:, :n] - r[:, n:]).mean())


def test_training_reduces_loss(tiny_backbone, data, trained):
    train, _ = data
    fresh = make_method(tiny_backbone)
    fresh._build()  # same seed: the untrained starting point of `trained`
    before, after = fixed_batch_loss(fresh, train), fixed_batch_loss(trained, train)
    assert after < before - 0.05, (before, after)
    assert trained.history and {"step", "loss", "loss_bt", "loss_anchor", "loss_center"} <= set(trained.history[0])
    assert trained.history[0]["loss_anchor"] >= 0.0


def test_scores_shapes_bounds_and_spread(trained, data):
    _, ev = data
    c, r = trained.score_pairs(ev)
    for s in (c, r):
        assert s.reward.shape == s.lower.shape == s.upper.shape == (len(ev),)
        assert np.all(s.lower <= s.reward) and np.all(s.reward <= s.upper)
        assert np.all(s.upper - s.lower > 1e-6)  # members differ -> nonzero spread
    # score() on the chosen column equals the chosen half of score_pairs()
    direct = trained.score(ev["prompt"], ev["chosen"])
    np.testing.assert_allclose(direct.reward, c.reward, atol=1e-5)


def test_members_differ_from_the_start(tiny_backbone, data):
    _, ev = data
    m = make_method(tiny_backbone)
    m._build()
    r = m.member_rewards(render_all(tiny_backbone.tokenizer, ev["prompt"], ev["chosen"]))
    assert r.shape == (3, len(ev))
    assert (r.std(0) > 1e-4).all()  # on every input, the K rewards are not all equal


# The PEFT implementation of ENS-LoRA (K adapters routed by PEFT, commit a403c33), sequential passes, on the
# `trained` fixture's data and settings: every step's loss and anchor, then score_pairs on the first 6 eval pairs.
# The batched module is initialised by PEFT itself and trains the same parameters, so it must reproduce these.
PEFT_IMPLEMENTATION = {
    "loss": [0.9989734, 0.7816861, 0.8279746, 0.8990969, 0.6251671, 0.4954002, 0.5449693, 0.4147936],
    "loss_anchor": [0.0, 0.2918692, 0.4871735, 0.6106356, 0.6853650, 0.7350483, 0.7604478, 0.7712695],
    "chosen": [-0.4991770, -0.3295638, 0.4173248, -0.1333481, 0.2439830, -0.3369326],
    "chosen_width": [4.4960393, 1.6015977, 1.3094070, 3.3118463, 1.7306317, 2.7553858],
    "rejected": [-1.4232990, -1.0469528, 0.1986032, -0.9352342, 1.2019566, -0.8383253],
}


def test_fit_reproduces_the_peft_implementation(trained, data):
    _, ev = data
    c, r = trained.score_pairs(ev.iloc[:6])
    got = {"loss": [h["loss"] for h in trained.history], "loss_anchor": [h["loss_anchor"] for h in trained.history],
           "chosen": c.reward, "chosen_width": c.upper - c.lower, "rejected": r.reward}
    for key, expected in PEFT_IMPLEMENTATION.items():
        np.testing.assert_allclose(got[key], expected, **TOL, err_msg=key)


def test_batched_scoring_equals_one_pass_per_member(trained, data):
    _, ev = data
    texts = render_all(trained.encoder.backbone.tokenizer, ev["prompt"], ev["rejected"])
    batched = trained.member_rewards(texts, mixed=True)
    sequential = trained.member_rewards(texts, mixed=False)
    torch.testing.assert_close(batched, sequential, **TOL)


def test_batched_training_equals_one_pass_per_member(tiny_backbone, data):
    train, _ = data
    small = train.iloc[:64]  # 4 steps: the anchor's gradient on the LoRA weights counts from the 2nd update on
    a = make_method(tiny_backbone, num_members=2, mixed_adapter_training=True)
    b = make_method(tiny_backbone, num_members=2, mixed_adapter_training=False)
    c = make_method(tiny_backbone, num_members=2, mixed_adapter_training=True, gradient_checkpointing=True)
    for m in (a, b, c):
        m.fit(small)
    # activation checkpointing keeps the batched path (the routing survives the recomputation)
    assert a.fit_summary["mixed_adapter_training"] and c.fit_summary["mixed_adapter_training"]
    assert not b.fit_summary["mixed_adapter_training"]
    # One batched backward == one backward per member (and with activation checkpointing): same trajectory.
    for m in (b, c):
        np.testing.assert_allclose([h["loss"] for h in m.history], [h["loss"] for h in a.history], **TOL)
        np.testing.assert_allclose([h["loss_anchor"] for h in m.history], [h["loss_anchor"] for h in a.history],
                                   **TOL)
        for pa, pm in zip([p for g in a._lora_params() for p in g], [p for g in m._lora_params() for p in g]):
            torch.testing.assert_close(pm, pa, **TOL)


@pytest.fixture
def shared_passes(monkeypatch):
    """Counts the batches that ran with their prompts shared (a two-pass forward that returned states)."""
    from rewarduq_exp.models import shared_prefix

    count, original = {"shared": 0}, shared_prefix.shared_pass

    def counting(*args, **kwargs):
        run = original(*args, **kwargs)
        count["shared"] += run is not None
        return run

    monkeypatch.setattr(shared_prefix, "shared_pass", counting)
    return count


@pytest.mark.parametrize("mixed", [False, True])
def test_shared_prompts_give_the_plain_forwards_rewards_and_training(tiny_backbone, data, shared_passes, mixed,
                                                                     monkeypatch):
    """Chosen and rejected share their prompt: it runs once per pair and member (in the batched forward: U prompts
    per member, K x U rows member-major), in training and in scoring, and the rewards, losses and weights equal those
    of plain forwards."""
    from rewarduq_exp.models import shared_prefix

    train, ev = data
    small = train.iloc[:32]
    shared = make_method(tiny_backbone, num_members=2, mixed_adapter_training=mixed, mixed_adapter_scoring=mixed)
    shared.fit(small)
    trained_with_sharing = shared_passes["shared"]
    c_shared, r_shared = shared.score_pairs(ev)
    assert trained_with_sharing > 0 and shared_passes["shared"] > trained_with_sharing

    monkeypatch.setattr(shared_prefix, "can_share", lambda model: False)
    plain = make_method(tiny_backbone, num_members=2, mixed_adapter_training=mixed, mixed_adapter_scoring=mixed)
    plain.fit(small)
    c_plain, r_plain = plain.score_pairs(ev)
    np.testing.assert_allclose([h["loss"] for h in shared.history], [h["loss"] for h in plain.history], **TOL)
    for pa, pb in zip([p for g in shared._lora_params() for p in g], [p for g in plain._lora_params() for p in g]):
        torch.testing.assert_close(pa, pb, **TOL)
    # Plain forwards of the shared model's own weights: the scoring path alone.
    monkeypatch.undo()
    texts = render_all(tiny_backbone.tokenizer, list(ev["prompt"]), list(ev["chosen"]))
    torch.testing.assert_close(shared.member_rewards(texts, mixed=mixed, prompts=list(ev["prompt"])),
                               shared.member_rewards(texts, mixed=mixed), **TOL)
    for a, b in ((c_shared, c_plain), (r_shared, r_plain)):
        np.testing.assert_allclose(a.reward, b.reward, **TOL)
        np.testing.assert_allclose(a.upper - a.lower, b.upper - b.lower, **TOL)


@pytest.mark.parametrize("mixed", [False, True])
def test_lora_dropout_in_training_runs_every_row_in_full(tiny_backbone, data, shared_passes, mixed):
    """With dropout the rows of one prompt would share its dropout mask: training runs them in full; scoring (no
    dropout) still shares. Dropout is on in training (the loss differs from a run without it) in both paths."""
    train, ev = data
    m = make_method(tiny_backbone, num_members=2, lora_dropout=0.3, mixed_adapter_training=mixed)
    m.fit(train.iloc[:32])
    assert shared_passes["shared"] == 0
    m.score_pairs(ev)
    assert shared_passes["shared"] > 0
    still = make_method(tiny_backbone, num_members=2, mixed_adapter_training=mixed)
    still.fit(train.iloc[:32])
    assert abs(still.history[-1]["loss"] - m.history[-1]["loss"]) > 1e-4


def test_save_load_identical_scores(trained, tiny_backbone, data, tmp_path):
    _, ev = data
    trained.save(tmp_path)
    assert (tmp_path / "method.json").exists() and (tmp_path / "heads.safetensors").exists()
    assert (tmp_path / "adapters" / "m0" / "adapter_model.safetensors").exists()
    assert not list(tmp_path.rglob("*.bin")) and not list(tmp_path.rglob("*.pt"))
    loaded = make_method(tiny_backbone).load(tmp_path)
    c0, r0 = trained.score_pairs(ev)
    c1, r1 = loaded.score_pairs(ev)
    for s0, s1 in ((c0, c1), (r0, r1)):
        np.testing.assert_allclose(s1.reward, s0.reward, atol=1e-5)
        np.testing.assert_allclose(s1.upper, s0.upper, atol=1e-5)
    with pytest.raises(UserError, match="members"):
        make_method(tiny_backbone, num_members=4).load(tmp_path)


def test_run_folders_of_the_peft_implementation_load(trained, tiny_backbone, data, tmp_path):
    """The PEFT implementation saved its adapters with PeftModel.save_pretrained: such a folder loads into the
    batched module with the same scores (and the module's own saves load into PEFT: tests/test_multi_lora.py)."""
    import shutil

    _, ev = data
    trained.save(tmp_path / "new")
    shutil.copytree(tmp_path / "new", tmp_path / "old")
    shutil.rmtree(tmp_path / "old" / "adapters")
    peft_model = make_method(tiny_backbone).load(tmp_path / "new").model.to_peft()
    peft_model.save_pretrained(str(tmp_path / "old" / "adapters"), selected_adapters=trained.member_names,
                               safe_serialization=True)
    old = make_method(tiny_backbone).load(tmp_path / "old")
    texts = render_all(tiny_backbone.tokenizer, ev["prompt"][:8], ev["chosen"][:8])
    torch.testing.assert_close(old.member_rewards(texts), trained.member_rewards(texts), atol=1e-6, rtol=1e-6)


def test_auto_flags():
    m = EnsLoRA(device="cpu")
    assert m.mixed_adapter_scoring is True and m.mixed_adapter_training is True  # measured faster on CPU too
    # under checkpointing too: the micro-batch, not the member loop, keeps the activations within memory
    m = EnsLoRA(device="cpu", gradient_checkpointing=True)
    assert m.mixed_adapter_scoring is True and m.mixed_adapter_training is True
    assert not EnsLoRA(device="cpu", mixed_adapter_training=False).mixed_adapter_training


@pytest.mark.parametrize("kw, match", [
    ({"num_members": 1}, "num_members"),
    ({"lora_rank": 0}, "lora_rank"),
    ({"learning_rate": 0.0}, "learning_rate"),
    ({"reg_lambda": -1.0}, "reg_lambda"),
    ({"beta": 0.0}, "beta"),
    ({"lora_dropout": 1.0}, "lora_dropout"),
    ({"head_init": "random"}, "head_init"),
    ({"batch_size": 0}, "batch_size"),
    ({"warmup_ratio": 1.0}, "warmup_ratio"),
    ({"mixed_adapter_scoring": "yes"}, "mixed_adapter_scoring"),
])
def test_bad_hyperparameters(kw, match):
    with pytest.raises(UserError, match=match):
        EnsLoRA(**{"device": "cpu", **kw})


@pytest.fixture(scope="module")
def tiny_classifier_backbone(tiny_backbone, tmp_path_factory):
    """A Skywork-style checkpoint (Qwen3ForSequenceClassification, 1 logit) built locally from the tiny model."""
    from omegaconf import OmegaConf
    from transformers import AutoModel, AutoTokenizer, Qwen3ForSequenceClassification

    from rewarduq_exp.models.backbone import Backbone

    folder = tmp_path_factory.mktemp("skywork-tiny")
    body = AutoModel.from_pretrained(tiny_backbone.source)
    config = body.config
    config.num_labels = 1
    clf = Qwen3ForSequenceClassification(config)
    clf.model.load_state_dict(body.state_dict())
    torch.manual_seed(5)
    torch.nn.init.normal_(clf.score.weight, std=0.2)
    clf.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_backbone.source).save_pretrained(folder)
    cfg = OmegaConf.create({"name": "skywork-tiny", "hub_id": None, "revision": None, "path": str(folder),
                            "dtype": "float32", "trust_remote_code": False})
    return Backbone(cfg, device="cpu"), clf.eval()


def test_pretrained_head_for_skywork(tiny_classifier_backbone, data, tmp_path):
    backbone, clf = tiny_classifier_backbone
    _, ev = data
    m = make_method(backbone)  # head_init=auto -> pretrained for skywork-*
    m._build()
    assert m.head_init_used == "pretrained"
    torch.testing.assert_close(m.head.detach(), clf.score.weight.detach().expand(3, -1))
    # LoRA B starts at zero, so every member starts as the pretrained reward model itself.
    texts = render_all(backbone.tokenizer, ev["prompt"][:6], ev["chosen"][:6])
    r = m.member_rewards(texts)
    enc = backbone.tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = clf(**enc).logits[:, 0].double()
    for k in range(3):
        torch.testing.assert_close(r[k], expected, atol=1e-5, rtol=1e-5)
    fresh = make_method(backbone, head_init="fresh")
    fresh._build()
    assert fresh.head_init_used == "fresh" and not torch.allclose(fresh.head[0], fresh.head[1])
    # load() rebuilds the body with AutoModel from the classifier checkpoint and takes the heads from the save
    m.save(tmp_path)
    loaded = make_method(backbone).load(tmp_path)
    torch.testing.assert_close(loaded.member_rewards(texts), r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model, reg_lambda", [("qwen3-4b", 0.001), ("skywork-qwen3-1.7b", 0.01), ("qwen3-8b", 0.01)])
def test_configs_compose_with_tuned_values(model, reg_lambda):
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from rewarduq_exp.runner.cli import register_resolvers

    register_resolvers()
    conf = str(Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose("train", overrides=["method=ens_lora", f"model={model}"])
        # no tuned file above 4B: the method defaults apply (the paper ran ENS-LoRA up to 4B)
        assert cfg.method.learning_rate == pytest.approx(1e-4)
        assert cfg.method.reg_lambda == pytest.approx(reg_lambda)
        assert cfg.method.center_gamma == pytest.approx(0.01)
        assert list(cfg.also_evaluate) == ([] if model == "qwen3-8b" else ["reward_bench"])
        m = EnsLoRA(**{k: v for k, v in cfg.method.items() if k != "_target_"} | {"device": "cpu"})
        assert m.num_members == 8 and m.lora_rank == 16 and m.target_modules == "all-linear"
        sweep = compose("train", overrides=["sweep=ens_lora", "model=qwen3-0.6b"], return_hydra_config=True)
        params = sweep.hydra.sweeper.params
        assert params["method.learning_rate"] == "1e-5,1e-4,1e-3"
        assert params["method.reg_lambda"] == "0.001,0.01,0.1"
        assert sweep.method._target_.endswith("EnsLoRA") and sweep.method.reg_lambda == pytest.approx(0.01)


def test_bf16_training_and_scoring_on_cpu(tiny_model_cfg, tiny_backbone, cache_dir, data):
    """The tiny model kept in bfloat16 on CPU (model.keep_dtype_on_cpu=true): the GPU's bf16 path, runnable here.
    (Half the data of the other tests: CPU bf16 matmuls are emulated and slow.)"""
    from omegaconf import OmegaConf

    from rewarduq_exp.models.backbone import Backbone

    train, ev = data
    train, ev = train.iloc[:32], ev.iloc[:12]
    cfg = OmegaConf.merge(tiny_model_cfg, {"dtype": "bfloat16", "keep_dtype_on_cpu": True})
    bf16 = make_method(Backbone(cfg, cache_dir=cache_dir, device="cpu"), num_members=2)  # 2 steps, 2 members
    bf16.fit(train)
    assert all(np.isfinite(h["loss"]) for h in bf16.history)
    lora = [p for n, p in bf16.model.named_parameters() if "lora_" in n]
    assert {p.dtype for p in lora} == {torch.float32} and bf16.head.dtype == torch.float32  # trained in fp32
    assert {p.dtype for n, p in bf16.model.named_parameters() if "lora_" not in n} == {torch.bfloat16}
    s = bf16.score(ev["prompt"], ev["chosen"])
    assert np.all(np.isfinite(s.reward)) and np.all(s.lower <= s.reward) and np.all(s.reward <= s.upper)
    # The same data, seed and steps in fp32: bf16 rounding (~3 significant digits per matmul) moves the rewards a
    # little (measured: 0.024 at most on rewards spread 0.69, correlation 0.9999), but the model must learn the same
    # thing.
    fp32 = make_method(tiny_backbone, num_members=2)
    fp32.fit(train)
    ref = fp32.score(ev["prompt"], ev["chosen"])
    assert np.corrcoef(s.reward, ref.reward)[0, 1] > 0.99


def test_anchor_forms_by_hand(tiny_backbone):
    """anchor=l2: ||theta - theta_0||_2 over the member's LoRA + head parameters (the authors' form, which Table 1's
    lambdas were tuned with); anchor=mean_squared: the per-parameter mean of (theta - theta_0)^2. Per member, and for
    all members at once (the batched path) with the same values."""
    values = {}
    for anchor in ("l2", "mean_squared"):
        m = make_method(tiny_backbone, anchor=anchor)
        m._build()
        lora = m.model.lora_parameters()
        for p in lora:
            p.requires_grad_(True)
        m._lora0 = [p.detach().clone() for p in lora]
        m._head0 = m.head.detach().clone()
        # At theta = theta_0 the anchor is 0 and its gradient finite (the L2 norm's is 0 there, not NaN).
        start = m._anchor()
        start.sum().backward()
        assert start.detach().tolist() == [0.0, 0.0, 0.0]
        assert all(torch.isfinite(p.grad).all() for p in lora)
        member0 = m._lora_params()[0]
        n_lora = member0[0].numel()
        total = sum(p.numel() for p in member0) + m.head.shape[1]
        with torch.no_grad():
            lora[0][0].add_(0.5)      # every element of member 0's first LoRA matrix moves by 0.5
            m.head[0].add_(0.25)      # every head weight of member 0 by 0.25
        squares = n_lora * 0.25 + m.head.shape[1] * 0.0625
        values[anchor] = float(m._anchor(0).detach())
        expected = squares ** 0.5 if anchor == "l2" else squares / total
        assert values[anchor] == pytest.approx(expected, rel=1e-5)
        together = m._anchor().detach()
        assert together[0] == pytest.approx(values[anchor], rel=1e-6) and together[1:].tolist() == [0.0, 0.0]
    assert values["l2"] > 100 * values["mean_squared"]  # the same lambda is a much stronger pull in the l2 form
    with pytest.raises(UserError, match="method.anchor='l1' is invalid; allowed: l2, mean_squared"):
        make_method(tiny_backbone, anchor="l1")


@pytest.mark.parametrize("mixed", [True, False], ids=["batched", "per_member"])
def test_micro_batches_give_the_full_batch_step(tiny_backbone, data, mixed):
    """Micro-batches of 3 pairs (forward + backward each, the anchor once per step) train what one forward of the
    whole batch of 16 trains: the pair weights are normalised by the step's batch, so the gradients add up. Uneven
    weights, a last micro-batch of 1 pair, and checkpointing on for the micro-batched run."""
    train, ev = data
    train = train.copy()
    train["weight"] = np.linspace(0.3, 2.0, len(train))
    runs = {}
    for micro, ckpt in ((16, False), (3, True)):
        m = make_method(tiny_backbone, micro_batch_size=micro, gradient_checkpointing=ckpt,
                        mixed_adapter_training=mixed)
        m.fit(train)
        assert m.training_plan["micro_batch_size"] == micro and m.training_plan["gradient_checkpointing"] is ckpt
        runs[micro] = m
    # float32 sums in another order (per micro-batch): ~1e-7 here; AdamW moves an element whose gradient is at
    # rounding level by up to lr, so the rewards are compared, not every weight
    np.testing.assert_allclose([h["loss"] for h in runs[3].history], [h["loss"] for h in runs[16].history], rtol=1e-5)
    texts = render_all(tiny_backbone.tokenizer, ev["prompt"][:8], ev["chosen"][:8])
    torch.testing.assert_close(runs[3].member_rewards(texts), runs[16].member_rewards(texts), atol=1e-4, rtol=1e-4)


def test_auto_micro_batch_and_checkpointing_follow_the_free_memory(tiny_backbone, data, monkeypatch):
    from rewarduq_exp.models import token_budget

    train, _ = data
    m = make_method(tiny_backbone, num_epochs=0.25)
    m.fit(train)
    assert m.training_plan["micro_batch_size"] == 16 and not m.training_plan["gradient_checkpointing"]
    monkeypatch.setattr(token_budget, "free_bytes", lambda device: 2**20)   # 1 MiB: not one pair without it
    m = make_method(tiny_backbone, num_epochs=0.25)
    m.fit(train)
    assert m.training_plan["gradient_checkpointing"] and m.training_plan["micro_batch_size"] < 16
