"""Completed runs that can be trusted, and where they are.

A run folder copied from another cluster or cut short by a full disk can say ``completed`` in ``status.json`` while
its weights are truncated or its ``metrics.json`` is corrupt. :func:`damage` checks what a completed run's readers
need (``metrics.json`` parses to an object, every ``model/**/method.json`` parses, every safetensors file is complete
by its header, every ``.npz`` / ``.skops`` archive is a sound zip) without loading any tensor, so selection and the
sweep launchers can check every run they count.

:func:`completed_by_hash` finds the intact completed runs below an output root by config hash: a sweep skips a point
that already completed anywhere there (another sweep folder, a single run), not only in its own folder.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.saved_files import read_json_object, safetensors_problem
from rewarduq_exp.runs.run_identity import METRICS_FILE, STATUS_FILE, is_completed, read_status


def damage(folder: str | os.PathLike) -> str | None:
    """Why the completed run in ``folder`` cannot be used (its first damaged file), or None when it is intact."""
    folder = Path(folder)
    problem = _json_problem(folder / METRICS_FILE)
    if problem:
        return problem
    model = folder / "model"
    infos = sorted(model.rglob("method.json")) if model.is_dir() else []
    if not infos:
        return f"{model}/method.json is missing (no saved model)"
    for info in infos:
        problem = _json_problem(info)
        if problem:
            return problem
    for path in sorted(model.rglob("*")):
        if path.suffix == ".safetensors":
            problem = safetensors_problem(path)
        elif path.suffix in (".npz", ".skops"):
            problem = _zip_problem(path)
        else:
            continue
        if problem:
            return problem
    return None


def _json_problem(path: Path) -> str | None:
    try:
        read_json_object(path)
    except UserError as err:
        return str(err)
    return None


def _zip_problem(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile) as err:
        return f"{path} is truncated or corrupt ({err})"
    return f"{path} is corrupt (member {bad} fails its checksum)" if bad else None


def completed_by_hash(root: str | os.PathLike, skip: tuple = ()) -> dict[str, Path]:
    """``{config hash: run folder}`` for every intact completed run below ``root`` (the first by path when several
    share a hash). ``skip``: folders not to walk into (the feature cache, which holds no runs and many files)."""
    root = Path(root)
    skipped = {Path(s).resolve() for s in skip}
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if STATUS_FILE in filenames:
            dirnames.clear()  # a run folder holds results, not other runs
            status = read_status(here)
            chash = status.get("config_hash")
            if chash and chash not in found and is_completed(here, status=status) and damage(here) is None:
                found[chash] = here
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and (here / d).resolve() not in skipped)
    return found
