"""Users' own preference files (``dataset=local``): JSONL, JSON, Parquet, CSV or Arrow, one pair per row, optionally
compressed (``.jsonl.gz``, ...; which file types are readable is decided in one place, :func:`hub.file_builder`).

Read through ``datasets.load_dataset`` (the same machinery as the hub loaders), then mapped onto the contract:
``columns`` says which file column holds each contract column. ``prompt``/``chosen``/``rejected`` may be plain
strings or lists of ``{role, content}`` messages; the prompt column may be missing when chosen/rejected are whole
conversations that share the prompt turns (see ``conversation.py``: no turn is ever duplicated).

Transcripts: when the file has no prompt column and chosen/rejected hold strings, they are read as HH-RLHF
transcripts ("\\n\\nHuman: ...\\n\\nAssistant: ...", the Anthropic/hh-rlhf schema); the turns both sides share
become the prompt, and rows that are not transcripts are dropped and counted like any unsplittable pair. If no row
is a transcript the file is refused with a one-line error (plain-string replies need a prompt column).

Checked in Arrow, before any text becomes a Python object: that every text is valid UTF-8 (one line naming the file,
column and row instead of pandas' ``ArrowException``), and, when the run gives ``max_chars``, which rows are too
long for ``max_length`` tokens: those are dropped there, so a huge row's text is never copied into Python strings,
and they are reported by the length filter like any row it drops (``frame.attrs["dropped_too_long"]``).

Refused in one line naming the file: a path that is not a regular file (a named pipe would block the reader, a folder
or a device is no data file), and a JSON row nested deeper than :data:`MAX_ROW_DEPTH` levels, with the line where it
happens (pyarrow's reader refuses a deeper row, and a JSON line nested thousands deep crashes it with a
segmentation fault; Python's JSON parser, which ``datasets`` falls back to, stops at the interpreter's recursion
limit). JSON lines are scanned for that before the reader, at little cost (a row with at most that many opening
brackets is not looked at further); a file that is one JSON array, which the reader fails on without crashing, only
after it failed, so a good file is read once.

Splits: ``train`` is ``path``; ``eval`` is ``eval_path``, or, without it, the rows of ``eval_fraction`` of the file's
prompts (held out by prompt). ``cal``, the calibration split (:mod:`rewarduq_exp.data.calibration_split`), is the rows
of ``cal_fraction`` of the training prompts (those not in ``eval``), held out by prompt the same way with an order of
its own; they leave ``train``. Both hold-outs depend only on the prompts' texts, never on the row order or the seed.
``cal_fraction`` is 0 unless given (the class reads a file as it is, as with ``eval_fraction``); the config
``conf/dataset/local.yaml`` sets 0.1.
"""

from __future__ import annotations

import itertools
import logging
import lzma
import os
import re
import stat
from pathlib import Path

import numpy as np
import pyarrow as pa

from rewarduq_exp.core.checks import check_positive
from rewarduq_exp.core.errors import UserError, first_line
from rewarduq_exp.data.calibration_split import CAL_SPLIT, calibration_rows, check_fraction, group_key, hold_out
from rewarduq_exp.data.contract import content_chars, validate_preferences
from rewarduq_exp.data.conversation import PairColumns, normalise_pairs, parse_transcript
from rewarduq_exp.data.hub import check_utf8, file_builder, no_rows, reader_error, reader_errors_unlogged

log = logging.getLogger(__name__)

TEXT = ("prompt", "chosen", "rejected")
REQUIRED = ("chosen", "rejected")          # prompt may be implicit in chosen/rejected conversations
OPTIONAL = ("prompt", "id", "weight", "subset")
# The deepest JSON row the reader takes, the row object being level 1 (a row of messages is 3 deep): pyarrow refuses
# a 64th level ("Recursion level in ArrowSchema struct exceeded"), and crashes (SIGSEGV) on rows 10^5 levels deep.
MAX_ROW_DEPTH = 63


def _check_regular(path: Path, key: str) -> None:
    """A one-line :class:`UserError` when ``path`` exists and is no regular file. A stat only: a named pipe must
    never be opened (that blocks until a writer comes)."""
    try:
        if path.is_file() or not path.exists():
            return
    except OSError:  # a name too long and the like: the reader reports it
        return
    raise UserError(f"{key}={path}: not a regular file ({_file_kind(path)}); give a data file")


def _file_kind(path: Path) -> str:
    mode = os.stat(path).st_mode
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file"


