"""Exact resumption: every method trained by gradient, stopped by a real SIGTERM in the middle of training, resumes
from its checkpoint and ends with the very parameters and training curve of a run that was never stopped.

MCD-DPO (TRL's trainer) has its own file, tests/test_mcd_dpo_resume.py; the command-line path (kill, relaunch, same
metrics.json) is tested in tests/test_cli_resume.py.
"""

import logging
import os
import signal

import numpy as np
import pytest
import torch
from safetensors import safe_open
from test_ens_mlp import separable_pairs
from test_la_lora import la_lora_case

from rewarduq_exp.core import job_signals, training_checkpoint
from rewarduq_exp.core.training_checkpoint import Phase, TrainingCheckpoints
from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.methods.adamw import FunctionalAdamW
from rewarduq_exp.methods.bay_lin import BayLin
from rewarduq_exp.methods.ddu import DduHead
from rewarduq_exp.methods.ens_lora import EnsLoRA
from rewarduq_exp.methods.ens_mlp import EnsMLP
from rewarduq_exp.methods.epinet import Epinet
from rewarduq_exp.methods.knn import KnnHead
from rewarduq_exp.methods.label_ranking import PlackettLuceNet, RankClassifierNet
from rewarduq_exp.methods.sngp import Sngp
from rewarduq_exp.ranking.permutations import orderings_to_ranks
from rewarduq_exp.ranking.plackett_luce import PlackettLuce


@pytest.fixture(autouse=True)
def signals():
    job_signals.install()
    yield
    job_signals.uninstall()


def rankings(n=90, m=4, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3))
    orderings = PlackettLuce(X @ rng.normal(size=(3, m)) * 2).sample(rng, 1)[:, 0]
    return X, orderings_to_ranks(orderings)


class _Encoder:
    def __init__(self, backbone):
        self.backbone = backbone


def _feature_head(cls, **kw):
    """(fit, state) of a head on fixed features, fit the way FeatureHeadMethod.fit runs it (seeded RNG fork)."""
    zc, zr, w = separable_pairs(n=96, d=12)

    def fit():
        m = cls(seed=3, device="cpu", show_progress=False, log_every=1, batch_size=16, num_epochs=2, **kw)
        m._build(zc.shape[1])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(m.seed)
            m._fit_features(zc, zr, w)
        return m

    return fit, lambda m: m.state_tensors()


def _ens_lora(backbone):
    train = SyntheticWorld(seed=0, n_train=64, n_eval=8, n_ood=8).load("train")

    def fit():
        m = EnsLoRA(encoder=_Encoder(backbone), num_members=2, lora_rank=4, lora_alpha=8, learning_rate=3e-3,
                    batch_size=8, num_epochs=1, seed=0, device="cpu", show_progress=False, log_every=1)
        return m.fit(train)

    return fit, lambda m: {**{f"lora.{i}": p for i, p in enumerate(p for g in m._lora_params() for p in g)},
                           "head": m.head}


def _ranking(cls):
    X, ranks = rankings()

    def fit():
        return cls(seed=7, num_epochs=3, batch_size=16, log_every=1).fit(X, ranks)

    return fit, lambda m: {k: torch.as_tensor(v) for k, v in m.fitted_arrays().items()}


CASES = {
    "ens_mlp": lambda backbone: _feature_head(EnsMLP, num_heads=3, hidden_dim=8, learning_rate=1e-2),
    "bay_lin": lambda backbone: _feature_head(BayLin, learning_rate=1e-2),
    "epinet": lambda backbone: _feature_head(Epinet, hidden_dim=8, index_dim=3, learning_rate=1e-2),
    "knn": lambda backbone: _feature_head(KnnHead, hidden_dim=8, learning_rate=1e-2),
    "ddu": lambda backbone: _feature_head(DduHead, hidden_dim=8, learning_rate=1e-2),
    "sngp": lambda backbone: _feature_head(Sngp, hidden_dim=8, num_random_features=16, learning_rate=1e-2),
    "ens_lora": _ens_lora,
    "la_lora": la_lora_case,
    "plackett_luce": lambda backbone: _ranking(PlackettLuceNet),
    "rank_classifier": lambda backbone: _ranking(RankClassifierNet),
}


def _sigterm_at(monkeypatch, step: int):
    """A real SIGTERM to this process when the loop reaches optimizer step ``step``."""
    due = Phase.due

    def signalling_due(self, at):
        if at == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return due(self, at)

    monkeypatch.setattr(Phase, "due", signalling_due)


def _assert_same(state_a: dict, state_b: dict):
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        torch.testing.assert_close(state_b[key], state_a[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_run_stopped_by_sigterm_resumes_exactly(name, request, tmp_path, monkeypatch, caplog):
    backbone = request.getfixturevalue("tiny_backbone") if name.endswith("_lora") else None
    fit, state = CASES[name](backbone)
    torch.manual_seed(0)
    reference = fit()
    expected, curve = {k: v.detach().clone() for k, v in state(reference).items()}, reference.history

    def checkpoints():
        return TrainingCheckpoints(tmp_path / "checkpoint", "hash", every_steps=None)

    with monkeypatch.context() as patch:
        _sigterm_at(patch, 3)
        torch.manual_seed(0)
        with training_checkpoint.activate(checkpoints()), pytest.raises(job_signals.TrainingInterrupted) as stop:
            fit()
    assert stop.value.signum == signal.SIGTERM and "at step 3 of" in str(stop.value)
    (saved,) = (tmp_path / "checkpoint").iterdir()
    with safe_open(str(saved), framework="pt") as fh:   # safetensors + a JSON header: nothing is unpickled
        assert '"step": 3' in fh.metadata()["state"]

    job_signals.install()   # a new attempt (a new process in real life)
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="rewarduq_exp"), training_checkpoint.activate(checkpoints()) as ck:
        resumed = fit()
    assert "resumed at step 3 of" in caplog.text
    assert ck.resumed and "step 3 of" in ck.resumed[0]
    _assert_same(expected, state(resumed))
    assert resumed.history == curve                       # the training curve is continuous and the same

    # Once done, the phase keeps its result: an attempt killed while scoring does not train again.
    monkeypatch.setattr(FunctionalAdamW, "step", lambda *a, **k: pytest.fail("trained again"))
    with training_checkpoint.activate(checkpoints()):
        again = fit()
    _assert_same(expected, state(again))


def test_checkpoints_save_on_their_schedule_and_a_foreign_one_is_not_taken(tmp_path, caplog):
    fit, state = _ranking(PlackettLuceNet)
    with training_checkpoint.activate(TrainingCheckpoints(tmp_path, "hash", every_steps=4)):
        fit()
    (path,) = tmp_path.iterdir()
    with safe_open(str(path), framework="pt") as fh:
        assert '"done": true' in fh.metadata()["state"]
    # Another config's checkpoint in the folder (force=false, reused folder): never read, training starts at 0.
    with caplog.at_level(logging.WARNING, logger="rewarduq_exp"), \
            training_checkpoint.activate(TrainingCheckpoints(tmp_path, "other", every_steps=4)) as ck:
        fit()
    assert "belongs to another config" in caplog.text and not ck.resumed


def test_without_an_active_run_nothing_is_saved(tmp_path, monkeypatch):
    fit, _ = _ranking(PlackettLuceNet)
    monkeypatch.chdir(tmp_path)
    fit()
    assert not list(tmp_path.iterdir())
