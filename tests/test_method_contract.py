"""Every method config builds a class that implements the one method contract (rewarduq_exp.methods.base.RewardMethod),
and the code that drives methods asks their capability flags, never their type.

The methods are the method table's (rewarduq_exp.methods.registry: read from conf/method/*.yaml), never a list written
here: a method added by its module and config is tested by the same tests
(tests/test_new_method_in_its_own_files.py runs them on a toy method)."""

import inspect
import json
import re

import pytest
from conftest import ROOT
from hydra.utils import get_class
from omegaconf import OmegaConf

from rewarduq_exp.methods.base import (
    LabelRankingMethod,
    RewardMethod,
    constructor_settings,
    load_method,
)
from rewarduq_exp.methods.registry import method_class, method_names

ALL_METHODS = method_names()
# The reward models (trained on pairs, or on rated responses: BoRP); the label-ranking learners (task
# "label_ranking") train on feature matrices, not text.
METHODS = [m for m in ALL_METHODS if method_class(m).task != "label_ranking"]
LEARNERS = sorted(set(ALL_METHODS) - set(METHODS))


def test_the_table_is_the_method_configs():
    """Every conf/method/*.yaml is a method of the table, built (as Hydra builds it) from its _target_."""
    assert ALL_METHODS == sorted(p.stem for p in (ROOT / "conf" / "method").glob("*.yaml"))
    for name in ALL_METHODS:
        assert get_class(OmegaConf.load(ROOT / "conf" / "method" / f"{name}.yaml")._target_) is method_class(name)


@pytest.mark.parametrize("option", METHODS)
def test_every_method_implements_the_contract(option):
    cls = get_class(OmegaConf.load(ROOT / "conf" / "method" / f"{option}.yaml")._target_)
    assert issubclass(cls, RewardMethod) and not inspect.isabstract(cls), cls
    assert cls.name == option
    # frozen features through the cache (ENS-MLP, BAY-LIN), a fine-tuned backbone (ENS-LoRA, MCD-DPO), or neither
    # (BoRP reads its own contrastive hidden states)
    assert not (cls.uses_feature_cache and cls.fine_tunes_backbone)
    assert cls.task in ("preferences", "pointwise")
    assert isinstance(cls.uses_eval_set, bool)


@pytest.mark.parametrize("module", ["runner/train_run", "runner/evaluation", "runner/evaluate_run",
                                    "runner/trained_run", "api"])
def test_method_drivers_ask_flags_not_types(module):
    source = (ROOT / "rewarduq_exp" / f"{module}.py").read_text()
    assert not re.search(r"isinstance\([^)]*(Method|EnsMLP|BayLin|EnsLoRA|McdDpo)\b", source)
    assert "hasattr(method" not in source
    assert ".encoder = " not in source  # the backbone comes in at construction (encoder=...), not assigned later


@pytest.mark.parametrize("option", ALL_METHODS)
def test_saved_hyperparameters_rebuild_every_trained_setting(option):
    """load_method rebuilds a method from method.json's hyperparameters; every constructor setting that is not
    saved there must be a runtime setting (device, progress, batch sizes for scoring), never one that changes what
    the method learned or how it scores."""
    cls = get_class(OmegaConf.load(ROOT / "conf" / "method" / f"{option}.yaml")._target_)
    saved = set(cls().hyperparameters())
    runtime = set(cls.settings_class.runtime_names())
    assert constructor_settings(cls) - saved <= runtime | {"encoder"}
    assert not saved & runtime


def test_load_follows_the_class_in_method_json(tmp_path):
    import torch

    from rewarduq_exp.core.errors import UserError
    from rewarduq_exp.methods.bay_lin import BayLin
    from rewarduq_exp.methods.ens_mlp import EnsMLP

    trained = EnsMLP(num_heads=3, hidden_dim=8, beta=1.5, seed=4, device="cpu", show_progress=False)
    trained._build(5)
    trained.save(tmp_path)
    loaded = load_method(tmp_path, encoder=None, device="cpu", show_progress=False)
    assert type(loaded) is EnsMLP and (loaded.num_heads, loaded.hidden_dim, loaded.beta) == (3, 8, 1.5)
    z = torch.randn(7, 5)
    assert torch.equal(loaded.heads(z), trained.heads(z))
    # A run folder whose config says bay_lin but whose model/ holds ENS-MLP weights loads what was saved.
    assert not isinstance(loaded, BayLin)

    info = json.loads((tmp_path / "method.json").read_text())
    (tmp_path / "method.json").write_text(json.dumps({**info, "class": "rewarduq_exp.methods.gone.Gone"}))
    with pytest.raises(UserError, match="cannot import"):
        load_method(tmp_path, encoder=None)


def test_the_learners_are_the_label_ranking_methods():
    from rewarduq_exp.methods.label_ranking import LEARNERS as REGISTRY

    assert LEARNERS == sorted(REGISTRY)
    assert {"bay_lin", "borp", "ens_lora", "ens_mlp", "epinet", "la_lora", "mcd_dpo"} <= set(METHODS)
    for name in LEARNERS:
        cls = get_class(OmegaConf.load(ROOT / "conf" / "method" / f"{name}.yaml")._target_)
        assert cls is REGISTRY[name] and cls.task == "label_ranking" and cls.name == name
        assert issubclass(cls, LabelRankingMethod) and not inspect.isabstract(cls), cls
