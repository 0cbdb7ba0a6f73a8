"""Every JSON file a run writes parses with a strict parser: no bare NaN / Infinity (which Python's ``json`` reads,
but JavaScript, jq and ``json.loads(..., parse_constant=<refuse>)`` reject)."""

from __future__ import annotations

from pathlib import Path

from rewarduq_exp.core.strict_json import strict_loads


def assert_strict_json_files(*folders: Path) -> list[Path]:
    """Parse every ``*.json`` below ``folders`` strictly; the files checked (at least one per folder)."""
    checked = []
    for folder in folders:
        files = sorted(p for p in Path(folder).rglob("*.json") if not p.name.startswith("."))
        assert files, f"no JSON files in {folder}"
        for path in files:
            try:
                strict_loads(path.read_text())
            except ValueError as err:
                raise AssertionError(f"{path} is not strict JSON: {err}") from None
        checked += files
    return checked
