"""What an offline GPU node relies on: the preflight names a missing package in one line, the wheels' resolution keeps
the node's own versions, and the GPU check's limits and process runner do what they say.

The whole path (a simulated node image, ``make wheels`` from the index, the install without one, ``make gpu-check``)
is ``scripts/offline_node.sh`` (``make offline-node-check``): it downloads, so it is not part of the tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402
import preflight  # noqa: E402
import wheels  # noqa: E402


def test_preflight_names_exactly_the_one_missing_package(tmp_path):
    """This environment's packages minus xxhash (which datasets requires), seen by a Python that reads nothing else
    (``-S``: no site-packages, no .pth files): one ``missing:`` line, naming xxhash and who needs it; exit 2. The
    metadata check only (``--no-imports``: importing everything takes 12 s here); the imports with a wheel left out
    are what ``make offline-node-check`` (CI) runs, and the naming of an import failure is checked below."""
    site = Path(sysconfig.get_paths()["purelib"])
    links = tmp_path / "site"
    links.mkdir()
    for entry in site.iterdir():
        if entry.name.lower().startswith("xxhash") or entry.suffix == ".pth" or entry.name.startswith("__editable__"):
            continue
        (links / entry.name).symlink_to(entry)
    env = {**os.environ, "PYTHONPATH": str(links)}
    done = subprocess.run([sys.executable, "-S", str(ROOT / "scripts" / "preflight.py"), "--no-imports"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    missing = [line for line in done.stdout.splitlines() if line.startswith("missing:")]
    assert done.returncode == 2, done.stdout + done.stderr
    assert missing == ["missing: xxhash: not installed (required by datasets "
                       f"{metadata.version('datasets')}: xxhash)"], missing
    assert "make wheels" in done.stderr


def test_an_import_that_fails_is_named_by_the_package_that_provides_it(tmp_path, monkeypatch):
    (tmp_path / "uses_sklearn_and_more.py").write_text("import sklearn_nowhere.utils\n")
    (tmp_path / "broken_module.py").write_text("raise RuntimeError('compiled for another numpy')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(preflight.PROVIDED_BY, "sklearn_nowhere", "scikit-nowhere")
    problems = preflight.Problems()
    preflight.check_imports(["json", "uses_sklearn_and_more", "broken_module"], problems)
    assert list(problems.lines.values()) == [
        "scikit-nowhere: module 'sklearn_nowhere' cannot be imported, imported by uses_sklearn_and_more",
        "broken_module: import failed: RuntimeError: compiled for another numpy"]


def test_preflight_passes_here_and_maps_modules_to_packages():
    assert preflight.main(["--no-imports"]) == 0   # make setup's environment has every package
    assert preflight.provider("sklearn.utils.validation") == "scikit-learn"
    assert preflight.provider("hydra_plugins.hydra_submitit_launcher") == "hydra-submitit-launcher"
    assert preflight.provider("charset_normalizer.md") == "charset-normalizer"
    assert "ruff" not in " ".join(preflight.project_requirements(["dev"]))
    with pytest.raises(SystemExit, match="unknown extra nope; allowed: "):
        preflight.project_requirements(["nope"])


def test_node_freeze_is_read_as_pip_writes_it(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("# from the node\ntorch==2.11.0+cu130\nNumPy==2.3.1\n-e git+https://x/y.git#egg=y\n"
                      "pyarrow @ file:///wheels/pyarrow-25.0.1-cp312-cp312-linux_x86_64.whl\n\n")
    assert wheels.read_freeze(freeze) == {"torch": "2.11.0+cu130", "numpy": "2.3.1", "pyarrow": None}
    freeze.write_text("torch>=2\n")
    with pytest.raises(SystemExit, match="cannot read the line 'torch>=2'"):
        wheels.read_freeze(freeze)


def test_stand_in_wheels_keep_the_node_versions(tmp_path):
    """The node's packages enter pip's resolution for another Python and platform as stand-in wheels of their
    versions (a local build label included) with no requirements: the resolver keeps them, even where a wheel of the
    same version with a more specific platform tag is at hand (here one that requires a package nowhere to be found,
    as the index's torch requires its CUDA stack)."""
    links = tmp_path / "links"
    links.mkdir()
    pins = [f"torch=={wheels.stand_in_wheel(links, 'torch', '2.11.0+cu130')}",
            f"typing-extensions=={wheels.stand_in_wheel(links, 'typing-extensions', '4.12.0')}"]
    assert pins == ["torch==2.11.0+cu130.node", "typing-extensions==4.12.0+node"]
    wheels.metadata_wheel(links, "typing-extensions", "4.12.0", requires=["nowhere-to-be-found"],
                          tag="cp312-cp312-manylinux_2_28_x86_64")
    (tmp_path / "c.txt").write_text("".join(f"{p}\n" for p in pins))
    target = wheels.Target("3.12", ["manylinux_2_28_x86_64"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--no-index", "--find-links", str(links), "--report", str(tmp_path / "r.json"),
                           "--target", str(tmp_path / "t"), *target.args, "-c", str(tmp_path / "c.txt"),
                           "torch>=2.6", "typing_extensions>=4.10,<=4.12.0"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    got = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads((tmp_path / "r.json").read_text())
           ["install"]}
    assert got == {"torch": "2.11.0+cu130.node", "typing-extensions": "4.12.0+node"}


def test_default_node_keeps_only_what_the_heavy_packages_alone_need():
    """Closure over a resolution report: torch's CUDA stack is the node's; filelock, which the project needs too, is
    brought; a requirement whose marker does not hold on the target is not followed."""
    def item(name, *requires):
        return {"metadata": {"name": name, "version": "1", "requires_dist": list(requires)}}

    installs = [item("torch", "nvidia-cublas-cu12; platform_system == 'Linux'", "filelock", "pywin; sys_platform == "
                     "'win32'"), item("nvidia-cublas-cu12"), item("filelock"), item("pywin"),
                item("datasets", "filelock", "xxhash"), item("xxhash")]
    target = wheels.Target("3.12", ["manylinux_2_28_x86_64"])
    assert wheels.closure(installs, ["torch"], target) == {"torch", "nvidia-cublas-cu12", "filelock"}
    brought = wheels.closure(installs, ["torch", "datasets"], target, stop={"torch"})
    assert brought == {"datasets", "filelock", "xxhash"}


def test_gpu_limits_add_up_to_the_budget():
    gpu = {step: limits[0] for step, limits in gpu_check.LIMITS.items()}
    assert set(gpu) == set(gpu_check.STEPS)
    assert gpu_check.STARTUP_S + sum(gpu.values()) <= gpu_check.GPU_BUDGET_S <= 8 * 60


def test_jobs_stop_on_their_condition_and_die_at_the_limit(tmp_path):
    log = gpu_check.Log(tmp_path / "step.log")
    flag = tmp_path / "flag"
    trap = ("import signal, sys, time, pathlib\n"
            "signal.signal(signal.SIGTERM, lambda *a: (print('stopped by SIGTERM', flush=True), sys.exit(3)))\n"
            f"pathlib.Path({str(flag)!r}).touch()\n"
            "time.sleep(60)\n")
    stopped = gpu_check.Job([sys.executable, "-c", trap], stop_when=flag.exists)
    hang = gpu_check.Job([sys.executable, "-c", "import time; time.sleep(60)"])
    quick = gpu_check.Job([sys.executable, "-c", "print('done')"])
    gpu_check.run_jobs([stopped, hang, quick], log, timeout=5, parallel=3)
    assert (stopped.code, stopped.stopped) == (3, True) and "stopped by SIGTERM" in stopped.out
    assert hang.code == 124 and "killed after 5 s" in hang.out
    assert quick.code == 0 and quick.out.strip() == "done"
    assert log.path.read_text().count("[exit ") == 3
