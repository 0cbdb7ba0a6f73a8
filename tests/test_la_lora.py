"""LA-LoRA (rewarduq_exp/methods/lora/la_lora.py): one PEFT LoRA adapter + head trained as ENS-LoRA member 0 is, a
K-FAC Laplace posterior whose factors, prior precision, evidence and GLM predictive equal laplace-torch's, scores
with u larger off the training distribution, save/load, damaged files, the command line and the planner.

Tolerances: ENS-LoRA runs the same member through its batched multi-LoRA module (another summation order: 1e-5 after
a few Adam steps on the tiny model, see tests/test_ens_lora.py); laplace-torch computes the factors with curvlinops in
float32 in another order (1e-6 relative seen) and eigendecomposes them in float32 where we use float64 (1e-5)."""

import importlib.util
import json
import re
import sys

import numpy as np
import pytest
import torch

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.contract import render_all
from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.methods.lora.la_lora import LaLoRA

# laplace-torch is the extra 'laplace' (make setup installs it); without it only the one-line refusal is tested
needs_laplace = pytest.mark.skipif(importlib.util.find_spec("laplace") is None, reason="laplace-torch not installed")


class _Encoder:
    def __init__(self, backbone):
        self.backbone = backbone


SMALL = {"lora_rank": 4, "lora_alpha": 8, "learning_rate": 3e-3, "batch_size": 16, "seed": 0, "device": "cpu",
         "show_progress": False, "log_every": 1}


def make_method(backbone, **kw):
    return LaLoRA(encoder=_Encoder(backbone), **{**SMALL, **kw})


@pytest.fixture(scope="module")
def data():
    world = SyntheticWorld(seed=0, n_train=48, n_eval=16, n_ood=16)
    return world.load("train"), world.load("eval"), world.load("ood")


@pytest.fixture(scope="module")
def trained(tiny_backbone, data):
    return make_method(tiny_backbone, num_epochs=2).fit(data[0])   # 6 steps


def la_lora_case(backbone):
    """(fit, state) for tests/test_training_resume.py: the trained weights and the posterior's prior precision."""
    pytest.importorskip("laplace")
    train = SyntheticWorld(seed=0, n_train=64, n_eval=8, n_ood=8).load("train")

    def fit():
        return make_method(backbone, batch_size=8).fit(train)

    def state(m):
        return {**{f"lora.{i}": p for i, p in enumerate(m._lora_weights())}, "head": m.head,
                "prior_precision": torch.tensor(m.posterior.prior_precision)}

    return fit, state


