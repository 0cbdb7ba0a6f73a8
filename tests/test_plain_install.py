"""A plain install: ``pip install .`` (no extras, not editable) gives a working ``train.py`` and a Python API that
loads runs from any directory.

The installed package must carry what a run needs: its dependencies declared (the launchers' submitit among them),
the launcher plugins (``hydra_plugins.rewarduq_launchers``) and the config tree (``rewarduq_exp/conf``). The test
meets the package as a user does, offline and in well under a minute:

* The repository's files (git's list: tracked, and untracked but not ignored) are copied to a temporary folder, so
  that no ``build/`` or ``*.egg-info`` lands in the repository. pip builds the wheel from that copy (what
  ``pip install .`` builds) with this environment's setuptools.
* A fresh venv (``python -m venv --without-pip``) gets the wheel from this environment's pip (``--python``) with
  ``--no-index`` and no pip configuration (no find-links, no extra index): nothing can be downloaded, so the install
  succeeds only where every requirement is already satisfied. Its dependencies are a folder of links to the
  distributions of this test environment that the wheel's own ``Requires-Dist`` (no extras) needs, followed
  transitively, named in a ``.pth`` file of the fresh venv by a plain path line: pip counts them as installed (it
  reads their ``.dist-info``), and this environment's own ``.pth`` files (its editable finder of rewarduq_exp among
  them) are not processed. A package that the code imports but pyproject.toml does not declare is absent there, as
  on a user's machine, and the run fails.
* ``train.py`` runs from the copy with the copy's own ``rewarduq_exp/`` and ``hydra_plugins/`` removed, so the
  package, its launchers (the default ``rewarduq_basic`` imports hydra-submitit-launcher) and the command-line checks
  come from the fresh venv; Hydra composes the ``conf/`` beside ``train.py``, as in any checkout.
* From another folder, the fresh venv's python loads that run with ``load_run`` and scores texts: the dataset and
  method registries read the packaged config tree.
"""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, cache_with_tiny_model
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.e2e  # end to end: make test-e2e (.ci/run), not make test

SMALL = ["progress=false", "dataset.n_train=200", "dataset.n_eval=100", "dataset.n_ood=100", "metric.diagrams=false"]

SCORE = """
import json, sys
import rewarduq_exp
from rewarduq_exp import load_run
from rewarduq_exp.data.registry import CONF_DIR
from hydra_plugins.rewarduq_launchers import skip_completed

model = load_run(sys.argv[1], device="cpu", progress=False)
scores = model.score(["Tell me about the sea.", "Write about a garden."], ["The sea is calm today.", "Roses."])
print(json.dumps({"package": rewarduq_exp.__file__, "conf": str(CONF_DIR), "launchers": skip_completed.__file__,
                  "slurm": skip_completed.SkipCompletedSlurmLauncher.__name__,
                  "scores": scores[["reward", "lower", "upper"]].to_numpy().tolist()}))
"""


def copy_sources(dest: Path) -> Path:
    """The repository's files as git lists them (tracked, and untracked but not ignored; deleted ones left out)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    return dest


def wheel_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(zf.read(name).decode()).get_all("Requires-Dist") or []


def requirement_closure(requires: list[str]) -> list[metadata.Distribution]:
    """The distributions of this environment that ``requires`` needs (without extras of its own), transitively; one
    that is missing fails here, naming it."""
    found: dict[str, metadata.Distribution] = {}
    done: set[tuple[str, str]] = set()
    todo = [(Requirement(r), "") for r in requires]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if name not in found:
            try:
                found[name] = metadata.distribution(req.name)
            except metadata.PackageNotFoundError:
                raise AssertionError(f"{req.name} (required) is not installed in the test environment") from None
        for wanted in ("", *sorted(req.extras)):
            if (name, wanted) not in done:
                done.add((name, wanted))
                todo += [(Requirement(r), wanted) for r in found[name].requires or []]
    return list(found.values())


def link_distributions(dists: list[metadata.Distribution], folder: Path) -> Path:
    """A folder of links to the top-level entries (packages, modules, ``.dist-info``) of ``dists``."""
    folder.mkdir()
    for dist in dists:
        assert dist.files is not None, f"{dist.metadata['Name']}: no RECORD, its files are unknown"
        site = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files} - {"..", "__pycache__"}:
            if not top.endswith(".pth") and (site / top).exists() and not (folder / top).exists():
                (folder / top).symlink_to(site / top)
    return folder


def fresh_venv(folder: Path, dependencies: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "test_dependencies.pth").write_text(f"{dependencies}\n")
    return python


def files_under(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def run(cmd: list, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_plain_install_trains_and_loads_runs_from_any_folder(tmp_path, tiny_backbone):
    # No pip configuration (this machine's find-links or extra index), and nothing of the repository on the path.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_CONFIG_FILE"] = os.devnull
    src = copy_sources(tmp_path / "src")
    pip, offline = [sys.executable, "-m", "pip"], ["--quiet", "--no-cache-dir", "--no-index"]
    run([*pip, "wheel", *offline, "--no-deps", "--no-build-isolation", "--wheel-dir", tmp_path / "wheels", src],
        tmp_path, env)
    (wheel,) = (tmp_path / "wheels").glob("rewarduq_exp-*.whl")
    requires = wheel_requirements(wheel)
    assert {"submitit", "hydra-submitit-launcher"} <= {canonicalize_name(Requirement(r).name) for r in requires
                                                       if Requirement(r).marker is None}
    deps = link_distributions(requirement_closure(requires), tmp_path / "dependencies")
    venv = tmp_path / "venv"
    python = fresh_venv(venv, deps)
    run([*pip, "--python", python, "install", *offline, wheel], tmp_path, env)

    # train.py as from a checkout, but with the package and the launchers only in the fresh venv.
    shutil.rmtree(src / "rewarduq_exp")
    shutil.rmtree(src / "hydra_plugins")
    cache = cache_with_tiny_model(tmp_path / "cache", tiny_backbone)
    folder = tmp_path / "outputs" / "runs" / "plain"
    run([python, "train.py", *SMALL, f"paths.output_root={tmp_path / 'outputs'}", f"paths.cache_dir={cache}",
         f"hydra.run.dir={folder}"], src, env)
    assert json.loads((folder / "status.json").read_text())["state"] == "completed"

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = json.loads(run([python, "-c", SCORE, folder], elsewhere, env).stdout.strip().splitlines()[-1])
    for key in ("package", "conf", "launchers"):
        assert Path(out[key]).resolve().is_relative_to(venv.resolve()), (key, out[key])
    assert out["slurm"] == "SkipCompletedSlurmLauncher"
    # The whole config tree is packaged, not only what this run read (every yaml, the json shapes).
    assert files_under(Path(out["conf"])) == files_under(src / "conf")
    scores = np.array(out["scores"])
    assert scores.shape == (2, 3) and np.isfinite(scores).all()
    assert (scores[:, 1] <= scores[:, 0]).all() and (scores[:, 0] <= scores[:, 2]).all()
