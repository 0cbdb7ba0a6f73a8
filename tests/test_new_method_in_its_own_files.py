"""A new method needs its own module and its own config, and no edit anywhere else.

A copy of the repository's code gets two new files, exactly what the contributor's page (docs/contributing.md,
"Adding a method") asks for: ``rewarduq_exp/methods/toy_head.py`` (a linear head on cached features with a
made-up uncertainty) and ``conf/method/toy_head.yaml``. Then, as a user would, in that copy: ``train.py
method=toy_head plan=true`` plans it, ``train.py method=toy_head`` trains, saves, evaluates and prints the summary,
and a fresh process loads the run folder (``load_run``) and scores. Nothing else of the copy differs from the
repository (checked), so a method that needed a name added to a table somewhere would fail here.
"""

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

pytestmark = pytest.mark.e2e  # end to end: make test-e2e (.ci/run), not make test

TOY_MODULE = '''
"""A throwaway method for the test: a linear reward head, u = |r| / 10 + 0.1 (made up)."""

from dataclasses import dataclass

import torch
from torch import nn

from rewarduq_exp.methods.base import FeatureHeadMethod, bradley_terry_nll, weighted_mean
from rewarduq_exp.methods.settings import FeatureHeadSettings, positive, setting
from rewarduq_exp.models.memory_plan import HeadMemory


@dataclass(kw_only=True)
class ToyHeadSettings(FeatureHeadSettings, config="toy_head"):
    """Defaults: conf/method/toy_head.yaml."""

    learning_rate: float = setting(check=positive(), doc="AdamW's peak learning rate")
    beta: float = setting(check=positive(cast=float), doc="bounds reward +- beta * u")
    batch_size: int = setting(check=positive(integer=True), doc="pairs per step")


class ToyHead(FeatureHeadMethod):
    name = "toy_head"
    settings_class = ToyHeadSettings

    def __init__(self, encoder=None, **values):
        super().__init__(encoder, **values)
        self.head = None

    @classmethod
    def head_memory(cls, ctx, feature_dim, batch):
        return HeadMemory(feature_dim, {"toy head (weights, grads, AdamW x2)": 4 * feature_dim * 4},
                          6 * feature_dim * 2 * ctx.n_train)

    def _build(self, feature_dim):
        self.head = nn.Linear(feature_dim, 1, bias=False).to(self.device)

    def _fit_features(self, zc, zr, weight):
        def batch_loss(index):
            margin = self.head(zc[index] - zr[index]).squeeze(-1)
            return weighted_mean(bradley_terry_nll(margin), weight[index]), {}

        self._train_loop(self.head.parameters(), batch_loss, len(zc), self.schedule, desc="toy training")

    def _score_features(self, z):
        r = self.head(z).squeeze(-1)
        return r, r.abs() / 10 + 0.1

    def state_tensors(self):
        return {"head.weight": self.head.weight}

    def load_state_tensors(self, tensors):
        self._build(tensors["head.weight"].shape[1])
        self.head.load_state_dict({"weight": tensors["head.weight"]})
'''

TOY_CONFIG = """\
# A throwaway method (tests/test_new_method_in_its_own_files.py).
_target_: rewarduq_exp.methods.toy_head.ToyHead
learning_rate: 1.0e-2
beta: 1.0
batch_size: 32
seed: ${seed}
device: ${device}
show_progress: ${progress}
"""

SCORE = """
import sys
from rewarduq_exp.api import load_run

model = load_run(sys.argv[1], device="cpu", progress=False)
table = model.score(["Name a colour."], ["Blue."], raw=True)
print(model.method.name, table.to_json(orient="records", double_precision=15))
"""

RUN = ["model=tiny-qwen3", "device=cpu", "progress=false", "metric.diagrams=false", "dataset.n_train=96",
       "dataset.n_eval=32", "dataset.n_ood=32", "dataset.n_cal=32"]


def copy_of_the_repository(target):
    """The tracked code and configs of this checkout (what a contributor's clone holds), without tests or docs."""
    for part in ("rewarduq_exp", "conf", "hydra_plugins"):
        shutil.copytree(ROOT / part, target / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("train.py", "evaluate.py", "pyproject.toml"):
        shutil.copy2(ROOT / name, target / name)


def test_a_method_in_its_own_module_and_config_plans_trains_loads_and_scores(tmp_path, shared_cache):
    repo = tmp_path / "repo"
    copy_of_the_repository(repo)
    (repo / "rewarduq_exp" / "methods" / "toy_head.py").write_text(textwrap.dedent(TOY_MODULE))
    (repo / "conf" / "method" / "toy_head.yaml").write_text(TOY_CONFIG)
    # the copy is the repository plus the two files, nothing else
    for part in ("rewarduq_exp", "conf", "hydra_plugins"):
        diff = subprocess.run(["diff", "-rq", "-x", "__pycache__", str(ROOT / part), str(repo / part)],
                              capture_output=True, text=True)
        extra = [line for line in diff.stdout.splitlines() if "toy_head" not in line]
        assert not extra, extra

    def python(*args):
        env = {"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin", "TQDM_DISABLE": "1", "WANDB_MODE": "offline",
               "HOME": str(tmp_path)}
        proc = subprocess.run([sys.executable, *args], cwd=repo, capture_output=True, text=True, env=env,
                              timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        return proc.stdout

    paths = [f"paths.output_root={tmp_path / 'outputs'}", f"paths.cache_dir={shared_cache}"]
    plan = python("train.py", "method=toy_head", "model=qwen3-0.6b", "plan=true", *paths)
    assert "plan: method=toy_head model=qwen3-0.6b" in plan and "toy head (weights, grads, AdamW x2)" in plan
    folder = tmp_path / "outputs" / "runs" / "toy"
    out = python("train.py", "method=toy_head", *RUN, *paths, f"hydra.run.dir={folder}")
    assert "synthetic_eval" in out and "win_rate" in out
    info = json.loads((folder / "model" / "method.json").read_text())
    assert info["method"] == "toy_head" and info["class"] == "rewarduq_exp.methods.toy_head.ToyHead"
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["synthetic_eval"]["win_rate"] > 0.5          # it learned something
    scored = python("-c", SCORE, str(folder))
    name, table = scored.strip().split(" ", 1)
    row = json.loads(table)[0]
    assert name == "toy_head" and abs(row["uncertainty"] - (abs(row["reward"]) / 10 + 0.1)) < 1e-6   # its own u
