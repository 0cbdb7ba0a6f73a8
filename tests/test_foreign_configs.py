"""Reading a run folder is reading data: its config never calls a resolver, never reads the environment and never
makes anything be written outside the folder; its YAML and JSON files are bounded in size, depth and count.

One small real run is trained once; each case edits a copy of it (a ``${unique_run_dir:...}`` in every section of
``.hydra/config.yaml``, ``${oc.env:...}`` values, a YAML alias bomb, huge, long and deep lists in ``model/method.json``)
and reads it through ``evaluate.py`` (exit status 2, one ``error:`` line naming the file) and through
``rewarduq_exp.load_run`` with the project's resolvers registered (one-line ``UserError``). Nothing appears at the
path a resolver names and the refused folder is left byte for byte as it was. A folder as ``train.py`` writes it
(``${seed}`` references, the ``${oc.env:...,null}`` of ``paths``) still evaluates.
"""

import json
import shutil
from pathlib import Path

import pytest
import test_untrusted_run_folders as untrusted
import yaml
from test_cli import run

import rewarduq_exp as r
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.runner.cli import register_resolvers

CONFIG = Path(".hydra") / "config.yaml"
METHOD_JSON = Path("model") / "method.json"
SECRET = "REWARDUQ_TEST_SECRET"
snapshot = untrusted.snapshot
trained = untrusted.trained  # the same small run, trained once for this module


@pytest.fixture
def copy(trained, tmp_path) -> Path:
    return shutil.copytree(trained[1], tmp_path / "run")


