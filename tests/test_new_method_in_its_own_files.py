"""A new method needs its own module and its own config, and no edit anywhere else.

A copy of the repository's code gets two new files, exactly what the contributor's page (docs/contributing.md,
"Adding a method") asks for: ``rewarduq_exp/methods/toy_head.py`` (a linear head on cached features with a
made-up uncertainty) and ``conf/method/toy_head.yaml``. Then, as a user would, in that copy: ``train.py
method=toy_head plan=true`` plans it, ``train.py method=toy_head`` trains, saves, evaluates and prints the summary,
and a fresh process loads the run folder (``load_run``) and scores. Then the method-facing tests of the copy run
on it as on every shipped method: the contract, the settings, and the bounds (the toy's integer setting declares its
bound on its field; ``toy_head.num_features=0`` is refused in one line before anything runs). Nothing else of the copy
differs from the repository (checked), so a method that needed a name added to a table somewhere (a list of the
methods in a test, the bounds table) would fail here.
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

from torch import nn

from rewarduq_exp.core.setting_bounds import Bound
from rewarduq_exp.methods.base import FeatureHeadMethod, bradley_terry_nll, weighted_mean
from rewarduq_exp.methods.settings import FeatureHeadSettings, positive, setting
from rewarduq_exp.models.memory_plan import HeadMemory


@dataclass(kw_only=True)
class ToyHeadSettings(FeatureHeadSettings, config="toy_head"):
    """Defaults: conf/method/toy_head.yaml."""

    learning_rate: float = setting(check=positive(), doc="AdamW's peak learning rate")
    beta: float = setting(check=positive(cast=float), doc="bounds reward +- beta * u")
    batch_size: int = setting(bound=Bound(1, 65_536, "pairs", "a batch's activations are held at once"),
                              doc="pairs per step")
    num_features: int = setting(bound=Bound(1, 4096, "features", "the head reads the first num_features features"),
                                doc="features the head reads")


class ToyHead(FeatureHeadMethod):
    name = "toy_head"
    settings_class = ToyHeadSettings

    def __init__(self, encoder=None, **values):
        super().__init__(encoder, **values)
        self.head = None

    @classmethod
    def head_memory(cls, ctx, feature_dim, batch):
        d = min(ctx.method.num_features, feature_dim)   # the checked settings: an int, not a config node
        return HeadMemory(d, {"toy head (weights, grads, AdamW x2)": 4 * d * 4}, 6 * d * 2 * ctx.n_train)

    def _build(self, feature_dim):
        self.head = nn.Linear(min(self.num_features, feature_dim), 1, bias=False).to(self.device)

    def _fit_features(self, zc, zr, weight):
        d = self.head.in_features

        def batch_loss(index):
            margin = self.head(zc[index, :d] - zr[index, :d]).squeeze(-1)
            return weighted_mean(bradley_terry_nll(margin), weight[index]), {}

        self._train_loop(self.head.parameters(), batch_loss, len(zc), self.schedule, desc="toy training")

    def _score_features(self, z):
        r = self.head(z[:, :self.head.in_features]).squeeze(-1)
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
num_features: 4096
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


PARTS = ("rewarduq_exp", "conf", "hydra_plugins", "tests")
# The tests that every method meets, run in the copy on the toy method as on the shipped ones (their parameters come
# from the method table), the contract's and the bounds' included.
METHOD_FACING_TESTS = ["tests/test_method_contract.py", "tests/test_method_settings.py", "tests/test_setting_bounds.py"]


def copy_of_the_repository(target):
    """The tracked code, configs and tests of this checkout (what a contributor's clone holds), without docs."""
    for part in PARTS:
        shutil.copytree(ROOT / part, target / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for path in [*ROOT.glob("*.py"), ROOT / "pyproject.toml"]:   # the entry points (train, evaluate, downstream, ...)
        shutil.copy2(path, target / path.name)


def test_a_method_in_its_own_module_and_config_plans_trains_loads_and_scores(tmp_path, shared_cache):
    repo = tmp_path / "repo"
    copy_of_the_repository(repo)
    (repo / "rewarduq_exp" / "methods" / "toy_head.py").write_text(textwrap.dedent(TOY_MODULE))
    (repo / "conf" / "method" / "toy_head.yaml").write_text(TOY_CONFIG)
    # the copy is the repository plus the two files, nothing else
    for part in PARTS:
        diff = subprocess.run(["diff", "-rq", "-x", "__pycache__", str(ROOT / part), str(repo / part)],
                              capture_output=True, text=True)
        extra = [line for line in diff.stdout.splitlines() if "toy_head" not in line]
        assert not extra, extra

    def python(*args, status=0):
        env = {"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin", "TQDM_DISABLE": "1", "WANDB_MODE": "offline",
               "HOME": str(tmp_path)}
        proc = subprocess.run([sys.executable, *args], cwd=repo, capture_output=True, text=True, env=env,
                              timeout=900)
        assert proc.returncode == status, (proc.stdout + proc.stderr)[-3000:]
        return proc.stdout + (proc.stderr if status else "")

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

    # its integer setting's bound, declared on its field, holds on the command line (before anything runs)
    refused = python("train.py", "method=toy_head", "method.num_features=0", *paths, status=2)
    assert "method.num_features=0 is invalid: must be an integer >= 1" in refused.splitlines()[-1]
    assert "too large: at most 4096 features" in python("train.py", "method=toy_head", "method.num_features=5000",
                                                        *paths, status=2)

    # the tests every method meets, on the toy method too (their parameters come from the method table)
    out = python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not e2e",
                 *METHOD_FACING_TESTS)
    assert " failed" not in out and " passed" in out, out[-3000:]
    listed = python("-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *METHOD_FACING_TESTS)
    assert "toy_head" in listed   # parametrised over the toy method as well
