"""Shared fixtures: the tiny offline backbone (built once per session in a temp cache) and a quiet, offline env."""

import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

# Tests never touch the network and never print progress bars.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def tiny_model_cfg():
    return OmegaConf.load(ROOT / "conf" / "model" / "tiny-qwen3.yaml")


@pytest.fixture(scope="session")
def tiny_backbone(cache_dir, tiny_model_cfg):
    from rewarduq_exp.backbone import Backbone

    return Backbone(tiny_model_cfg, cache_dir=cache_dir, device="cpu")


@pytest.fixture(scope="session")
def tokenizer(tiny_backbone):
    return tiny_backbone.tokenizer
