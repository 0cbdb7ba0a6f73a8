"""Where in a text data file (JSON lines, a JSON document, CSV; optionally compressed) a problem is, as the line
number an editor shows (1-based, every line counted, blank ones and a CSV's header included).

The readers cannot say it: pyarrow's JSON reader counts rows from 0 within each block it parses (blank lines not
counted, a block being some megabytes of the file), a JSON document's error is a character offset, and Arrow's
UTF-8 check knows rows, not lines. So the line is found here, by reading the file again; only after a reader
failed, so a good file is never read twice.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import itertools
import json
import lzma
from pathlib import Path


def open_text(path: str | Path, compression: str | None, errors: str = "strict", newline: str | None = None):
    """``path`` opened as UTF-8 text through its compression (None when it is one Python cannot decompress)."""
    opener = {None: open, ".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(compression)
    if opener is None:
        return None
    return opener(path, "rt", encoding="utf-8", errors=errors, newline=newline)


def _split(path) -> tuple[str, str | None]:
    from rewarduq_exp.data.hub import _split_suffixes

    return _split_suffixes(str(path))


def line_of_row(path: str | Path, row: int) -> int | None:
    """The line on which data row ``row`` (0-based, as the reader counts: blank lines and a CSV's header are not
    rows) starts, or None where rows are not lines (a JSON document, Parquet, Arrow) or the file cannot tell."""
    suffix, compression = _split(path)
    if suffix not in (".jsonl", ".json", ".csv"):
        return None
    try:
        if suffix != ".csv" and _starts_with_array(path, compression):
            return None     # one JSON document (an array): rows are not lines
        f = open_text(path, compression, errors="replace", newline="")
        if f is None:
            return None
        with f:
            if suffix == ".csv":
                reader = csv.reader(f)
                next(reader, None)  # the header
                start = reader.line_num + 1
                rows = -1
                for record in reader:
                    if record:      # the reader (pandas) skips blank lines
                        rows += 1
                        if rows == row:
                            return start
                    start = reader.line_num + 1
                return None
            rows = -1
            for number, line in enumerate(f, 1):
                if line.strip():    # pyarrow's JSON reader skips blank lines
                    rows += 1
                    if rows == row:
                        return number
    except (OSError, EOFError, ValueError, csv.Error, lzma.LZMAError):
        return None
    return None


def _starts_with_array(path, compression) -> bool:
    f = open_text(path, compression, errors="replace")
    if f is None:
        return False
    with f:
        return f.read(1 << 16).lstrip().startswith("[")   # bounded: an array may be one line


def json_error(path: str | Path) -> tuple[int, str] | None:
    """(line, what is wrong) of the first place where a JSON data file is not JSON: the first line of a JSON-lines
    file that does not parse, or where a JSON document stops parsing; None if it parses (or cannot be read here)."""
    _, compression = _split(path)
    try:
        f = open_text(path, compression, errors="replace")
        if f is None:
            return None
        with f:
            first = f.readline()
            if first.lstrip().startswith(("[", "{")) and _is_document(first):
                text = first + f.read()
                try:
                    json.loads(text)
                except json.JSONDecodeError as err:
                    return err.lineno, err.msg
                return None
            for number, line in enumerate(itertools.chain([first], f), 1):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except json.JSONDecodeError as err:
                    return number, err.msg
    except (OSError, EOFError, lzma.LZMAError):
        return None
    return None


def _is_document(first_line: str) -> bool:
    """Whether a file whose first line is ``first_line`` is one JSON document rather than JSON lines: an array,
    or an object that does not close on its line (a pretty-printed one)."""
    text = first_line.strip()
    if text.startswith("["):
        return True
    try:
        json.loads(text)
        return False
    except json.JSONDecodeError as err:
        return err.msg.startswith(("Expecting property name", "Expecting value", "Unterminated")) and \
            err.pos >= len(text)


def invalid_utf8_line(path: str | Path) -> int | None:
    """The first line of a text data file that is not valid UTF-8 (None if every line is, or it cannot be read)."""
    _, compression = _split(path)
    f = open_text(path, compression, errors="surrogateescape")
    if f is None:
        return None
    try:
        with f:
            for number, line in enumerate(f, 1):
                try:
                    line.encode("utf-8")   # undecodable bytes came through as lone surrogates, which do not encode
                except UnicodeEncodeError:
                    return number
    except (OSError, EOFError, lzma.LZMAError):
        return None
    return None