@needs_laplace
def test_trains_as_ens_lora_member_0(trained, tiny_backbone, data):
    """The same seed, loss, anchor, schedule and clipping as ENS-LoRA's member 0 (whose gradient is that of its own
    run): the same weights, through PEFT's Linear adapters instead of the stacked module."""
    from rewarduq_exp.methods.ens_lora import EnsLoRA

    ens = EnsLoRA(encoder=_Encoder(tiny_backbone), num_members=2, num_epochs=2, **SMALL).fit(data[0])
    for ours, member in zip(trained._lora_weights(), ens._lora_params()[0]):
        torch.testing.assert_close(ours, member, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(trained.head[0], ens.head[0], atol=1e-5, rtol=1e-5)
    assert "grad_norm" in trained.history[0] and trained.fit_summary["steps"] == 6
    summary = trained.fit_summary
    assert summary["laplace_blocks"] == 2 * 7 + 1 and summary["prior_precision_used"] > 0
    assert 0 < summary["effective_parameters"] < summary["laplace_parameters"]
    # loading the backbone and adding the adapters is its own time, not counted as tokenizing
    assert summary["seconds_build"] > 0 and summary["seconds_tokenize"] > 0


@needs_laplace
def test_scores_bounds_and_u_larger_off_the_training_distribution(trained, data):
    train, ev, ood = data
    c, r = trained.score_pairs(ev)
    for s in (c, r):
        assert np.all(s.u > 0) and np.all(s.lower < s.reward) and np.all(s.reward < s.upper)
        np.testing.assert_allclose(s.upper - s.reward, trained.beta * s.u)
    direct = trained.score(ev["prompt"], ev["chosen"])   # one text at a time in other batches: the same numbers
    np.testing.assert_allclose(direct.reward, c.reward, atol=1e-5)
    np.testing.assert_allclose(direct.u, c.u, rtol=1e-4)
    tc, tr = trained.score_pairs(train)
    assert np.mean(tc.reward > tr.reward) > 0.7
    oc, orr = trained.score_pairs(ood)
    # ood texts use the world's rare words: the posterior is wider there than on the texts it was fitted on
    assert np.mean(np.r_[oc.u, orr.u]) > 1.1 * np.mean(np.r_[tc.u, tr.u])


@needs_laplace
@pytest.mark.filterwarnings("ignore:By default `link_approx`", "ignore:There is a performance drop")
def test_curvature_prior_and_predictive_equal_laplace_torch(tiny_backbone, data):
    """laplace-torch itself (KronLaplace with reward modelling, curvlinops' K-FAC) on unpadded texts of one length:
    the same Kronecker factors, marglik prior precision, log evidence, and GLM predictive mean and variance (these
    on texts of other lengths too, which our batches pad)."""
    from laplace import Laplace
    from torch.utils.data import DataLoader

    from rewarduq_exp.methods.posteriors import KronPosterior

    train = data[0].iloc[:16]
    m = make_method(tiny_backbone, target_modules=["q_proj", "down_proj"])
    m._build()
    with torch.no_grad():   # a trained-like B: lora_A gets curvature too
        for p in m._lora_weights()[1::2]:
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    tok, length = tiny_backbone.tokenizer, 14
    chosen = [s[:length] for s in m._tokenize(render_all(tok, train["prompt"], train["chosen"]))]
    rejected = [s[:length] for s in m._tokenize(render_all(tok, train["prompt"], train["rejected"]))]
    factors, log_lik = m._curvature(chosen, rejected, None, torch.ones(len(chosen)))

    def collate(items):   # a pair batch: chosen rows, then rejected rows (RewardNetwork's reward-modelling logits)
        ids = torch.tensor([c for c, _ in items] + [r for _, r in items])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.ones(len(items)).long()}

    for p in m._trainable():
        p.requires_grad_(True)
    # one example = one text (N_data = 2 x pairs): laplace-torch then divides the input factor by every position
    lib = Laplace(m.network, "reward_modeling", subset_of_weights="all", hessian_structure="kron",
                  asdl_fisher_kwargs={"num_per_example_loss_terms": 1})
    lib.fit(DataLoader(list(zip(chosen, rejected)), batch_size=8, collate_fn=collate))
    assert list(factors) == list(m._layers()) and len(lib.H_facs.kfacs) == len(factors) == 5
    for (g, a), (g_lib, a_lib) in zip(factors.values(), lib.H_facs.kfacs):
        torch.testing.assert_close(g, g_lib, rtol=1e-4, atol=1e-6 * float(g_lib.abs().max()))
        torch.testing.assert_close(a, a_lib, rtol=1e-4, atol=1e-6 * float(a_lib.abs().max()))
    assert -log_lik == pytest.approx(float(lib.loss), rel=1e-6)

    posterior = KronPosterior.from_factors(dict(factors))
    theta_sq = float(sum(p.detach().double().pow(2).sum() for p in m._trainable()))
    delta = posterior.optimise_prior_precision(theta_sq)
    lib.optimize_prior_precision(method="marglik", pred_type="glm", n_steps=300, lr=0.1)
    assert delta == pytest.approx(float(lib.prior_precision), rel=1e-3)
    # laplace-torch evaluates the evidence in float32: 1.03e-5 apart on an AVX-512 Xeon, closer on an AVX2 EPYC
    assert posterior.log_evidence(log_lik, theta_sq) == pytest.approx(
        float(lib.log_marginal_likelihood(torch.tensor([delta]))), rel=5e-5)

    m.posterior = posterior
    lib.prior_precision = torch.tensor([delta])
    texts = [chosen[0], rejected[1][:9], chosen[2][:5]]
    for p in m._trainable():
        p.requires_grad_(False)
    reward, u = m.reward_and_u(texts)
    for p in m._trainable():
        p.requires_grad_(True)
    for i, seq in enumerate(texts):
        mean, var = lib({"input_ids": torch.tensor([seq]), "attention_mask": torch.ones(1, len(seq)).long()},
                        pred_type="glm")
        assert reward[i] == pytest.approx(float(mean), abs=1e-5)
        assert u[i] ** 2 == pytest.approx(float(var), rel=1e-4)


@needs_laplace
def test_save_load_gives_identical_scores(trained, tiny_backbone, data, tmp_path):
    from rewarduq_exp.methods.base import load_method

    _, ev, _ = data
    trained.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"adapter", "head.safetensors", "laplace.safetensors",
                                                    "method.json"}
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    loaded = load_method(tmp_path, encoder=_Encoder(tiny_backbone), device="cpu", show_progress=False)
    assert type(loaded) is LaLoRA and loaded.posterior.prior_precision == trained.posterior.prior_precision
    for a, b in zip(trained.score_pairs(ev), loaded.score_pairs(ev)):
        np.testing.assert_array_equal(a.reward, b.reward)
        np.testing.assert_array_equal(a.u, b.u)


