"""Every method's settings are one dataclass (rewarduq_exp/methods/settings.py) whose defaults come from its config,
conf/method/<name>.yaml, written once: fields and YAML keys agree, a default-built method has the YAML's values, a
wrong value or an unknown key is one line, runtime settings are never saved, and method.json's hyperparameters are
what they were before the dataclasses (run folders load, identities hold)."""

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import ROOT
from omegaconf import OmegaConf

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.registry import method_class, method_names
from rewarduq_exp.methods.settings import MethodSettings, setting

METHODS = sorted(p.stem for p in (ROOT / "conf" / "method").glob("*.yaml"))
# The settings a run never configures (the YAML leaves them out; a caller sets them, e.g. the scoring batch of a
# loaded head): runtime-only, with their default in code.
NOT_IN_YAML = {"score_batch_size", "log_every", "show_progress"}


def yaml_values(name: str) -> dict:
    values = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "method" / f"{name}.yaml"), resolve=False)
    values.pop("_target_")
    return values


def plain(value):
    return list(value) if isinstance(value, tuple) else value


def test_the_registry_lists_every_config():
    assert method_names() == METHODS


@pytest.mark.parametrize("name", METHODS)
def test_fields_are_the_yaml_keys_and_take_its_defaults(name):
    cls = method_class(name)
    settings = cls.settings_class
    assert issubclass(settings, MethodSettings) and dataclasses.is_dataclass(settings)
    values = yaml_values(name)
    fields = {f.name: f for f in dataclasses.fields(settings)}
    assert set(values) <= set(fields)
    for extra in set(fields) - set(values):       # only runtime settings with a default in code
        assert extra in NOT_IN_YAML and fields[extra].metadata["runtime"], extra
        assert fields[extra].default is not dataclasses.MISSING, extra
    built = cls().settings
    for key, value in values.items():
        if isinstance(value, str) and "${" in value:    # ${seed}, ${device}, ${progress}: the base class's default
            assert fields[key].default is not dataclasses.MISSING, key
            continue
        assert plain(getattr(built, key)) == value, key
    assert built.seed == 0


@pytest.mark.parametrize("name", METHODS)
def test_an_unknown_setting_is_one_line_naming_the_allowed_ones(name):
    cls = method_class(name)
    with pytest.raises(UserError) as err:
        cls(num_head=3)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"method.num_head is not a setting of {name}; allowed: ")
    assert message.endswith(", ".join(cls.settings_class.names()))


@pytest.mark.parametrize("name", METHODS)
def test_runtime_settings_are_never_saved(name):
    cls = method_class(name)
    runtime = set(cls.settings_class.runtime_names())
    assert "seed" not in runtime
    saved = cls().hyperparameters()
    assert not runtime & set(saved)
    assert set(cls.settings_class.saved_names()) <= set(saved)
    assert set(saved) - set(cls.settings_class.names()) <= {"lr_schedule", "head_init_used"}   # the records


