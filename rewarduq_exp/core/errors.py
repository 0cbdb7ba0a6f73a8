"""User-facing errors: one clear line, non-zero exit, no traceback."""

from __future__ import annotations


class UserError(ValueError):
    """Bad input from the user (config value, data file, dataset name).

    The entry points print ``error: <message>`` on one line and exit with status 2. The message names what is
    wrong and what is allowed, so the user can fix the command without reading code. It is a ``ValueError``, so
    code that already catches bad values (a notebook, a training loop calling a reward function) catches it too.
    """

    exit_code = 2


def one_line(message: str) -> str:
    """Collapse a message to a single line (error output must stay one line)."""
    return " ".join(str(message).split())


def first_line(text, limit: int | None = 200) -> str:
    """The first non-blank line of ``text`` (an exception's message, say), stripped and cut at ``limit`` characters:
    what a one-line error quotes of a library's longer report."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0][:limit] if lines else ""