def _damage_factor(folder):
    """laplace.safetensors with the head's input eigenvectors 10x larger than the head (rewritten, a valid file)."""
    from safetensors.torch import load_file, save_file

    path = folder / "laplace.safetensors"
    tensors = load_file(str(path))
    tensors["head.in_vectors"] = torch.zeros(2560, 2560)
    save_file(tensors, str(path))


@needs_laplace
@pytest.mark.parametrize("damage, pattern", [
    (lambda f: (f / "laplace.safetensors").write_bytes((f / "laplace.safetensors").read_bytes()[:-100]),
     r"laplace\.safetensors.*(truncated|cut|short|bytes)"),
    (_damage_factor, r"laplace\.safetensors: tensor 'head\.in_vectors' declares shape \(2560, 2560\) .* allow shape "
                     r"\(256, 256\)"),
    (lambda f: (f / "laplace.safetensors").unlink(), r"laplace\.safetensors"),
])
def test_a_damaged_posterior_file_is_one_line(trained, tiny_backbone, tmp_path, damage, pattern):
    from rewarduq_exp.methods.base import load_method

    trained.save(tmp_path)
    damage(tmp_path)
    with pytest.raises(UserError) as error:
        load_method(tmp_path, encoder=_Encoder(tiny_backbone), device="cpu", show_progress=False)
    assert "\n" not in str(error.value) and re.search(pattern, str(error.value)), str(error.value)


def test_without_laplace_torch_one_line_says_how_to_install(tiny_backbone, data, monkeypatch):
    monkeypatch.setitem(sys.modules, "laplace.utils.matrix", None)   # import fails as where it is not installed
    with pytest.raises(UserError, match=r"install it with: pip install 'rewarduq_exp\[laplace\]'$") as error:
        make_method(tiny_backbone).fit(data[0])
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("value", [0, -1.0, "auto", True, float("inf")])
def test_bad_prior_precision(value):
    with pytest.raises(UserError, match="method.prior_precision"):
        LaLoRA(device="cpu", prior_precision=value)


@needs_laplace
def test_command_line_run_and_plan(tmp_path, shared_cache):
    from test_cli import run

    folder = tmp_path / "outputs" / "runs" / "la_lora"
    run("train.py", ["method=la_lora", "progress=false", "dataset.n_train=64", "dataset.n_eval=32",
                     "dataset.n_ood=32", "method.lora_rank=4", "metric.diagrams=false", f"hydra.run.dir={folder}"],
        tmp_path, shared_cache)
    assert json.loads((folder / "status.json").read_text())["state"] == "completed"
    metrics = json.loads((folder / "metrics.json").read_text())
    assert list(metrics) == ["synthetic_eval", "synthetic_ood"] and metrics["synthetic_eval"]["bound_width"] > 0
    summary = json.loads((folder / "model" / "method.json").read_text())["fit_summary"]
    assert summary["prior_precision_used"] > 0 and summary["seconds_laplace"] > 0
    # the factors of every trained weight, float32: sum of out^2 + in^2 over the adapter's 2 x 7 x layers weights
    # and the head's (qwen3-0.6b: 28 layers, d 1024, q 2048, kv 1024, I 3072; qwen3-4b: 36, 2560, 4096, 1024, 9728)
    for model, factors in (("qwen3-0.6b", "4.82 GiB"), ("qwen3-4b", "49.03 GiB")):
        proc = run("train.py", ["method=la_lora", f"model={model}", "dataset=ultrafeedback", "plan=true"], tmp_path,
                   shared_cache)
        assert re.search(rf"K-FAC factors \(float32\) +{factors}", proc.stdout), proc.stdout
        assert "expected peak per device" in proc.stdout and "decomposition:" in proc.stdout, proc.stdout


@needs_laplace
@pytest.mark.slow
def test_two_processes_equal_one(tmp_path, tiny_backbone):
    """Data-parallel training, the curvature summed over the processes' pairs (one all-reduce per factor), sharded
    scoring: what one process gives (the smooth anchor, as tests/test_distributed.py's ENS-LoRA check)."""
    from test_distributed import FORKED_RANKS, ONE, TOL, _assert_one_run_folder, _run, assert_same_predictions

    settings = ("method=la_lora", "method.anchor=mean_squared", "method.lora_rank=4")
    one = _run(tmp_path / "one", tiny_backbone, "la_lora", ONE, *settings)
    two = _run(tmp_path / "two", tiny_backbone, "la_lora", FORKED_RANKS, *settings)
    assert _assert_one_run_folder(two)["fit"]["processes"] == 2
    assert_same_predictions(one, two, TOL)
    fits = [json.loads((r / "model" / "method.json").read_text())["fit_summary"] for r in (one, two)]
    assert fits[1]["prior_precision_used"] == pytest.approx(fits[0]["prior_precision_used"], rel=1e-4)