BAD_VALUES = [
    ("ens_mlp", {"num_heads": 1}, "method.num_heads=1 is invalid: must be an integer >= 2"),
    ("ens_mlp", {"num_heads": "abc"}, "method.num_heads=abc is invalid: must be an integer"),
    ("ens_mlp", {"learning_rate": 0}, "method.learning_rate=0 is invalid: must be a number > 0"),
    ("ens_mlp", {"adam_betas": [0.9]}, "method.adam_betas=a list of 1 values is invalid: must be two numbers in"),
    ("bay_lin", {"hessian": "full"}, "method.hessian='full' is invalid; allowed: unweighted, weighted"),
    ("bay_lin", {"marglik_refits": 2}, "method.marglik_refits=2 needs method.prior_precision=marglik"),
    ("epinet", {"index_distribution": "x"}, "method.index_distribution='x' is invalid: allowed values are gaussian"),
    ("epinet", {"index_dim": 1, "index_distribution": "one_hot"}, "method.index_dim=1 with method.index_distribution"),
    ("ens_lora", {"num_members": 1}, "method.num_members=1 is invalid: must be an integer >= 2"),
    ("ens_lora", {"mixed_adapter_training": "maybe"}, "method.mixed_adapter_training=maybe is invalid; allowed: auto"),
    ("la_lora", {"lora_dropout": 1.5}, "method.lora_dropout=1.5 is invalid: must be in [0, 1)"),
    ("la_lora", {"prior_precision": "big"}, "method.prior_precision='big' is invalid; allowed: marglik or a number"),
    ("mcd_dpo", {"dropout": 1.0}, "method.dropout=1.0 is invalid: must be in [0, 1)"),
    ("mcd_dpo", {"batch_size": 6, "micro_batch_size": 4}, "method.batch_size=6 must be a multiple of method.micro"),
    ("mcd_dpo", {"max_grad_norm": "x"}, "method.max_grad_norm='x' is invalid: must be a number > 0, or null"),
    ("borp", {"beta": 0}, "method.beta=0 is invalid: must be a number > 0"),
    ("borp", {"judge_scoring": "x"}, "method.judge_scoring='x' is invalid: allowed values are digit"),
    ("borp", {"regressor": "x"}, "regressor='x' is invalid; allowed: "),
    ("mallows", {"max_iter": "many"}, "method.max_iter=many is invalid: must be an integer"),
    ("plackett_luce", {"hidden": [0]}, "method.hidden holds 0, which is invalid: must be an integer >= 1"),
    ("plackett_luce", {"hidden": [100, 10**6]}, "method.hidden holds 1000000, which is too large: at most 65536 units"),
    ("ens_mlp", {"num_heads": 5000}, "method.num_heads=5000 is too large: at most 1024 heads (the paper's K is 20"),
    ("rank_classifier", {"calibration_fraction": 1.0}, "method.calibration_fraction=1.0 is invalid: must be in (0,"),
    ("rpc", {"eps": "tiny"}, "method.eps='tiny' is invalid: must be a number"),
    ("pl_rpc", {"aggregation": "x"}, "method.aggregation='x' is invalid: allowed values are mle"),
]


@pytest.mark.parametrize(("name", "values", "message"), BAD_VALUES,
                         ids=[f"{n}-{'-'.join(v)}" for n, v, _ in BAD_VALUES])
def test_a_wrong_value_is_one_line(name, values, message):
    with pytest.raises(UserError) as err:
        method_class(name)(**values)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


# hyperparameters() of a default-built method as the code before the settings dataclasses wrote it (JSON: what
# method.json holds). num_epochs: a default-built method now has the YAML's 1 where the code's default was 1.0 (a run
# through Hydra always had the YAML's 1); equal as numbers.
BEFORE = {
    "ens_mlp": {"num_heads": 20, "hidden_dim": 128, "num_hidden_layers": 2, "init_gain": 1.0, "reg_lambda": 0.1,
                "center_gamma": 0.01, "beta": 2.0, "learning_rate": 0.001, "batch_size": 64, "num_epochs": 1.0,
                "warmup_ratio": 0.05, "weight_decay": 0.0, "adam_betas": [0.9, 0.999], "adam_eps": 1e-08,
                "max_grad_norm": 1.0, "lr_schedule": "cosine", "seed": 0},
    "mcd_dpo": {"learning_rate": 1e-06, "dpo_beta": 0.1, "dropout": 0.1, "num_samples": 20, "beta": 2.0,
                "batch_size": 64, "micro_batch_size": "auto", "num_epochs": 1.0, "warmup_ratio": 0.05,
                "weight_decay": 0.0, "max_grad_norm": 1.0, "seed": 0},
    "ens_lora": {"num_members": 8, "lora_rank": 16, "lora_alpha": 32.0, "lora_dropout": 0.0,
                 "target_modules": "all-linear", "reg_lambda": 0.01, "anchor": "l2", "center_gamma": 0.01,
                 "beta": 2.0, "learning_rate": 0.0001, "batch_size": 16, "num_epochs": 1.0, "warmup_ratio": 0.05,
                 "weight_decay": 0.0, "adam_betas": [0.9, 0.999], "adam_eps": 1e-08, "max_grad_norm": 1.0,
                 "lr_schedule": "cosine", "micro_batch_size": "auto", "head_init": "auto", "head_init_used": None,
                 "seed": 0},
    "rank_classifier": {"hidden": [100, 100], "learning_rate": 0.001, "num_epochs": 50, "batch_size": 64,
                        "weight_decay": 0.0, "seed": 0, "calibrate": True, "calibration_fraction": 0.2,
                        "unseen_mass": "good_turing"},
}


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_saved_hyperparameters_are_as_before(name):
    saved = json.loads(json.dumps(method_class(name)().hyperparameters()))
    assert saved == BEFORE[name]
    for key, value in saved.items():   # the same kinds too, but for num_epochs (see BEFORE)
        assert key == "num_epochs" or type(value) is type(BEFORE[name][key]), key


