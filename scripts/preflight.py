"""Does this Python have what the project needs? One line per missing package, before any heavy work.

    python scripts/preflight.py                # the project's dependencies and the dev extra (what make gpu-check runs)
    python scripts/preflight.py --extras ""    # the dependencies only (train.py, evaluate.py)

Meant for a machine that cannot install anything (a cluster's offline GPU node whose image has torch with CUDA and a
scientific stack, and whose other packages came as wheels from ``make wheels``): it runs with the standard library
alone and says what to bring, instead of a traceback from deep inside the first import that fails. Two checks:

1. The distributions: the requirements of ``pyproject.toml`` (the dependencies, plus each extra asked for), followed
   through the installed packages' own requirements (markers evaluated here), each found by its metadata and its
   version checked against what asks for it (with ``packaging`` present, as it is wherever transformers is).
2. The imports: the top-level module of every direct requirement, then the project's own entry points (the training
   and evaluation runners, the launchers), in this process. A module missing there although its package's metadata
   is present (a broken install, a package without metadata) is named by the module and the package that provides it.

Each problem is one line, the package first; exit status 2 when there is one, 0 otherwise. Nothing is installed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Packages of an extra that the check of a node never uses: ruff lints (a developer's machine does that).
SKIP = {"ruff"}
# Distribution -> the module a program imports, where the two names differ beyond case and - / _.
IMPORT_NAMES = {"hydra-core": "hydra", "scikit-learn": "sklearn", "pytest-xdist": "xdist", "pyyaml": "yaml",
                "hydra-submitit-launcher": "hydra_plugins.hydra_submitit_launcher", "pillow": "PIL",
                "python-dateutil": "dateutil", "antlr4-python3-runtime": "antlr4", "protobuf": "google.protobuf"}
PROVIDED_BY = {module: dist for dist, module in IMPORT_NAMES.items()}
# The project's own modules that a run imports: each pulls in the libraries it uses, as train.py would.
PROJECT_MODULES = ("rewarduq_exp.runner.train_run", "rewarduq_exp.runner.evaluate_run",
                   "hydra_plugins.rewarduq_launchers")


def canonical(name: str) -> str:
    """A distribution's name as package indexes compare them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """The distribution a requirement string names (``datasets>=3.0; extra == "x"`` -> ``datasets``), without
    needing ``packaging``."""
    return re.split(r"[\s<>=!~;\[(]", requirement, 1)[0]


def project_requirements(extras: list[str]) -> list[str]:
    """The requirement strings of pyproject.toml: its dependencies and the listed extras (skipping ``SKIP``)."""
    try:
        import tomllib
    except ModuleNotFoundError:   # Python 3.10: pip carries a copy of the same parser
        from pip._vendor import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"preflight: unknown extra {', '.join(unknown)}; allowed: {', '.join(optional)}")
    wanted = [*project["dependencies"], *(r for e in extras for r in optional[e])]
    return [r for r in dict.fromkeys(wanted) if canonical(requirement_name(r)) not in SKIP]


class Problems:
    """What is missing or wrong, one entry per package (the first reason found is the one reported)."""

    def __init__(self):
        self.lines: dict[str, str] = {}

    def add(self, package: str, line: str) -> None:
        self.lines.setdefault(canonical(package), line)


def check_distributions(requirements: list[str], problems: Problems) -> None:
    """Follow ``requirements`` through the installed metadata; a missing or out-of-range distribution is a problem."""
    try:
        from packaging.requirements import Requirement
    except ModuleNotFoundError:   # without packaging only the names can be checked (no versions, no markers)
        problems.add("packaging", "packaging: not installed (needed by transformers, and to check versions here)")
        for text in requirements:
            name = requirement_name(text)
            try:
                metadata.distribution(name)
            except metadata.PackageNotFoundError:
                problems.add(name, f"{name}: not installed (required by rewarduq_exp: {text})")
        return
    seen: set[tuple[str, str]] = set()
    todo = [(Requirement(text), "rewarduq_exp", "") for text in requirements]
    while todo:
        req, parent, extra = todo.pop(0)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        key = canonical(req.name)
        for wanted_extra in sorted(req.extras) or [""]:
            if (key, wanted_extra) in seen:
                continue
            seen.add((key, wanted_extra))
            try:
                dist = metadata.distribution(req.name)
            except metadata.PackageNotFoundError:
                problems.add(req.name, f"{req.name}: not installed (required by {parent}: {req})")
                break
            version = dist.version
            if req.specifier and not req.specifier.contains(version, prereleases=True):
                problems.add(req.name, f"{req.name}: {version} installed, {parent} needs {req.name}{req.specifier}")
            for text in dist.requires or []:
                todo.append((Requirement(text), f"{dist.metadata['Name']} {version}", wanted_extra))


def import_name(requirement: str) -> str:
    name = canonical(requirement_name(requirement))
    return IMPORT_NAMES.get(name, name.replace("-", "_"))


def provider(module: str) -> str:
    """The distribution that provides ``module`` (a dotted name: its longest known prefix, else its top level)."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in PROVIDED_BY:
            return PROVIDED_BY[".".join(parts[:end])]
    return parts[0].replace("_", "-")


def check_imports(modules: list[str], problems: Problems) -> None:
    """Import each module here; a module that is missing is named with the package that provides it."""
    sys.path.insert(0, str(ROOT))
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            missing = err.name or module
            package = provider(missing)
            via = "" if package == provider(module) else f", imported by {module}"
            problems.add(package, f"{package}: module '{err.name}' cannot be imported{via}")
        except Exception as err:   # a package that is there but fails to import (a broken or mismatched build)
            problems.add(module, f"{module}: import failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extras", default="dev", help="comma-separated extras of pyproject.toml to check too "
                                                        "(default: dev, the test tools)")
    parser.add_argument("--no-imports", action="store_true", help="check the metadata only (fast, imports nothing)")
    args = parser.parse_args(argv)
    requirements = project_requirements([e for e in args.extras.split(",") if e.strip()])
    problems = Problems()
    check_distributions(requirements, problems)
    if not args.no_imports:
        check_imports([import_name(r) for r in requirements] + list(PROJECT_MODULES), problems)
    for line in problems.lines.values():
        print(f"missing: {line}")
    if problems.lines:
        print(f"preflight: {len(problems.lines)} package(s) missing for {sys.executable}; on an offline node bring "
              f"them as wheels (make wheels, docs/gpu-and-slurm.md: offline GPU node), elsewhere pip install them",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
