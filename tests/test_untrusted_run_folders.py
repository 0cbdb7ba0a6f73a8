"""A run folder is a file someone may hand you: reading one (``load_run``, ``evaluate.py run=``, ``downstream.py``)
never runs code it names, and a damaged one is refused in one line naming the file and the field.

One small real run is trained once; every case damages a copy of it (a method.json naming ``subprocess.Popen`` or
``os.system``, an unknown method or setting, a setting that is not a plain value, a dataset ``_target_`` that would
start a command, ``model.trust_remote_code: true``, deleted or cut-short weights, a corrupt method.json). Each is
refused by the Python API (one-line ``UserError``) and by ``evaluate.py`` (exit status 2, one ``error:`` line), the
command it would run never runs (its marker file never appears), and the refused folder is left byte for byte as it
was.
"""

import json
import shutil
import sys
import uuid
from pathlib import Path

import pytest
from conftest import ROOT
from omegaconf import OmegaConf
from test_cli import NO_FIGURES, run

import rewarduq_exp as r
from rewarduq_exp.core.errors import UserError

CONFIG = Path(".hydra") / "config.yaml"
METHOD_JSON = Path("model") / "method.json"
WEIGHTS = Path("model") / "state.safetensors"
CALIBRATION = Path("calibration.json")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_cache):
    """(working directory, run folder): one small ENS-MLP run on the synthetic world."""
    cwd = tmp_path_factory.mktemp("untrusted")
    folder = cwd / "outputs" / "runs" / "ens_mlp"
    run("train.py", ["method=ens_mlp", "progress=false", "dataset.n_train=200", "dataset.n_eval=50",
                     "dataset.n_ood=50", "method.num_epochs=1", "method.num_heads=4", *NO_FIGURES,
                     f"hydra.run.dir={folder}"], cwd, shared_cache)
    return cwd, folder


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def command(marker: Path) -> list[str]:
    return ["sh", "-c", f"touch {marker}"]


# ---------------------------------------------------------------------------------------------------- the damage
def edit_method_json(folder: Path, change) -> None:
    path = folder / METHOD_JSON
    info = json.loads(path.read_text())
    path.write_text(json.dumps(change(info)))


def edit_config(folder: Path, change) -> None:
    path = folder / CONFIG
    config = OmegaConf.load(path)
    change(config)
    OmegaConf.save(config, path)


def popen_class(folder, marker):
    edit_method_json(folder, lambda info: {"class": "subprocess.Popen", "method": "x",
                                           "hyperparameters": {"args": command(marker)}})


def os_system_class(folder, marker):
    edit_method_json(folder, lambda info: {**info, "class": "os.system",
                                           "hyperparameters": {"command": f"touch {marker}"}})


def unknown_method(folder, marker):
    edit_method_json(folder, lambda info: {k: v for k, v in info.items() if k != "class"} | {"method": "evil"})


def unknown_hyperparameter(folder, marker):
    edit_method_json(folder, lambda info: {**info, "hyperparameters": {**info["hyperparameters"],
                                                                       "args": command(marker)}})


def hyperparameter_not_plain(folder, marker):
    hostile = {"_target_": "subprocess.Popen", "args": command(marker)}
    edit_method_json(folder, lambda info: {**info, "hyperparameters": {**info["hyperparameters"],
                                                                       "num_heads": hostile}})


def corrupt_method_json(folder, marker):
    path = folder / METHOD_JSON
    path.write_bytes(path.read_bytes()[:40])


def method_json_not_an_object(folder, marker):
    (folder / METHOD_JSON).write_text(json.dumps(["subprocess.Popen", command(marker)]))


def dataset_target(folder, marker):
    def change(config):
        config.dataset._target_ = "subprocess.Popen"
        config.dataset.args = command(marker)

    edit_config(folder, change)


def nested_dataset_target(folder, marker):
    def change(config):
        config.dataset.seed = {"_target_": "subprocess.Popen", "args": command(marker)}

    edit_config(folder, change)


def method_target(folder, marker):
    def change(config):
        config.method._target_ = "subprocess.Popen"

    edit_config(folder, change)


def remote_code(folder, marker):
    def change(config):
        config.model.trust_remote_code = True

    edit_config(folder, change)


def tiny_build_target(folder, marker):
    """Fourth hardening round, item 1: was a 21-line TypeError from the tiny model's builder."""
    def change(config):
        config.model.build = {"_target_": "os.system", "command": f"touch {marker}"}

    edit_config(folder, change)


def deleted_weights(folder, marker):
    (folder / WEIGHTS).unlink()


def truncated_weights(folder, marker):
    path = folder / WEIGHTS
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def edit_calibration(folder: Path, change) -> None:
    path = folder / CALIBRATION
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def another_model(calibration: dict) -> dict:
    return {**calibration, "fitted_to": {**calibration["fitted_to"], "model_id": uuid.uuid4().hex}}


def calibration_of_another_run(folder, marker):
    """Fourth hardening round, item 6: another run's calibration.json copied in was applied (it names its model)."""
    edit_calibration(folder, another_model)


