"""``load_run``: what it writes, and what it says about arguments it cannot take (issue 42).

Loading a run writes nothing unless told where: not into the run folder, and not into the ``paths.cache_dir`` that the
run's saved config names (a folder of another machine or user; the tiny model used to be built there). Without
``cache_dir`` what must be built goes into a temporary folder that is removed afterwards; with it, into that folder.
Arguments of the wrong kind (``path`` None, a number, bytes; ``cache_dir`` a file; a lone surrogate in a text) are
one :class:`UserError` line naming the argument and what is allowed, never a traceback from deep inside.
"""

import gc
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_cli import NO_FIGURES, run

import rewarduq_exp as r
from rewarduq_exp.core.errors import UserError


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, shared_cache):
    """One small completed BAY-LIN run."""
    cwd = tmp_path_factory.mktemp("load_run_inputs")
    folder = cwd / "outputs" / "runs" / "bay_lin"
    run("train.py", ["method=bay_lin", "progress=false", "dataset.n_train=100", "dataset.n_eval=20",
                     "dataset.n_ood=8", "eval_datasets=[synthetic_eval]", *NO_FIGURES, f"hydra.run.dir={folder}"],
        cwd, shared_cache)
    return folder


def snapshot(folder: Path) -> dict:
    """Every entry below ``folder`` (links not followed): a link by its target, a file by its bytes and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            if path.is_symlink():
                out[str(path.relative_to(folder))] = ("link", os.readlink(path))
            elif path.is_dir():
                out[str(path.relative_to(folder))] = ("folder",)
            else:
                out[str(path.relative_to(folder))] = ("file", path.read_bytes(), path.stat().st_mtime_ns)
    return out


def with_cache_dir(run_dir: Path, copy: Path, cache_dir: str) -> Path:
    """A copy of the run whose saved config says ``paths.cache_dir: <cache_dir>``."""
    shutil.copytree(run_dir, copy)
    config = OmegaConf.load(copy / ".hydra" / "config.yaml")
    config.paths.cache_dir = cache_dir
    OmegaConf.save(config, copy / ".hydra" / "config.yaml")
    return copy


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """The temporary folders load_run makes, in a folder of this test."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_loading_writes_nothing_into_the_cache_the_run_names(relative, run_dir, tmp_path, private_tmp, monkeypatch):
    """The run's config names a cache folder (absolute, or relative to where it was launched: here the working
    directory): it is left as it was, and so is the run folder; the temporary folder goes once the model does."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "models").mkdir(parents=True)
    (elsewhere / "keep.txt").write_text("someone else's cache")
    monkeypatch.chdir(tmp_path)
    copy = with_cache_dir(run_dir, tmp_path / "run", "elsewhere" if relative else str(elsewhere))
    before = {p: snapshot(p) for p in (elsewhere, copy)}

    model = r.load_run(copy, progress=False, device="cpu")
    table = model.score(["What is 2+2?"], ["4"])
    assert len(table) == 1 and table["uncertainty"].notna().all()
    assert [p.name for p in private_tmp.iterdir()]  # the tiny model was built here, for as long as it is used
    for path, was in before.items():
        assert snapshot(path) == was, path
    del model, table
    gc.collect()
    assert list(private_tmp.iterdir()) == []


def test_a_given_cache_dir_keeps_the_model(run_dir, tmp_path, private_tmp):
    cache = tmp_path / "my_cache"
    run_before = snapshot(run_dir)
    model = r.load_run(run_dir, progress=False, device="cpu", cache_dir=cache)
    model.score(["a"], ["b"])
    built = [p.name for p in (cache / "models").iterdir() if (p / "build_spec.json").is_file()]
    assert len(built) == 1 and built[0].startswith("tiny-qwen3-")
    assert snapshot(run_dir) == run_before and list(private_tmp.iterdir()) == []


def error_line(call) -> str:
    with pytest.raises(UserError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and isinstance(caught.value, ValueError)
    return message


@pytest.mark.parametrize("value, got", [(None, "got NoneType"), (123, "got int"),
                                        (b"outputs/runs/x", "got bytes (decode it first: os.fsdecode(...))"),
                                        (["outputs/runs/x"], "got list")])
def test_a_path_of_the_wrong_kind_is_one_line(value, got, private_tmp):
    message = error_line(lambda: r.load_run(value))
    assert message == (f"path={value!r} is invalid: must be a run folder as a str or an os.PathLike (e.g. "
                       f"pathlib.Path), {got}")
    assert list(private_tmp.iterdir()) == []


@pytest.mark.parametrize("value, says", [("", "path='' is invalid: must be a run folder as a str or an os.PathLike "
                                               "(e.g. pathlib.Path), not empty"),
                                         ("runs/a\0b", "path='runs/a\\x00b' is invalid: a path cannot hold a NUL "
                                                       "character"),
                                         ("runs/\ud800", "path='runs/\\ud800' is invalid: '\\ud800' at character 5 "
                                                         "cannot be part of a file name on this system")])
def test_a_path_no_file_can_have_is_one_line(value, says):
    assert error_line(lambda: r.load_run(value)) == says


def test_a_cache_dir_that_is_a_file_is_one_line(run_dir, tmp_path, private_tmp):
    a_file = tmp_path / "cache.txt"
    a_file.write_text("not a folder")
    message = error_line(lambda: r.load_run(run_dir, cache_dir=a_file))
    assert message == (f"cache_dir={a_file} is not a folder: pass a folder to keep downloaded or built models in "
                       "(created when missing), or leave cache_dir out (a temporary folder, removed afterwards)")
    assert a_file.read_text() == "not a folder" and list(private_tmp.iterdir()) == []


@pytest.mark.parametrize("value", [123, b"cache"])
def test_a_cache_dir_of_the_wrong_kind_is_one_line(value, run_dir):
    message = error_line(lambda: r.load_run(run_dir, cache_dir=value))
    assert message.startswith(f"cache_dir={value!r} is invalid: must be a folder as a str or an os.PathLike (e.g. "
                              f"pathlib.Path), or None, got {type(value).__name__}")


@pytest.fixture(scope="module")
def model(run_dir):
    return r.load_run(run_dir, progress=False, device="cpu")


@pytest.mark.parametrize("prompts, completions, where", [
    (["\ud800"], ["fine"], "prompts[0] holds '\\ud800' at character 0"),
    (["fine", "fine"], ["fine", "ok \udcff"], "completions[1] holds '\\udcff' at character 3"),
    ([[{"role": "user", "content": "x\ud800y"}]], ["fine"], "prompts[0] holds '\\ud800' at character 1"),
])
def test_text_that_is_not_unicode_is_one_line(model, prompts, completions, where):
    message = error_line(lambda: model.score(prompts, completions))
    assert message.startswith(f"{where}, "), message
    assert "a lone surrogate, which is not text: prompts and completions must be valid Unicode" in message
    assert len(model.score(["fine"], ["text"])) == 1  # the model is as usable as before
