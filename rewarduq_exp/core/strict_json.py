"""Result files as strict JSON: an undefined number (NaN, +inf, -inf) is written as ``null``, never as ``NaN``.

Python's ``json`` writes a NaN float as the bare token ``NaN`` (and inf as ``Infinity``), which is not JSON: strict
parsers (JavaScript's ``JSON.parse``, ``jq``, ``json.loads(text, parse_constant=...)`` that refuses constants) reject
the whole file. A metric can be undefined for honest reasons (the correlation of a constant prediction, an ECE over
an empty bin), so every results file of this package is written through :func:`write_json` / :func:`dumps_json`:

* :func:`to_json_ready` returns a copy where every non-finite float (Python floats, numpy floats of any width, inside
  nested dicts, lists and tuples; numpy scalars and arrays become plain Python values) is ``None``, and the paths of
  the values it replaced (``"synthetic_eval/probe/pearson"``, ``"history[3]/loss"``);
* the text is produced with ``allow_nan=False``, so a non-finite value that slipped past the conversion raises
  instead of writing an invalid file;
* the replaced keys are logged in one line (the run's ``train.log`` gets it), so a ``null`` in a file says what it
  replaced.

Readers of our own metrics files turn a ``null`` metric back into NaN (:func:`nulls_to_nan`), which is what they
saw before: a missing value for selection, tables and comparisons, never a ``None`` to format or compare.

Kept free of numpy, torch and pandas imports (numpy values are recognised when numpy is already loaded), so light
readers import it cheaply.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from rewarduq_exp.core.atomic_write import write_atomic

log = logging.getLogger(__name__)

# How many replaced keys the log line names before "and N more".
_LOGGED_KEYS = 12
_logged: set[tuple[str, tuple[str, ...]]] = set()  # (file, replaced keys) already logged by this process


def _plain(obj: Any) -> Any:
    """A numpy scalar or array as the Python value it holds (``.item()`` / ``.tolist()``); anything else as is."""
    np = sys.modules.get("numpy")
    if np is None:
        return obj
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _join(where: str, key: Any) -> str:
    return f"{where}/{key}" if where else str(key)


def to_json_ready(obj: Any) -> tuple[Any, list[str]]:
    """``(copy, replaced)``: ``obj`` with every NaN / +inf / -inf float replaced by ``None`` (nested dicts, lists and
    tuples; numpy scalars and arrays as Python values) and the paths of the replaced values, in order. A path joins
    dict keys with ``/`` and gives list positions as ``[i]``. Other values (str, int, bool, None, objects that the
    writer turns into strings) are left as they are."""
    replaced: list[str] = []

    def walk(value: Any, where: str) -> Any:
        value = _plain(value)
        if isinstance(value, float) and not isinstance(value, bool):
            if math.isfinite(value):
                return value
            replaced.append(where or "(the value)")
            return None
        if isinstance(value, dict):
            return {_plain(k): walk(v, _join(where, _plain(k))) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value

    return walk(obj, ""), replaced


def _dumps(obj: Any, indent: int | None, what: str, sort_keys: bool) -> tuple[str, list[str]]:
    ready, replaced = to_json_ready(obj)
    if replaced and (what, tuple(replaced)) not in _logged:  # once per file and keys: status.json is rewritten
        _logged.add((what, tuple(replaced)))                  # at every heartbeat
        shown = ", ".join(replaced[:_LOGGED_KEYS]) + (f" and {len(replaced) - _LOGGED_KEYS} more"
                                                       if len(replaced) > _LOGGED_KEYS else "")
        log.info("%s: wrote null for %d undefined value(s) (NaN/inf, e.g. a correlation of a constant; strict JSON "
                 "has no NaN/Infinity, readers take null as missing): %s", what or "JSON", len(replaced), shown)
    return json.dumps(ready, indent=indent, default=str, allow_nan=False, sort_keys=sort_keys), replaced


def dumps_json(obj: Any, *, indent: int | None = 1, what: str = "", sort_keys: bool = False) -> str:
    """Strict JSON text of ``obj`` (see the module docstring): non-finite numbers as ``null`` (logged in one line
    naming ``what``, e.g. the file, and the keys), other unknown objects as ``str(obj)``, and ``allow_nan=False`` as
    the last guard."""
    return _dumps(obj, indent, what, sort_keys)[0]


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 1, sort_keys: bool = False) -> list[str]:
    """Write ``obj`` to ``path`` as strict JSON (:func:`dumps_json`), atomically (temporary name, then rename).
    Returns the paths of the values written as ``null`` because they were NaN/inf."""
    path = Path(path)
    text, replaced = _dumps(obj, indent, str(path), sort_keys)
    write_atomic(path, text + "\n")
    return replaced


def nulls_to_nan(obj: Any) -> Any:
    """A metrics object read back: every ``null`` number (a value :func:`write_json` wrote for NaN/inf) as
    ``float("nan")``, in nested dicts and lists, so readers see a missing value as before, never ``None``."""
    if obj is None:
        return math.nan
    if isinstance(obj, dict):
        return {k: nulls_to_nan(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [nulls_to_nan(v) for v in obj]
    return obj


def strict_loads(text: str) -> Any:
    """Parse ``text`` as strict JSON: ``NaN``, ``Infinity`` and ``-Infinity`` raise ``ValueError`` (Python's parser
    accepts them by default; other languages' parsers do not)."""
    def refuse(constant: str):
        raise ValueError(f"not strict JSON: bare {constant}")

    return json.loads(text, parse_constant=refuse)