def calibration_linked_to_another_run(folder, marker):
    other = marker.parent / "other_run"
    other.mkdir()
    (other / "calibration.json").write_text(json.dumps(another_model(json.loads((folder / CALIBRATION).read_text()))))
    (folder / CALIBRATION).unlink()
    (folder / CALIBRATION).symlink_to(other / "calibration.json")


def calibration_unbound(folder, marker):
    edit_calibration(folder, lambda c: {k: v for k, v in c.items() if k != "fitted_to"})


def calibration_pointwise_in_pairs_run(folder, marker):
    edit_calibration(folder, lambda c: {**c, "kind": "pointwise"})


# case -> (damage, the file the error names, what it says about the field)
CASES = {
    "popen_class": (popen_class, METHOD_JSON, r"field \"class\" names 'subprocess.Popen', not a method of "
                                              r"rewarduq_exp \(allowed: .*ens_mlp"),
    "os_system_class": (os_system_class, METHOD_JSON, r"field \"class\" names 'os.system', not a method"),
    "unknown_method": (unknown_method, METHOD_JSON, r"field \"method\" names 'evil', not a method of rewarduq_exp "
                                                    r"\(allowed: bay_lin, borp, "),
    "unknown_hyperparameter": (unknown_hyperparameter, METHOD_JSON, r"hyperparameters.args is not a setting of "
                                                                    r"ens_mlp; allowed: .*num_heads"),
    "hyperparameter_not_plain": (hyperparameter_not_plain, METHOD_JSON, r"hyperparameters.num_heads is a dict, "
                                                                        r"not a plain value"),
    "corrupt_method_json": (corrupt_method_json, METHOD_JSON, r"is corrupt: not valid JSON"),
    "method_json_not_an_object": (method_json_not_an_object, METHOD_JSON, r"is corrupt: a JSON list, not an object"),
    "dataset_target": (dataset_target, CONFIG, r"dataset._target_ names 'subprocess.Popen', not a dataset loader of "
                                               r"rewarduq_exp \(allowed: .*SyntheticWorld"),
    "nested_dataset_target": (nested_dataset_target, CONFIG, r"dataset.seed._target_ is not allowed"),
    "method_target": (method_target, CONFIG, r"method._target_ names 'subprocess.Popen', not a method"),
    "remote_code": (remote_code, CONFIG, r"model.trust_remote_code is true: .*trust_remote_code=True"),
    "tiny_build_target": (tiny_build_target, CONFIG, r"model.build._target_ is not a setting of the tiny model; "
                                                     r"allowed: hidden_size, num_layers"),
    "deleted_weights": (deleted_weights, WEIGHTS, r"is missing"),
    "truncated_weights": (truncated_weights, WEIGHTS, r"is truncated"),
    "calibration_of_another_run": (calibration_of_another_run, CALIBRATION,
                                   r"refused: it was fitted on another model \(ens_mlp model_id [0-9a-f]{32}; this "
                                   r"run's model [0-9a-f]{32}\)"),
    "calibration_linked_to_another_run": (calibration_linked_to_another_run, CALIBRATION,
                                          r"refused: it was fitted on another model"),
    "calibration_unbound": (calibration_unbound, CALIBRATION, r"refused: it names no model it was fitted on"),
    "calibration_pointwise_in_pairs_run": (calibration_pointwise_in_pairs_run, CALIBRATION,
                                           r"refused: kind 'pointwise' does not fit this run's model \(ens_mlp "
                                           r"scores pairs\)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_or_damaged_run_folder_is_refused_in_one_line(case, trained, shared_cache, tmp_path):
    import re

    cwd, folder = trained
    damage, named_file, field = CASES[case]
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    marker = tmp_path / "pwned.txt"
    damage(copy, marker)
    before = snapshot(copy)

    with pytest.raises(UserError) as error:
        r.load_run(copy, progress=False, device="cpu")
    message = str(error.value)
    assert "\n" not in message and str(copy / named_file) in message, message
    assert re.search(field, message), message

    proc = run("evaluate.py", [f"run={copy}", "device=cpu"], cwd, shared_cache, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(copy / named_file) in lines[0], proc.stderr
    assert re.search(field, lines[0]), lines[0]

    assert not marker.exists()
    assert snapshot(copy) == before  # nothing written into (or deleted from) a refused folder


def test_remote_code_loads_when_the_caller_allows_it(trained, shared_cache, tmp_path):
    """The flag of the run's config is passed on once the caller says so (the tiny model has no remote code, so it
    just loads), through the API and evaluate.py."""
    cwd, folder = trained
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    remote_code(copy, None)
    model = r.load_run(copy, progress=False, device="cpu", trust_remote_code=True)
    assert model.method.encoder.backbone._pretrained_kwargs()["trust_remote_code"] is True
    assert len(model.score(["Name a colour."], ["Blue."])) == 1
    proc = run("evaluate.py", [f"run={copy}", "device=cpu", "dataset=synthetic_ood", "trust_remote_code=true"], cwd,
               shared_cache, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "synthetic_ood" in json.loads((copy / "metrics.json").read_text())
    with pytest.raises(UserError, match="trust_remote_code='yes' is invalid: must be true or false"):
        r.load_run(copy, progress=False, device="cpu", trust_remote_code="yes")


# ---------------------------------------------------------------------------------------------------- registries
def test_the_method_registry_is_every_method_config():
    from rewarduq_exp.methods.registry import METHOD_CLASSES, method_class

    confs = {p.stem: OmegaConf.load(p)._target_ for p in (ROOT / "conf" / "method").glob("*.yaml")}
    assert METHOD_CLASSES == confs
    for name, path in METHOD_CLASSES.items():
        cls = method_class(name)
        assert cls.name == name
        assert f"{cls.__module__}.{cls.__qualname__}" == path   # method.json's "class", checked against this table


def test_the_loader_set_is_every_dataset_config():
    from rewarduq_exp.data.registry import check_untrusted_dataset, loader_targets

    confs = {OmegaConf.load(p)._target_ for p in (ROOT / "conf" / "dataset").rglob("*.yaml")}
    assert loader_targets() == confs and "rewarduq_exp.data.synthetic.SyntheticWorld" in confs
    # one of our loaders, called with a keyword it does not take: named with the file, not left to Hydra
    config = OmegaConf.create({"dataset": OmegaConf.load(ROOT / "conf" / "dataset" / "synthetic.yaml")})
    check_untrusted_dataset(config.dataset, "run/.hydra/config.yaml")
    config.dataset.args = ["sh", "-c", "id"]
    with pytest.raises(UserError, match=r"^run/.hydra/config.yaml: dataset.args is not a setting of SyntheticWorld; "
                                        "allowed: seed, "):
        check_untrusted_dataset(config.dataset, "run/.hydra/config.yaml")


@pytest.fixture
def hostile_module(tmp_path, monkeypatch):
    """(module name, marker): a module on sys.path whose import alone would write the marker file."""
    name = "rewarduq_hostile_module"
    marker = tmp_path / "imported.txt"
    (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass SyntheticWorld:\n    kind = "
                                         "'pointwise'\n    task = 'pointwise'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, marker
    sys.modules.pop(name, None)


def test_task_checks_never_import_a_class_a_config_names(hostile_module):
    from rewarduq_exp.runner.validation import dataset_task, method_task

    name, marker = hostile_module
    assert method_task(OmegaConf.create({"_target_": f"{name}.SyntheticWorld"})) == "preferences"
    assert dataset_task(OmegaConf.create({"_target_": f"{name}.SyntheticWorld"})) == "preferences"
    assert method_task(OmegaConf.create({"_target_": "rewarduq_exp.methods.borp_method.BorpMethod"})) == "pointwise"
    assert dataset_task(OmegaConf.create({"_target_": "rewarduq_exp.data.synthetic.SyntheticRatings"})) == "pointwise"
    assert not marker.exists()


def test_downstream_builds_only_our_world_and_our_methods(hostile_module, tmp_path):
    """downstream.py's world check compares the full class path (``evil.SyntheticWorld`` used to pass), and active
    learning builds its learner from the registry with the run's settings checked."""
    from rewarduq_exp.downstream.world_runs import world_of
    from rewarduq_exp.runner.trained_run import run_method_settings

    name, marker = hostile_module
    config = OmegaConf.create({"dataset": {"_target_": f"{name}.SyntheticWorld", "name": "synthetic"}})
    with pytest.raises(UserError, match=rf"^run/.hydra/config.yaml: dataset._target_ names '{name}.SyntheticWorld', "
                                        "not a dataset loader"):
        world_of(config, "run/.hydra/config.yaml")
    assert not marker.exists()

    where = tmp_path / CONFIG
    good = {"_target_": "rewarduq_exp.methods.bay_lin.BayLin", "beta": 0.5, "seed": "${seed}", "device": "cpu"}
    assert run_method_settings(OmegaConf.create({"seed": 3, "method": good}), where) == (
        "bay_lin", {"beta": 0.5, "seed": 3, "device": "cpu"})
    for method, message in (({**good, "_target_": "subprocess.Popen"}, "method._target_ names 'subprocess.Popen'"),
                            ({**good, "args": ["sh"]}, "method.args is not a setting of bay_lin"),
                            ({**good, "beta": {"_target_": "os.system"}}, "method.beta is a dict, not a plain")):
        with pytest.raises(UserError, match=re_escape(f"{where}: {message}")):
            run_method_settings(OmegaConf.create({"seed": 3, "method": method}), where)


def re_escape(text: str) -> str:
    import re

    return "^" + re.escape(text)


def test_a_run_config_cannot_turn_remote_code_on_by_a_string(tmp_path):
    from rewarduq_exp.models.backbone import Backbone

    backbone = Backbone(OmegaConf.create({"name": "x", "dtype": "float32", "path": str(tmp_path),
                                          "trust_remote_code": "false"}), cache_dir=tmp_path, device="cpu")
    with pytest.raises(UserError, match="model.trust_remote_code='false' is invalid: must be true or false"):
        backbone._pretrained_kwargs()
