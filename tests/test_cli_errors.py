"""Command-line mistakes as a user makes them: one ``error:`` line on stderr naming the setting and what is allowed,
exit status 2, and, where the command is refused before Hydra starts, no run folder. Data-file errors say where the
problem is as an editor does: line N, counted from 1."""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import ROOT
from entry_points import run_entry_point

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.local import LocalPreferenceFile

SEED_RANGE = "must be an integer in [0, 4294967295]"

REFUSED = [
    ("train.py", ["-m", "seed=0,1", "--cfg", "job"], "--multirun and --cfg cannot be combined: give one of them"),
    ("evaluate.py", ["run=r", "--cfg", "job", "--info"], "--cfg and --info cannot be combined"),
    ("train.py", ["seed=99999999999999999999999"], f"seed=99999999999999999999999 is invalid: {SEED_RANGE}"),
    ("train.py", ["seed=4294967296"], f"seed=4294967296 is invalid: {SEED_RANGE}"),  # numpy would take it as 0
    ("train.py", ["method.seed=-1"], f"method.seed=-1 is invalid: {SEED_RANGE}"),
    ("train.py", ["dataset=reward_bench", "dataset.sample_seed=4294967296"], "dataset.sample_seed=4294967296 is "
                                                                            f"invalid: {SEED_RANGE}"),
    ("train.py", ["-m", "seed=1,abc"], f"seed=abc is invalid: {SEED_RANGE}"),
    ("train.py", ["dataset.n_train=abc"], "dataset.n_train=abc is invalid: must be a number (its default is 8000)"),
    ("train.py", ["max_length=[1]"], "max_length=[1] is invalid: must be a number (its default is 2048)"),
    ("train.py", ["progress=maybe"], "progress=maybe is invalid: must be true or false"),
    ("train.py", ["force=1"], "force=1 is invalid: must be true or false"),
    ("train.py", ["plan=maybe"], "plan=maybe is invalid: must be true or false"),
    ("train.py", ["model.trust_remote_code=yes please"], "model.trust_remote_code=yes please is invalid: must be "
                                                          "true or false"),
    ("train.py", ["checkpoint=5"], "checkpoint=5 is invalid: checkpoint is a group of settings (every_steps, "
                                   "every_minutes), not one value"),
    ("train.py", ["hydra.job.chdir=maybe"], "hydra.job.chdir=maybe is invalid: Value 'maybe' is not a valid bool"),
    ("train.py", ["seed=["], "seed=[ is not a valid override (no viable alternative at input '[')"),
    ("evaluate.py", ["predictions=p.parquet", "progress=maybe"], "progress=maybe is invalid: must be true or false"),
    ("evaluate.py", ["predictions=p.parquet", "trust_remote_code=2"], "trust_remote_code=2 is invalid: must be "
                                                                      "true or false"),
    ("downstream.py", ["run=r", "progress=maybe"], "progress=maybe is invalid: must be true or false"),
    ("downstream.py", ["run=r", "task.seed=4294967296"], f"task.seed=4294967296 is invalid: {SEED_RANGE}"),
    ("downstream.py", ["run=r", "task=active_learning", "task.seed=x"], f"task.seed=x is invalid: {SEED_RANGE}"),
]


