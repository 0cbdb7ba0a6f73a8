"""Imports flow one way through the package's layers (README, "Package layout"): a module imports only from lower
layers or from its own subpackage, so e.g. data never imports models and no method imports the runner."""

import ast

import pytest
from conftest import ROOT

PACKAGE = ROOT / "rewarduq_exp"
# Lowest first. A top-level module or subpackage not listed here fails the test: place new code in a layer.
LAYERS = [
    {"errors", "distributed", "hub_access"},   # foundation
    {"runs"},                                    # run folders, identity, atomic writes
    {"ranking"},                                 # rankings as arrays, distributions over permutations, learners
    {"data"},                                    # datasets (label-ranking CSVs are checked as permutations)
    {"metrics"},                                 # computed from predictions, never from models
    {"models"},                                  # backbones, features, feature cache
    {"methods"},                                 # reward models and learners
    {"analysis"},                                # selection, tables, figures over run folders
    {"runner"},                                  # what train.py / evaluate.py execute
    {"api"},                                     # the public Python API
    {"__init__"},                                # the package root re-exports the API
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """'rewarduq_exp.models.backbone' -> 'models'; 'rewarduq_exp.errors' -> 'errors'; 'rewarduq_exp' -> '__init__'."""
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
