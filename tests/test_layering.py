"""Imports flow one way through the package's layers (docs/layout.md): a module imports only from lower
layers or from its own subpackage, so e.g. data never imports models and no method imports the runner."""

import ast

import pytest
from conftest import ROOT

PACKAGE = ROOT / "rewarduq_exp"
# Lowest first. A top-level module or subpackage not listed here fails the test: place new code in a layer.
LAYERS = [
    {"core"},                                    # errors, checks, hashing, atomic writes, process rank, hub access
    {"ranking"},                                 # rankings as arrays, distributions over permutations
    {"data"},                                    # datasets (label-ranking CSVs are checked as permutations)
    {"metrics"},                                 # computed from predictions, never from models
    {"models"},                                  # backbones, features, feature cache
    {"methods"},                                 # reward models, probes and label-ranking learners
    {"recalibration"},                           # post-hoc recalibration of a trained method's scores
    {"runs"},                                    # run folders, identity, records: only what reads/writes runs
    {"analysis"},                                # selection, tables, figures over run folders
    {"runner"},                                  # what train.py / evaluate.py execute
    {"api"},                                     # the public Python API
    {"serving"},                                 # the API's reward model over HTTP (serve.py)
    {"downstream"},                              # downstream uses of uncertainty (best-of-n, active learning)
    {"__init__"},                                # the package root re-exports the API
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """'rewarduq_exp.models.backbone' -> 'models'; 'rewarduq_exp.core.errors' -> 'core'; 'rewarduq_exp' -> '__init__'.
    """
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("rewarduq_exp"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rewarduq_exp"):
            if node.module == "rewarduq_exp":  # from rewarduq_exp import x: x is a module of the package root
                yield from (f"rewarduq_exp.{a.name}" for a in node.names)
            else:
                yield node.module


def source_files():
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    units = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in source_files()}
    assert units <= set(LAYER_OF), f"put these in a layer: {sorted(units - set(LAYER_OF))}"


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_flow_down(path):
    rel = path.relative_to(PACKAGE)
    own = rel.parts[0].removesuffix(".py")
    for module in imported_modules(path):
        target = unit_of(module)
        if target == own:
            continue
        assert LAYER_OF[target] < LAYER_OF[own], (
            f"{rel} (layer {LAYER_OF[own]}: {own}) imports {module} (layer {LAYER_OF[target]}: {target})")


def test_the_checker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from rewarduq_exp.models.backbone import Backbone\nfrom rewarduq_exp import api\n")
    assert [unit_of(m) for m in imported_modules(bad)] == ["models", "api"]


@pytest.mark.parametrize("path", [p for p in source_files() if p.name != "__init__.py" and p.parent != PACKAGE],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_submodules_do_not_import_their_package_init(path):
    """A package's ``__init__`` re-exports its submodules; a submodule importing it back would import its siblings
    in an order that depends on who came first (and cycles)."""
    package = "rewarduq_exp." + ".".join(path.relative_to(PACKAGE).parts[:-1])
    assert package not in set(imported_modules(path)), f"{path.relative_to(PACKAGE)} imports {package} (__init__)"


OUTSIDE = ("DESIGN", "papers/", "notes/", "../shared", "/work/")  # design notes, paper files, this machine's folders


def test_code_refers_to_nothing_outside_the_repository():
    """Code, configs and tests stand on their own: no pointers to design notes or paper files that are not shipped."""
    offenders = []
    for folder in ("rewarduq_exp", "scripts", "conf", "tests", "hydra_plugins"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".yaml") and path.name != "test_layering.py":
                text = path.read_text()
                offenders += [f"{path.relative_to(ROOT)}: {word}" for word in OUTSIDE if word in text]
    assert not offenders, offenders


def test_no_script_shadows_the_standard_library():
    import sys

    shadowing = [p.name for p in (ROOT / "scripts").glob("*.py") if p.stem in sys.stdlib_module_names]
    assert not shadowing, f"rename {shadowing}: Python puts scripts/ first on sys.path, before the standard library"