@pytest.mark.parametrize("script, args, message", REFUSED, ids=[f"{s} {' '.join(a)}" for s, a, _ in REFUSED])
def test_refused_before_starting_in_one_line(tmp_path, script, args, message):
    proc = run_entry_point(ROOT / script, [*args, f"paths.output_root={tmp_path / 'outputs'}"], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr
    assert not (tmp_path / "outputs").exists()  # refused before Hydra made a run folder


ACCEPTED = [["seed=4294967295"], ["progress=false", "force=true"], ["checkpoint.every_minutes=0.5"],
            ["dataset.n_train=600", "method.beta=0.5"], ["checkpoint.every_minutes=null"], ["seed=${max_length}"]]


@pytest.mark.parametrize("args", ACCEPTED, ids=" ".join)
def test_values_of_the_right_kind_pass(tmp_path, args):
    """Numbers where the default is a whole number (minutes, a beta), null where a number may be off, the largest
    seed, interpolations: no refusal (``--cfg job`` prints the config and runs nothing)."""
    proc = run_entry_point(ROOT / "train.py", ["--cfg", "job", *args, f"paths.output_root={tmp_path}"], tmp_path)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.e2e
def test_wandb_without_login_is_one_line(tmp_path, shared_cache):
    """No API key anywhere wandb looks (environment, netrc, its settings) and no terminal to ask: one line saying
    how to log in or log offline. wandb stops before any network call."""
    pytest.importorskip("wandb")
    folder = tmp_path / "outputs" / "runs" / "wb"
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": "", "NETRC": str(tmp_path / "no_netrc"),
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"), "WANDB_SILENT": "true"}
    proc = run_entry_point(ROOT / "train.py", ["logger=wandb", "progress=false", "dataset.n_train=200",
                                               f"paths.cache_dir={shared_cache}", f"hydra.run.dir={folder}"],
                           tmp_path, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith("error: logger=wandb cannot log in") and "wandb login" in line
    assert "WANDB_MODE=offline" in line and "Traceback" not in proc.stderr
    assert not folder.exists()   # a setting to fix, nothing ran: the single run leaves no folder (a sweep records it)


def test_evaluate_dataset_option_of_the_wrong_kind():
    """``evaluate.py dataset.n_eval=abc``: the evaluated dataset's config is known only once the run is read; its
    value is checked against that config's own."""
    from rewarduq_exp.data.registry import load_dataset_config, resolve_eval_sets, with_options

    sets = resolve_eval_sets(["synthetic_eval"], None, 0, None)
    with pytest.raises(UserError, match=r"^dataset\.n_eval=abc is invalid: must be a number \(its default is 1000\)"):
        with_options(sets, {"n_eval": "abc"})
    with pytest.raises(UserError, match=rf"^dataset\.seed=-2 is invalid: {SEED_RANGE.replace('[', '.')}"):
        with_options(sets, {"seed": -2})
    assert with_options(sets, {"n_eval": 50})[0].config.n_eval == 50
    assert load_dataset_config("synthetic", 0).n_eval == 1000


# ---------------------------------------------------------------------------------------------- data files
GOOD = {"prompt": "Question?", "chosen": "A fine answer.", "rejected": "No."}


def _lines(third: bytes) -> bytes:
    """Line 1 a pair, line 2 blank (readers skip it: it is no row), line 3 ``third``, line 4 a pair."""
    good = json.dumps(GOOD).encode()
    return b"\n".join([good, b"", third, good]) + b"\n"


BAD_UTF8 = json.dumps(GOOD).encode().replace(b"fine", b"f\xffine")
BAD_JSON = b'{"prompt": "Question?" "chosen": "A", "rejected": "B"}'
DATA_FILES = [
    ("bad.jsonl", _lines(BAD_UTF8), "column 'chosen' holds text that is not valid UTF-8 (line 3)"),
    ("bad.jsonl.gz", gzip.compress(_lines(BAD_UTF8)), "not valid UTF-8 (line 3)"),
    ("bad.csv", b"prompt,chosen,rejected\nQ,A,B\n\nQ,\"two\nlines\",B\nQ,f\xffine,B\n", "not valid UTF-8 at line 6"),
    ("bad.jsonl", _lines(BAD_JSON), "could not be read as json (not valid JSON at line 3: Expecting ',' delimiter)"),
    ("bad.jsonl.gz", gzip.compress(_lines(BAD_JSON)), "(not valid JSON at line 3: Expecting ',' delimiter)"),
    ("bad.json", b'[\n' + json.dumps(GOOD).encode() + b',\n\n' + BAD_JSON + b'\n]\n',
     "(not valid JSON at line 4: Expecting ',' delimiter)"),
]


@pytest.mark.parametrize("name, content, message", DATA_FILES, ids=[f"{n}: {m[:30]}" for n, _, m in DATA_FILES])
def test_data_file_errors_name_the_line_from_one(tmp_path, name, content, message):
    """Invalid UTF-8 and invalid JSON are both reported at the line an editor shows (blank lines and a CSV's header
    counted, a quoted field over two lines too): the readers themselves count rows from 0 or from 1."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(UserError) as err:
        LocalPreferenceFile(str(path), eval_fraction=0).load("train")
    assert message in str(err.value) and str(path) in str(err.value)


def test_invalid_json_through_train_py(tmp_path, shared_cache):
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(_lines(BAD_JSON))
    folder = tmp_path / "outputs" / "runs" / "bad"
    proc = run_entry_point(ROOT / "train.py", ["dataset=local", f"dataset.path={path}", "dataset.eval_fraction=0",
                                               f"dataset.eval_path={path}", "progress=false",
                                               f"paths.cache_dir={shared_cache}", f"hydra.run.dir={folder}"], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: dataset 'local'"), proc.stderr
    assert lines[0].endswith("could not be read as json (not valid JSON at line 3: Expecting ',' delimiter)")
    assert not (folder / "metrics.json").exists()


DOWNSTREAM_SETTINGS = [
    (["task=best_of_n", "task.k_grid=[-1]"], "task.k_grid=[-1] is invalid: must be a non-empty list of numbers >= 0"),
    (["task=best_of_n", "task.select_share=1.5"], "task.select_share=1.5 is invalid: must be a number in (0, 1)"),
    (["task=best_of_n", "task.ks=[0]"], "task.ks=[0] is invalid: must be a non-empty list of numbers > 0"),
    (["task=active_learning", "task.pool=10"], "task.initial + task.rounds * task.batch = 700 exceeds task.pool=10"),
]


@pytest.mark.parametrize("args, message", DOWNSTREAM_SETTINGS, ids=[" ".join(a) for a, _ in DOWNSTREAM_SETTINGS])
def test_downstream_settings_are_checked_before_any_run_is_read(tmp_path, args, message):
    """Fourth hardening round, item 10: the task's own settings come first, before any run folder is read or any
    model loaded (the run named here does not exist: reading it first would give another line)."""
    proc = run_entry_point(ROOT / "downstream.py", ["run=no_such_run", *args, "progress=false",
                                                    f"hydra.run.dir={tmp_path / 'task'}"], tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