def _too_deep(path: Path, documents: bool) -> int | None:
    """The line of a JSON data file (compressed or not) where a row first nests deeper than :data:`MAX_ROW_DEPTH`, or
    None (also when the file cannot be read here). ``documents``: look into a file that is one JSON array too (it
    starts with ``[``; its rows are a level deeper than the array); else only into JSON lines. See
    :func:`first_too_deep`."""
    from rewarduq_exp.data.hub import _split_suffixes
    from rewarduq_exp.data.text_lines import open_text

    f = open_text(path, _split_suffixes(str(path))[1], errors="replace")
    if f is None:
        return None
    try:
        with f:
            first = f.readline()
            document = first.lstrip().startswith("[")
            if document and not documents:
                return None
            return first_too_deep(itertools.chain([first], f), MAX_ROW_DEPTH + document, rows_are_lines=not document)
    except (OSError, EOFError, ValueError, lzma.LZMAError):
        return None


# A JSON string on one line (JSON has no raw newline in a string), in the unrolled form: 8x faster than (a|b)*.
_STRINGS = re.compile(r'"[^"\\\n]*(?:\\.[^"\\\n]*)*"')
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")


def _levels(text: str, depth: int) -> np.ndarray:
    """The nesting level after each bracket of ``text`` outside its strings, starting from ``depth``."""
    brackets = np.frombuffer(_NOT_BRACKETS.sub("", _STRINGS.sub("", text)).encode("ascii"), dtype=np.uint8)
    return depth + np.cumsum(np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1))


def first_too_deep(lines, max_depth: int, *, rows_are_lines: bool) -> int | None:
    """The number (from 1) of the first of ``lines`` (a JSON text's lines, newlines kept or not) where the text nests
    deeper than ``max_depth`` arrays/objects, the outermost being level 1; None if it never does.

    ``rows_are_lines``: JSON lines, every line its own value (the depth starts again at each line, so a broken line
    does not shift the next); otherwise one document. Brackets inside strings do not count. Not a parser and no
    recursion: in JSON lines, a line with no more than ``max_depth`` opening brackets (every row of an ordinary file)
    costs two ``str.count`` calls and any other line is measured without its strings, in numpy; a document is
    measured so in blocks of lines (about 1 MB), line by line only in the block where it goes too deep."""
    if rows_are_lines:
        for number, line in enumerate(lines, 1):
            if line.count("[") + line.count("{") > max_depth:
                levels = _levels(line, 0)
                if levels.size and levels.max() > max_depth:
                    return number
        return None
    depth, done, block, size = 0, 0, [], 0
    for line in itertools.chain(lines, [None]):
        if line is not None:
            block.append(line)
            size += len(line)
            if size < 1 << 20:
                continue
        levels = _levels("\n".join(block), depth)
        if levels.size and levels.max() > max_depth:
            for number, part in enumerate(block, done + 1):
                levels = _levels(part, depth)
                if levels.size and levels.max() > max_depth:
                    return number
                depth = int(levels[-1]) if levels.size else depth
        depth = int(levels[-1]) if levels.size else depth
        done, block, size = done + len(block), [], 0
    return None


def _check_depth(path: Path, key: str, documents: bool) -> None:
    line = _too_deep(path, documents)
    if line is not None:
        raise UserError(f"{key}={path} line {line}: nested deeper than {MAX_ROW_DEPTH} levels, more than the JSON "
                        "reader takes; a row holds texts or lists of {role, content} messages (3 levels)")


def _text_if_scalar(value):
    if isinstance(value, (int, float, np.integer, np.floating)) and not (isinstance(value, float) and np.isnan(value)):
        return str(value)
    return value


