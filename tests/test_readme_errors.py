"""The error transcript of docs/errors.md shows what the commands print today: every command there that needs no
file of its own (no ``<placeholder>``, no data file, no read-only folder) is run, and its one line must be the page's
line."""

import re

import pytest
from conftest import ROOT
from test_cli import run

from rewarduq_exp.methods.registry import method_names

ERRORS_PAGE = ROOT / "docs" / "errors.md"


def _transcript() -> list[tuple[str, str]]:
    """(command arguments, error line) of the transcript block under the page's "Bad input" heading."""
    text = ERRORS_PAGE.read_text()
    section = text[text.index("\n## Bad input"):]
    block = section[section.index("```\n") + 4:]
    block = block[:block.index("```")]
    lines = block.splitlines()
    return [(lines[i][len("$ python train.py "):], lines[i + 1]) for i in range(len(lines) - 1)
            if lines[i].startswith("$ python train.py ")]


SELF_CONTAINED = [(args, line) for args, line in _transcript() if not re.search(r"<|\.jsonl|/read-only", args)]


def test_the_errors_section_shows_commands_that_run_here():
    assert len(SELF_CONTAINED) >= 4, SELF_CONTAINED


@pytest.mark.parametrize("args,line", SELF_CONTAINED, ids=[a for a, _ in SELF_CONTAINED])
def test_an_error_of_the_docs_is_what_the_command_prints(tmp_path, shared_cache, args, line):
    proc = run("train.py", [*args.split(), f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, shared_cache, check=False)
    assert proc.returncode == 2
    printed = proc.stderr.strip().splitlines()[-1]
    unknown_method = "error: unknown method 'ens_foo'; allowed: "
    if line.startswith(unknown_method):
        # the list is the method table's: the page shows the shipped methods, a contributor's new method joins the
        # printed list without an edit of the page (tests/test_new_method_in_its_own_files.py)
        assert printed == unknown_method + ", ".join(method_names())
        assert set(line[len(unknown_method):].split(", ")) <= set(method_names())
    else:
        assert printed == line