def set_config_value(folder: Path, key: str, value) -> None:
    """Set ``key`` (dotted) of the folder's config.yaml, edited as plain YAML (nothing interpreted)."""
    path = folder / CONFIG
    config = yaml.safe_load(path.read_text())
    *parents, last = key.split(".")
    node = config
    for part in parents:
        node = node[part]
    node[last] = value
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def refused_by_both(cwd, folder: Path, shared_cache, named: Path, *, env=None) -> tuple[str, str]:
    """(evaluate.py's one error line, load_run's message): both refuse, in one line naming ``named``."""
    proc = run("evaluate.py", [f"run={folder}", "device=cpu"], cwd, shared_cache, check=False, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(folder / named) in lines[0], proc.stderr
    register_resolvers()  # as in any process that has composed the project's configs
    with pytest.raises(UserError) as error:
        r.load_run(folder, progress=False, device="cpu")
    message = str(error.value)
    assert "\n" not in message and str(folder / named) in message, message
    return lines[0], message


@pytest.mark.parametrize("key", ["model.name", "dataset.name", "probe.pooling", "method.beta", "metric.name",
                                 "paths.cache_dir"])
def test_a_resolver_in_any_section_is_refused_and_creates_nothing(key, trained, copy, shared_cache, tmp_path):
    cwd, _ = trained
    target = tmp_path / "elsewhere"
    set_config_value(copy, key, f"${{unique_run_dir:{target}/made}}")
    before = snapshot(copy)
    for line in refused_by_both(cwd, copy, shared_cache, CONFIG):
        assert f"{key} holds '${{unique_run_dir:" in line and "never a resolver call" in line, line
    assert not target.exists()
    assert snapshot(copy) == before


def test_the_environment_never_reaches_a_field(trained, copy, shared_cache, monkeypatch):
    cwd, _ = trained
    monkeypatch.setenv(SECRET, "s3cret-value")
    set_config_value(copy, "model.hub_id", f"${{oc.env:{SECRET}}}")
    for line in refused_by_both(cwd, copy, shared_cache, CONFIG, env={SECRET: "s3cret-value"}):
        assert f"model.hub_id holds '${{oc.env:{SECRET}}}'" in line and "s3cret-value" not in line

    # the form train.py writes into paths reads as its default: the reading process's environment is not the run's
    set_config_value(copy, "model.hub_id", None)
    set_config_value(copy, "paths.datasets_dir", f"${{oc.env:{SECRET},null}}")
    model = r.load_run(copy, progress=False, device="cpu")
    assert model.config.paths.datasets_dir is None
    # any other default (or place) is a resolver call like the rest
    set_config_value(copy, "paths.datasets_dir", f"${{oc.env:{SECRET},/data}}")
    with pytest.raises(UserError, match=r"paths.datasets_dir holds .* never a resolver call"):
        r.load_run(copy, progress=False, device="cpu")


def test_a_yaml_alias_bomb_is_refused(trained, copy, shared_cache):
    cwd, _ = trained
    path = copy / CONFIG
    levels = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    levels += [f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]
    path.write_text(path.read_text() + "bomb:\n" + "".join(f"  {line}\n" for line in levels))  # 9^9 values
    before = snapshot(copy)
    for line in refused_by_both(cwd, copy, shared_cache, CONFIG):
        assert "uses a YAML alias (*name)" in line, line
    assert snapshot(copy) == before


@pytest.mark.parametrize("case, betas, message", [
    ("huge", lambda b: b * 500_000, r"method.json \(the saved method\) is refused: \d+ bytes, more than the "),
    ("deep", None, r"method.json \(the saved method\) is refused: nested more than 64 levels deep"),
    ("long", lambda b: [0.9] * 65, r"hyperparameters.adam_betas is a list of 65 values; a setting holds at most 64"),
    ("three", lambda b: [0.9, 0.99, 0.999], r"adam_betas=a list of 3 values is invalid: must be two numbers"),
])
def test_huge_long_or_deep_values_in_method_json_are_refused(case, betas, message, trained, copy, shared_cache):
    import re

    cwd, _ = trained
    path = copy / METHOD_JSON
    info = json.loads(path.read_text())
    if betas is None:  # 10^6 nested lists, as text: json.dumps itself would recurse
        info["hyperparameters"]["adam_betas"] = "@"
        path.write_text(json.dumps(info).replace('"@"', "[" * 10**6 + "]" * 10**6))
    else:
        info["hyperparameters"]["adam_betas"] = betas(info["hyperparameters"]["adam_betas"])
        path.write_text(json.dumps(info))
    before = snapshot(copy)
    for line in refused_by_both(cwd, copy, shared_cache, METHOD_JSON):
        assert re.search(message, line), line
    assert snapshot(copy) == before


def test_a_run_folder_as_train_writes_it_still_evaluates(trained, copy, shared_cache):
    """References to its own settings (``${seed}``, ``${progress}``) and the environment lookup of
    ``paths`` are what every run folder holds: they read as the values they name."""
    cwd, _ = trained
    text = (copy / CONFIG).read_text()
    assert "seed: ${seed}" in text and "show_progress: ${progress}" in text
    assert "${oc.env:REWARDUQ_DATASETS_DIR,null}" in text
    proc = run("evaluate.py", [f"run={copy}", "device=cpu", "dataset=synthetic_ood", "progress=false"], cwd,
               shared_cache, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "synthetic_ood" in json.loads((copy / "metrics.json").read_text())
    model = r.load_run(copy, progress=False, device="cpu")
    assert model.config.method.seed == model.config.seed == 0
    assert model.config.method.show_progress is model.config.progress is False
    # Hydra's own files of the folder hold no YAML alias either (OmegaConf.to_yaml never writes one)
    from rewarduq_exp.core.foreign_config import read_yaml_data

    assert read_yaml_data(copy / ".hydra" / "hydra.yaml")["hydra"]["runtime"]["choices"]["method"] == "ens_mlp"
    assert isinstance(read_yaml_data(copy / ".hydra" / "overrides.yaml"), list)


def test_the_selection_counts_a_hostile_config_as_corrupt(copy, tmp_path):
    from rewarduq_exp.runs.run_records import find_runs

    target = tmp_path / "elsewhere"
    set_config_value(copy, "method.beta", f"${{unique_run_dir:{target}}}")
    register_resolvers()
    (record,) = find_runs([copy])
    assert record.state == "corrupt" and "method.beta holds" in record.error
    assert not target.exists()


@pytest.mark.parametrize("text, message", [
    ("a: ${b}\nb: ${a}\n", "a refers to itself through other settings"),
    ("a: ${nope.x}\n", "a refers to ${nope.x}, which is not a setting of the file"),
    ("a: {x: 1}\nb: ${a}\n", "b refers to ${a}, a group of settings"),
    ("a: $\nb: '{oc.env:HOME}'\nc: ${a}${b}\n", "c resolves to '${oc.env:HOME}', which holds an interpolation"),
    ("a: ${oc.env:HOME}\n", "a holds '${oc.env:HOME}'"),
    ("a: ${.b}\nb: 1\n", "a holds '${.b}'"),
    ("a0: x\n" + "".join(f"a{i + 1}: ${{a{i}}}${{a{i}}}\n" for i in range(30)), "produces more than"),
    ("a: " + "[" * 40 + "]" * 40 + "\n", "is nested more than 32 levels deep"),
    ("a: [" + ", ".join(["1"] * 6000) + "]\n", "holds more than 5000 values"),
    ("a: 1\na: 2\n", "is corrupt: not valid YAML"),
    ("- 1\n", "is corrupt: not a mapping of settings"),
])
def test_the_reader_refuses_in_one_line(tmp_path, text, message):
    from rewarduq_exp.core.foreign_config import read_foreign_config

    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as error:
        read_foreign_config(path)
    assert str(error.value).startswith(str(path)) and message in str(error.value) and "\n" not in str(error.value)


def test_the_readers_own_folders_win(tmp_path):
    from rewarduq_exp.core.foreign_config import read_foreign_config

    path = tmp_path / "config.yaml"
    path.write_text("seed: 3\nmethod: {seed: '${seed}', tag: 'x${seed}'}\npaths: {output_root: o, cache_dir: "
                    "'${paths.output_root}/cache', datasets_dir: '${oc.env:REWARDUQ_DATASETS_DIR,null}'}\n"
                    "dataset: {mirror_dir: '${paths.datasets_dir}'}\n")
    config = read_foreign_config(path)
    assert config.method.seed == 3 and config.method.tag == "x3" and config.paths.cache_dir == "o/cache"
    assert config.dataset.mirror_dir is None
    assert read_foreign_config(path, paths={"datasets_dir": "/data/hf"}).dataset.mirror_dir == "/data/hf"


def test_a_deep_status_json_is_one_reason_not_a_traceback(copy):
    from rewarduq_exp.runs.run_identity import read_status
    from rewarduq_exp.runs.run_records import find_runs

    (copy / "status.json").write_text('{"state": ' + "[" * 10**6 + "]" * 10**6 + "}")
    assert read_status(copy) == {}
    (record,) = find_runs([copy])
    assert record.state == "missing" and "is refused: nested more than 64 levels deep" in record.error