class LocalPreferenceFile:
    def __init__(self, path: str, eval_path: str | None = None, columns: dict | None = None, name: str = "local",
                 train_split: str = "train", eval_splits=("eval",), eval_fraction: float = 0.0,
                 cal_fraction: float = 0.0):
        self.name = name
        self.paths = {"train": path, "eval": eval_path}
        self.eval_fraction = float(check_positive(eval_fraction, "dataset.eval_fraction", inclusive=True))
        if self.eval_fraction >= 1:
            raise UserError(f"dataset.eval_fraction={eval_fraction} is invalid: must be in [0, 1) (0: no held-out "
                            "split; the evaluation then needs dataset.eval_path=<file>)")
        self.cal_fraction = check_fraction(cal_fraction)
        self.cal_split = CAL_SPLIT if self.cal_fraction else None
        self.columns = {c: c for c in TEXT + OPTIONAL} | dict(columns or {})
        self.train_split = train_split
        self.eval_splits = tuple(eval_splits)
        for key, given in (("dataset.path", path), ("dataset.eval_path", eval_path)):  # a stat: before any model
            if given:
                _check_regular(Path(given), key)

    def load(self, split: str, max_chars: int | None = None):
        """The split's file as a contract frame. ``max_chars``: rows whose contents have more characters than this
        cannot fit ``max_length`` tokens (the tokenizer's bound, given by the run) and are dropped before loading."""
        splits = ("train", "eval") + ((CAL_SPLIT,) if self.cal_split else ())
        if split not in splits:
            if split == CAL_SPLIT:
                raise UserError(f"dataset '{self.name}' has no calibration split '{CAL_SPLIT}' "
                                "(dataset.cal_fraction=0)")
            raise UserError(f"dataset '{self.name}' has splits {', '.join(splits[:-1])} and {splits[-1]}, not "
                            f"'{split}'")
        eval_file = bool(self.paths["eval"] or not self.eval_fraction)
        if split == "eval" and eval_file or split == "train" and eval_file and not self.cal_split:
            return self._load_file(split, max_chars)
        return self._held_out(self._load_file("train", max_chars), split)

    def _held_out(self, frame, split: str):
        """Split ``split`` of the training file: the rows of the held-out prompts (``eval``, ``cal``) or of the
        others (``train``).

        Without ``eval_path``, ``eval`` is the ``eval_fraction`` share (at least one, never all) of the file's
        distinct prompts with the smallest hash of their text; ``cal`` is the ``cal_fraction`` share of the prompts
        left (all of the file's with ``eval_path``), in an order of their own (a salted hash). A prompt is on one side
        only (several pairs of one prompt would otherwise leak it into the evaluation or the calibration), and the
        sides depend neither on the order of the rows nor on the seed, so every run on the file evaluates and
        calibrates on the same rows. ``cal_fraction=0`` leaves ``train`` as it was before the calibration split."""
        keys = [group_key(p) for p in frame["prompt"]]
        held_eval = np.zeros(len(frame), dtype=bool)
        if not self.paths["eval"] and self.eval_fraction:
            held_eval = hold_out(keys, self.eval_fraction)
            if held_eval is None:
                raise UserError(f"dataset.path={self.paths['train']}: all its rows share one prompt, so none can be "
                                "held out for the evaluation; give it its own file (dataset.eval_path=<file>)")
        held_cal = np.zeros(len(frame), dtype=bool)
        if self.cal_split:
            rest = np.flatnonzero(~held_eval)
            held_cal[rest] = calibration_rows([keys[i] for i in rest], self.cal_fraction, salt=CAL_SPLIT,
                                              source=f"dataset.path={self.paths['train']}")
        keep = {"eval": held_eval, CAL_SPLIT: held_cal, "train": ~held_eval & ~held_cal}[split]
        out = frame[keep].reset_index(drop=True)
        out.attrs = dict(frame.attrs)
        if split != "train":   # rows the length filter dropped are reported once, by the train split
            out.attrs["dropped_too_long"] = []
            return out
        prompts = lambda rows: len({keys[i] for i in np.flatnonzero(rows)})  # noqa: E731
        if held_eval.any():
            log.info("%s: dataset.eval_path not set, so %d of the file's %d prompts (%d of %d pairs, "
                     "dataset.eval_fraction=%g) are held out as split 'eval'", self.name, prompts(held_eval),
                     len(set(keys)), int(held_eval.sum()), len(frame), self.eval_fraction)
        if held_cal.any():
            log.info("%s: %d of the %d training prompts (%d of %d pairs, dataset.cal_fraction=%g) are held out as "
                     "split '%s', for post-hoc recalibration", self.name, prompts(held_cal), prompts(~held_eval),
                     int(held_cal.sum()), int((~held_eval).sum()), self.cal_fraction, CAL_SPLIT)
        return out

    def _load_file(self, split: str, max_chars: int | None):
        import datasets

        datasets.disable_progress_bars()

        path = self.paths[split]
        key = "dataset.path" if split == "train" else "dataset.eval_path"
        if not path:
            raise UserError(f"dataset '{self.name}' split '{split}' has no file: set {key}=<file> (or "
                            "dataset.eval_fraction > 0 to hold out part of dataset.path)")
        path = Path(path)
        if not path.exists():
            raise UserError(f"{key}={path}: file not found")
        _check_regular(path, key)
        fmt = file_builder(str(path), what=f"{key}={path}")
        problem = no_rows(str(path))
        if problem:
            raise UserError(f"{key}={path}: file {problem}")
        if fmt == "json":   # JSON lines nested too deep crash pyarrow's reader (SIGSEGV): checked before it reads
            _check_depth(path, key, documents=False)
        source = f"dataset '{self.name}' ({path})"
        try:
            with reader_errors_unlogged():
                dataset = datasets.load_dataset(fmt, data_files=str(path), split="train")
        except Exception as err:  # malformed file: report it as the user's input, in one line
            if fmt == "json":  # a JSON array: its reader fails on deep rows, without crashing
                _check_depth(path, key, documents=True)
            try:
                why = reader_error(err, path)
            except RecursionError:  # locating the error parses the file again, recursively
                why = f"{type(err).__name__}: {first_line(err, None)}"
            raise UserError(f"{source}: could not be read as {fmt} ({why})") from None
        if len(dataset) == 0:
            raise UserError(f"{key}={path}: file has no rows")
        check_utf8(dataset, f"{key}={path}", path)
        dataset, too_long = self._drop_too_long(dataset, max_chars, f"{key}={path}")
        table = dataset.to_pandas()
        found = ", ".join(map(str, table.columns))
        if fmt == "csv":  # CSV infers numbers for texts such as the answer "4"; the text columns must stay text
            for col in TEXT:
                if self.columns[col] in table.columns:
                    table[self.columns[col]] = table[self.columns[col]].map(_text_if_scalar)
        # A prompt column the user named must exist; the default one may be absent (implicit-prompt layout).
        needed = REQUIRED + (("prompt",) if self.columns["prompt"] != "prompt" else ())
        for col in needed:
            if self.columns[col] not in table.columns:
                raise UserError(f"{source}: missing column '{self.columns[col]}' (for {col}); found: {found}; "
                                f"map it with dataset.columns.{col}=<column>")
        n = len(table)
        column = lambda key: table[self.columns[key]].tolist() if self.columns[key] in table else None  # noqa: E731
        cols = PairColumns(
            chosen=column("chosen"), rejected=column("rejected"), prompt=column("prompt"),
            ids=[str(v) for v in column("id")] if column("id") is not None else [f"{split}-{i}" for i in range(n)],
            weight=column("weight"),
            subset=[str(v) for v in column("subset")] if column("subset") is not None else None,
        )
        frame = normalise_pairs(cols, source, transcripts=self._are_transcripts(cols, source))
        frame.attrs["dropped_too_long"] = too_long
        return validate_preferences(frame, source)

    def _drop_too_long(self, dataset, max_chars: int | None, what: str):
        """(``dataset`` without the rows whose contents exceed ``max_chars`` characters, the subsets of those rows).

        A side of a pair renders at least the contents of its chosen (or rejected) value: with message lists these
        hold the reply, and the prompt turns too when the layout is implicit; with plain strings the prompt column
        is always used, so it counts as well. A prompt column beside message lists does not count, since it is
        ignored when the conversations share their prompt turns (``conversation.split_pair``). Transcripts
        (strings, no prompt column) are not judged here: parsing drops their turn markers and leading whitespace,
        so their characters do not bound what is rendered."""
        names = dataset.column_names
        chosen, rejected, prompt = (self.columns[c] for c in ("chosen", "rejected", "prompt"))
        if max_chars is None or chosen not in names or rejected not in names:
            return dataset, []
        table = dataset.data.table
        kinds = [table.schema.field(c).type for c in (chosen, rejected)]
        strings = all(pa.types.is_string(kind) or pa.types.is_large_string(kind) for kind in kinds)
        if strings and prompt not in names:
            return dataset, []
        chars = np.maximum(content_chars(table.column(chosen)), content_chars(table.column(rejected)))
        if strings:
            chars += content_chars(table.column(prompt))
        over = chars > max_chars
        if not over.any():
            return dataset, []
        if over.all():
            raise UserError(f"dataset '{self.name}' is empty after the length filter: all {len(over)} rows of {what} "
                            f"have more than {max_chars} characters, more than max_length tokens can hold; raise "
                            "max_length")
        subset = self.columns["subset"]
        subsets = (table.column(subset).take(np.flatnonzero(over)).to_pylist() if subset in names
                   else [""] * int(over.sum()))
        return dataset.select(np.flatnonzero(~over)), [str(s) for s in subsets]

    def _are_transcripts(self, cols: PairColumns, source: str) -> bool:
        """No prompt column and string chosen/rejected: HH-RLHF transcripts (see the module docstring)."""
        if cols.prompt is not None or not all(isinstance(v, str) for v in cols.chosen + cols.rejected):
            return False
        if any(parse_transcript(c) and parse_transcript(r) for c, r in zip(cols.chosen, cols.rejected)):
            return True
        raise UserError(f"{source}: chosen/rejected are plain strings and there is no '{self.columns['prompt']}' "
                        "column; add one (or map yours with dataset.columns.prompt=<column>), or give HH-RLHF "
                        "transcripts ('\\n\\nHuman: ...\\n\\nAssistant: ...') in chosen/rejected")