def test_a_yaml_of_its_own_gives_the_defaults_and_a_default_twice_is_refused(tmp_path: Path):
    config = tmp_path / "toy.yaml"
    config.write_text("_target_: x.Toy\nwidth: 3\nseed: ${seed}\n")

    @dataclasses.dataclass(kw_only=True)
    class ToySettings(MethodSettings, config=config):
        width: int = setting()
        seed: int = setting(default=0)

    assert (ToySettings().width, ToySettings().seed) == (3, 0)
    assert ToySettings.method_name() == "toy"
    with pytest.raises(TypeError, match="width has a default both in code and in the config"):
        class Twice(MethodSettings, config=config):
            width: int = setting(default=2)
            seed: int = setting(default=0)
    with pytest.raises(TypeError, match="extra has no default: write it in the config"):
        class Missing(MethodSettings, config=config):
            width: int = setting()
            seed: int = setting(default=0)
            extra: int = setting()
    with pytest.raises(TypeError, match="width is in the config but is no field"):
        class Unknown(MethodSettings, config=config):
            seed: int = setting(default=0)


EPOCH_METHODS = [n for n in method_names() if "num_epochs" in method_class(n).settings_class.names()
                 and method_class(n).task != "label_ranking"]


@pytest.mark.parametrize("name", EPOCH_METHODS)
def test_epochs_are_bounded(name):
    """Fourth hardening round, item 9: ``method.num_epochs=10000000`` was accepted (its plan: 9.5e17 FLOPs). A real
    setting (a fraction of an epoch is a shorter schedule) in (0, 10000], for every reward-model method."""
    assert {"ens_mlp", "mcd_dpo", "ens_lora", "bay_lin"} <= set(EPOCH_METHODS)
    settings = method_class(name).settings_class
    assert settings.build({"num_epochs": 0.5}).num_epochs == 0.5
    assert settings.build({"num_epochs": 10_000}).num_epochs == 10_000
    with pytest.raises(UserError, match=r"^method.num_epochs=10000000 is too large: at most 10000 epochs \(each "
                                        r"epoch passes over every training pair; the paper trains 1\)$"):
        settings.build({"num_epochs": 10_000_000})
    with pytest.raises(UserError, match=r"^method.num_epochs=0 is invalid: must be a number > 0$"):
        settings.build({"num_epochs": 0})


def test_too_many_epochs_is_one_line_before_the_plan(tmp_path):
    from entry_points import run_entry_point

    proc = run_entry_point(ROOT / "train.py", ["method.num_epochs=10000000", "plan=true",
                                               f"paths.output_root={tmp_path}"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: method.num_epochs=10000000 is too large: at most 10000 epochs (each epoch passes over every training "
        "pair; the paper trains 1)"], proc.stderr[-2000:]
