"""Every config combination composes, and every override the documentation shows names a real setting.

A key that a document mentions but no config declares (``model.keep_dtype_on_cpu`` was one) makes Hydra reject the
user's command; these tests compose what a user can type, without running anything.
"""

import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from rewarduq_exp.data.registry import available
from rewarduq_exp.runner.cli import bad_setting_value, register_resolvers, unknown_setting

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
# The README, every page of docs/ and the Slurm guide: everything a user copies commands from.
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "slurm" / "README.md"]


def name(doc: Path) -> str:
    """A document as the tests name it: its path in the repository (README.md, docs/data.md, slurm/README.md)."""
    return doc.relative_to(ROOT).as_posix()


def options(group: str) -> list[str]:
    return available(group, CONF)  # nested options by their path (dataset=label_ranking/iris)


def _check(cfg, model, method, dataset):
    from hydra.utils import get_class

    from rewarduq_exp.methods.label_ranking import LEARNERS

    assert cfg.model.name == model and cfg.dataset.name == dataset.rsplit("/", 1)[-1]
    cls = get_class(cfg.method._target_)
    assert LEARNERS[method] is cls if cls.task == "label_ranking" else cls.name == method
    assert "keep_dtype_on_cpu" in cfg.model  # documented in docs/real-model.md (the bf16 path on a CPU)


def test_every_model_method_pair_and_every_dataset_compose():
    """The groups interact only through conf/tuned/<method>/<model>.yaml: every model and every method once, every
    (model, method) pair with a tuned file, and every dataset and other group option once (the full model x method x
    dataset product is the slow test below)."""
    register_resolvers()
    tuned = {(p.stem, p.parent.name) for p in (CONF / "tuned").glob("*/*.yaml")}
    pairs = ({(model, "ens_mlp") for model in options("model")} | {("tiny-qwen3", m) for m in options("method")}
             | tuned)
    assert {model for model, _ in tuned} <= set(options("model")), "a tuned file for a model that is no option"
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for model, method in sorted(pairs):
            _check(compose("train", overrides=[f"model={model}", f"method={method}"]), model, method, "synthetic")
        for dataset in options("dataset"):
            _check(compose("train", overrides=[f"dataset={dataset}"]), "tiny-qwen3", "ens_mlp", dataset)
        for group in ("probe", "metric", "logger", "sweep"):
            for option in options(group):
                compose("train", overrides=[f"{group}={option}"])


@pytest.mark.slow
def test_every_model_method_dataset_combination_composes():
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for model in options("model"):
            for method in options("method"):
                for dataset in options("dataset"):
                    cfg = compose("train", overrides=[f"model={model}", f"method={method}", f"dataset={dataset}"])
                    _check(cfg, model, method, dataset)


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(document line, script, arguments) of every ``python train.py|evaluate.py ...`` the documents show."""
    out = []
    for doc in DOCS:
        text = doc.read_text().replace("\\\n", " ")  # shell line continuations
        for line in text.splitlines():
            if line.lstrip().startswith("$ "):
                continue  # a shell transcript of bad input, shown on purpose (docs/errors.md)
            for match in re.finditer(r"python (train|evaluate)\.py([^`#\n]*)", line):
                try:
                    args = shlex.split(match.group(2))
                except ValueError:
                    continue
                out.append((f"{name(doc)}: {match.group(0).strip()}", match.group(1), args))
    return out


def _usable(args: list[str]) -> list[str]:
    keep, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("--config-dir", "-cd", "-p", "--package", "--cfg", "-c"):
            skip = True  # its value follows
            continue
        if a.startswith("-") or "=" not in a or "<" in a or "..." in a or a.startswith("hydra/launcher=example"):
            continue  # flags, placeholders (<run>), and example cluster profiles that live in slurm/
        keep.append(a)
    return keep


COMMANDS = documented_commands()


def test_the_documents_show_commands():
    assert len(COMMANDS) > 20


@pytest.mark.parametrize("where, script, args", COMMANDS, ids=[c[0][:90] for c in COMMANDS])
def test_documented_overrides_name_real_settings(where, script, args):
    args = _usable(args)
    if script == "evaluate":
        # evaluate.py takes dataset=<name>[_<split>] as what to score (see evaluate.py), not a config group
        args = [a for a in args if not a.startswith("dataset=")]
    problem = unknown_setting(args, "train" if script == "train" else "evaluate")
    assert problem is None, f"{where}: {problem}"
    # and every value is of its setting's kind (the check that refuses progress=maybe does not refuse the docs)
    problem = bad_setting_value(args, "train" if script == "train" else "evaluate")
    assert problem is None, f"{where}: {problem}"


def documented_keys() -> list[tuple[str, str]]:
    """(document, key) of every ``group.key=value`` override written in an inline code span of the documents."""
    out = set()
    for doc in DOCS:
        for span in re.findall(r"`([^`\n]+)`", doc.read_text()):
            for token in span.split():
                match = re.fullmatch(r"\[?([a-z_]+(?:\.[a-z_0-9]+)+)=\S*", token)
                if match and not match.group(1).startswith("hydra."):
                    out.add((name(doc), match.group(1)))
    return sorted(out)


KEYS = documented_keys()


@pytest.mark.parametrize("where, key", KEYS, ids=[f"{d}:{k}" for d, k in KEYS])
def test_documented_keys_exist_in_some_option_of_their_group(where, key):
    """``method.center_features=false`` in prose means "with a method that has it": one option of the group must."""
    group = key.split(".", 1)[0]
    choices = [[f"{group}={o}"] for o in options(group)] if (CONF / group).is_dir() else [[]]
    config = "serve" if group == "serve" else "train"   # serve.py's own settings live in conf/serve.yaml
    problems = [unknown_setting([*c, f"{key}=1"], config) for c in choices]
    assert any(p is None for p in problems), f"{where}: {problems[0]}"


def test_keys_mentioned_in_prose_are_found():
    assert ("docs/real-model.md", "model.keep_dtype_on_cpu") in KEYS
    assert ("docs/methods.md", "method.center_features") in KEYS
    assert {where for where, _ in KEYS} >= {"README.md", "docs/data.md", "docs/borp.md", "slurm/README.md"}
