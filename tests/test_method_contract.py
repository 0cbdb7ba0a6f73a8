"""Every method config builds a class that implements the one method contract (rewarduq_exp.methods.base.RewardMethod),
and the code that drives methods asks their capability flags, never their type."""

import inspect
import re

import pytest
from conftest import ROOT
from hydra.utils import get_class
from omegaconf import OmegaConf

from rewarduq_exp.methods.base import RewardMethod

METHODS = sorted(p.stem for p in (ROOT / "conf" / "method").glob("*.yaml"))


@pytest.mark.parametrize("option", METHODS)
def test_every_method_implements_the_contract(option):
    cls = get_class(OmegaConf.load(ROOT / "conf" / "method" / f"{option}.yaml")._target_)
    assert issubclass(cls, RewardMethod) and not inspect.isabstract(cls), cls
    assert cls.name == option
    # today's four: frozen features through the cache (ENS-MLP, BAY-LIN) or a fine-tuned backbone (ENS-LoRA, MCD-DPO)
    assert cls.uses_feature_cache != cls.fine_tunes_backbone


@pytest.mark.parametrize("module", ["train_run", "evaluation", "evaluate_run", "trained_run", "api"])
def test_method_drivers_ask_flags_not_types(module):
    source = (ROOT / "rewarduq_exp" / f"{module}.py").read_text()
    assert not re.search(r"isinstance\([^)]*(Method|EnsMLP|BayLin|EnsLoRA|McdDpo)\b", source)
    assert "hasattr(method" not in source
