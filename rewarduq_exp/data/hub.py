"""Datasets from the Hugging Face hub, with the same code reading a local copy when there is no network.

Where a split comes from, first match wins:

1. ``data_files``: your own file(s) in the hub schema (parquet, jsonl[.gz], json, csv, arrow); a dict maps split
   names to files, a string or list serves every split;
2. ``path``: a local folder, either a snapshot of the hub repository
   (``huggingface-cli download <hub_id> --repo-type dataset --local-dir DIR``) or a ``save_to_disk`` folder;
3. ``mirror_dir`` (``paths.datasets_dir``): a folder holding snapshots as ``<mirror_dir>/<hub_id>``, so one setting
   serves every dataset of a run, eval datasets included;
4. the hub itself (``hub_id``, ``config_name``, ``data_dir``, ``revision``), through ``datasets.load_dataset`` and
   its cache.

Every source goes through the same ``datasets`` calls, so the tests (local fixtures in the exact hub schema) run
the code a user runs. ``num_samples`` (train split) / ``eval_num_samples`` (other splits) draw a subset with a
fixed ``sample_seed`` that does not depend on the run seed, so a seed sweep compares models on the same data.

The calibration split ``cal`` (:mod:`rewarduq_exp.data.calibration_split`) of a dataset with a training split: the
rows of ``cal_fraction`` of the training split's prompts (default 0.1; 0: no ``cal``), held out before
``num_samples`` draws the training rows from the others. A prompt is grouped by its opening turns, the messages before
the first assistant turn (of the conversation, or of the prompt column where the conversation starts with the
reply), so pairs of one prompt, and conversations that continue one opening differently, are on one side only. Which
prompts are held out is a hash of their text keyed with ``sample_seed``: it depends neither on the run seed nor on
``num_samples``. ``eval_num_samples`` draws from ``cal`` as from the other splits that are not the training split;
cal ids are those of the training split (``train-<row>``). Evaluation-only datasets have no ``cal``.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from rewarduq_exp.core.errors import UserError, first_line
from rewarduq_exp.core.hub_access import hub_reachable, offline_hint
from rewarduq_exp.data.calibration_split import CAL_SPLIT, calibration_rows, check_fraction, group_key
from rewarduq_exp.data.contract import validate_preferences
from rewarduq_exp.data.text_lines import invalid_utf8_line, json_error, line_of_row, open_text

log = logging.getLogger(__name__)

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")  # datasets decompresses these itself


def _split_suffixes(path: str) -> tuple[str, str | None]:
    """(file type suffix, compression suffix or None) of a data file's name, lower case."""
    name = Path(path).name.lower()
    compression = next((c for c in COMPRESSIONS if name.endswith(c)), None)
    if compression:
        name = name.removesuffix(compression)
    return Path(name).suffix, compression


def file_builder(path: str, what: str | None = None) -> str:
    """The ``datasets`` builder that reads a data file, by its type suffix (a compression suffix may follow).

    This is the one place that decides which data files can be read (``dataset.data_files`` of the hub loaders and
    ``dataset=local`` both use it); ``what`` names the file in the error (default ``data file <path>``).
    """
    suffix, compression = _split_suffixes(path)
    builder = FILE_BUILDERS.get(suffix)
    if builder is None:
        shown = (suffix or "") + (compression or "") or "(none)"
        raise UserError(f"{what or f'data file {path}'}: unsupported file type '{shown}'; allowed: "
                        f"{', '.join(FILE_BUILDERS)}, optionally compressed ({', '.join(COMPRESSIONS)}, "
                        "e.g. .jsonl.gz)")
    return builder


def no_rows(path: str) -> str | None:
    """``has no rows (...)`` when a data file certainly holds no rows, else None (also when it cannot tell).

    Checked before reading: ``datasets`` fails on such files with messages that do not say so (``StopIteration``,
    ``Instruction "train" corresponds to no data!``, ``BatchSize must be greater than 0``). Cheap for any file
    size: a Parquet footer, or the first two non-blank lines of a text file.
    """
    path = Path(path)
    suffix, compression = _split_suffixes(str(path))
    builder = FILE_BUILDERS.get(suffix)
    try:
        if compression is None and path.stat().st_size == 0:
            return "has no rows (the file is empty)"
        if builder == "parquet" and compression is None:
            import pyarrow.parquet as pq

            return "has no rows" if pq.ParquetFile(path).metadata.num_rows == 0 else None
        f = open_text(path, compression, errors="replace") if builder in ("json", "csv") else None
        if f is None:
            return None
        lines, empty_array = 0, False
        with f:
            for line in iter(lambda: f.readline(1 << 16), ""):  # bounded: one JSON array may fill one line
                if builder == "json" and line.strip() == "[]":
                    empty_array = True
                    continue
                lines += bool(line.strip())
                if lines > (builder == "csv"):  # a CSV's first line is its header
                    return None
    except Exception:  # unreadable: the reader reports what is wrong
        return None
    if empty_array:
        return "has no rows (an empty JSON array)"
    return "has no rows (the file is empty)" if lines == 0 else "has no rows (only a header line)"


def reader_error(err: BaseException, path: str | Path | None = None) -> str:
    """``<type>: <message>`` of the parser's own error under the ``datasets`` library's wrappers. For a JSON file
    ``path``, where the JSON breaks as a line number (the parser's "in row N" counts from 0 within the block it
    was parsing, not in the file)."""
    while err.__cause__ is not None:
        err = err.__cause__
    if path is not None and isinstance(err, UnicodeDecodeError) and (line := invalid_utf8_line(path)) is not None:
        return f"not valid UTF-8 at line {line}; data files must be UTF-8 (convert it, e.g. iconv -f <its " \
               "encoding> -t utf-8)"
    if path is not None and FILE_BUILDERS.get(_split_suffixes(str(path))[0]) == "json":
        found = json_error(path)
        if found is not None:
            return f"not valid JSON at line {found[0]}: {found[1]}"
    return f"{type(err).__name__}: {first_line(err, None)}"


@contextmanager
def reader_errors_unlogged():
    """Silence the ``datasets`` library's logger while it reads a file: its readers log a parse error (twice, through
    its own handler and ours) before raising it, and the caller reports that error as the one line it should be."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_utf8(dataset, what: str, path: str | Path | None = None) -> None:
    """A one-line :class:`UserError` naming ``what`` (the file), the column and where the text is when a text of
    ``dataset`` (a ``datasets.Dataset``) is not valid UTF-8: the line of the file ``path`` where it has lines (JSON
    lines, CSV), else the row, both counted from 1.

    Checked right after reading: the JSON and CSV readers store such bytes as they are, and the first conversion to
    Python strings failed deep inside pandas or ``to_dict`` with an ``ArrowException`` naming neither file nor row.
    Arrow validates UTF-8 in bulk, so this costs little next to reading the file.
    """
    import pyarrow as pa

    table = dataset.data.table
    for name in table.column_names:
        start = 0
        for chunk in table.column(name).chunks:
            try:
                chunk.validate(full=True)
            except pa.ArrowInvalid:
                row = _first_invalid_row(chunk)
                at = ""
                if row is not None:
                    line = line_of_row(path, start + row) if path is not None else None
                    at = f" (line {line})" if line is not None else f" (row {start + row + 1})"
                raise UserError(f"{what}: column '{name}' holds text that is not valid UTF-8{at}; data files must "
                                "be UTF-8 (convert it, e.g. iconv -f <its encoding> -t utf-8)") from None
            start += len(chunk)


def _first_invalid_row(array) -> int | None:
    """Index of the first element of ``array`` that holds invalid UTF-8 (None if none is found). Only strings are
    validated piecewise (a slice of a list array validates all of its items), so lists and structs are searched in
    their flattened strings and the hit is mapped back to its row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def valid(part) -> bool:
        try:
            part.validate(full=True)
            return True
        except pa.ArrowInvalid:
            return False

    kind = array.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        if valid(array):
            return None
        low, high = 0, len(array)  # bisection: the first invalid item is in [low, high)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if valid(array.slice(low, middle - low)) else (low, middle)
        return low
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        item = _first_invalid_row(pc.list_flatten(array))
        return None if item is None else pc.list_parent_indices(array)[item].as_py()
    if pa.types.is_struct(kind):
        rows = [_first_invalid_row(pc.struct_field(array, [i])) for i in range(kind.num_fields)]
        return min((row for row in rows if row is not None), default=None)
    return None


def sample_indices(n: int, num_samples, seed: int, key: str) -> np.ndarray | None:
    """Row indices to keep (sorted, drawn without replacement), or None for all rows.

    ``num_samples`` is ``all``, an int (number of rows) or a float in (0, 1] (fraction of the rows).
    """
    if num_samples is None or num_samples == "all":
        return None
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, float)):
        raise UserError(f"{key}={num_samples!r} is invalid: use all, a number of rows (int >= 1) or a fraction "
                        "in (0, 1]")
    if isinstance(num_samples, float):
        if not 0.0 < num_samples <= 1.0:
            raise UserError(f"{key}={num_samples} is invalid: a fraction must be in (0, 1]")
        k = max(1, int(round(num_samples * n)))
    else:
        if num_samples < 1:
            raise UserError(f"{key}={num_samples} is invalid: a number of rows must be >= 1")
        k = int(num_samples)
    if k >= n:
        if k > n:
            log.warning("%s=%d but the split has only %d rows: using all of them", key, k, n)
        return None
    return np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False))


class HubDataset:
    """Base of the hub loaders: fetch a split, check its columns, subsample, then ``normalise`` (subclasses)."""

    kind = "pairs"                 # pairs | kwise | pointwise: what ``load`` returns
    required_columns: tuple = ()   # columns the hub schema must have (checked with a one-line error)

    def __init__(self, name: str, hub_id: str, splits=("train",), train_split: str | None = "train",
                 eval_splits=(), config_name: str | None = None, data_dir: str | None = None,
                 revision: str | None = None, path: str | None = None, data_files=None,
                 mirror_dir: str | None = None, num_samples="all", eval_num_samples="all", sample_seed: int = 0,
                 cal_fraction: float = 0.1):
        self.name = name
        self.hub_id = hub_id
        self.splits = tuple(splits)
        self.train_split = train_split
        self.eval_splits = tuple(eval_splits)
        self.config_name = config_name
        self.data_dir = data_dir
        self.revision = revision
        self.path = path
        self.data_files = data_files
        self.mirror_dir = mirror_dir
        self.num_samples = num_samples
        self.eval_num_samples = eval_num_samples
        self.sample_seed = int(sample_seed)
        for key, value in (("num_samples", num_samples), ("eval_num_samples", eval_num_samples)):
            sample_indices(10, value, 0, f"dataset.{key}")  # validate before any heavy work
        self.cal_fraction = check_fraction(cal_fraction)
        # held out of the training split; an evaluation-only dataset has none
        self.cal_split = CAL_SPLIT if self.train_split and self.cal_fraction else None
        if self.cal_split and self.cal_split in self.splits:
            raise UserError(f"dataset '{name}' has a split named '{CAL_SPLIT}' of its own, the name of the held-out "
                            "calibration split; set dataset.cal_fraction=0")

    # ------------------------------------------------------------------------------------------------ fetching
    def local_folder(self) -> Path | None:
        if self.path:
            folder = Path(self.path)
            if not folder.is_dir():
                raise UserError(f"dataset '{self.name}': dataset.path={folder} is not a folder; point it at a "
                                f"snapshot of {self.hub_id} or a save_to_disk folder")
            return folder
        if self.mirror_dir and (Path(self.mirror_dir) / self.hub_id).is_dir():
            return Path(self.mirror_dir) / self.hub_id
        return None

    def fetch(self, split: str, data_dir: str | None = None):
        """One split as a ``datasets.Dataset`` (``data_dir`` overrides the config's, for multi-folder sources)."""
        import datasets

        data_dir = data_dir if data_dir is not None else self.data_dir
        if self.data_files:
            files = self.data_files.get(split) if isinstance(self.data_files, dict) else self.data_files
            if not files:
                raise UserError(f"dataset '{self.name}': dataset.data_files has no entry for split '{split}'; "
                                f"it has: {', '.join(self.data_files)}")
            files = [files] if isinstance(files, str) else list(files)
            for file in files:
                if not Path(file).exists():
                    raise UserError(f"dataset '{self.name}': data file {file} not found")
            builder = file_builder(files[0])
            for file in files:
                problem = no_rows(file)
                if problem:
                    raise UserError(f"dataset '{self.name}': data file {file} {problem}")
            named = files[0] if len(files) == 1 else f"{files[0]} (and {len(files) - 1} more)"
            table = self._read(lambda: datasets.load_dataset(builder, data_files={split: files}, split=split),
                               f"data file {named}", files[0] if len(files) == 1 else None)
            if len(table) == 0:
                raise UserError(f"dataset '{self.name}': data file {named} has no rows")
            return table
        folder = self.local_folder()
        if folder is not None:
            if (folder / "dataset_dict.json").exists() or (folder / "state.json").exists():
                def from_disk():
                    saved = datasets.load_from_disk(str(folder))
                    return saved[split] if isinstance(saved, datasets.DatasetDict) else saved
                return self._read(from_disk, f"saved dataset {folder}")
            return self._read(lambda: datasets.load_dataset(str(folder), self.config_name, data_dir=data_dir,
                                                            split=split), f"local copy {folder}")
        return self._from_hub(split, data_dir)

    def _read(self, read, what: str, path: str | None = None):
        """``read()``'s table, UTF-8 checked; any failure one line naming ``what`` (``path``: the one file read)."""
        try:
            with reader_errors_unlogged():
                table = read()
            check_utf8(table, f"dataset '{self.name}': {what}", path)
            return table
        except UserError:
            raise
        except Exception as err:  # a broken local copy is the user's input: one line, not a traceback
            raise UserError(f"dataset '{self.name}': could not read {what} ({reader_error(err, path)})") from None

    def _from_hub(self, split: str, data_dir: str | None):
        import datasets
        from huggingface_hub.utils import logging as hub_logging

        hub_logging.set_verbosity_error()  # the retry warnings of an unreachable hub would bury the one-line error
        hub_reachable()  # once per process: without network, go offline at once instead of retrying for a minute
        try:
            return datasets.load_dataset(self.hub_id, self.config_name, data_dir=data_dir, revision=self.revision,
                                         split=split)
        except Exception as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise UserError(
                f"dataset '{self.name}': could not fetch {self.hub_id} (split {split}) from the Hugging Face hub "
                f"({offline_hint()}{type(err).__name__}: {reason}); without network, download it elsewhere with "
                f"`huggingface-cli "
                f"download {self.hub_id} --repo-type dataset --local-dir DIR` and pass dataset.path=DIR "
                f"(or paths.datasets_dir=<folder holding {self.hub_id}>, or dataset.data_files=<file>)") from None

    # ------------------------------------------------------------------------------------------------ loading
    def load(self, split: str):
        cal = self.cal_split is not None and split == self.cal_split
        if split not in self.splits and not cal:
            allowed = self.splits + ((self.cal_split,) if self.cal_split else ())
            if split == CAL_SPLIT:
                why = "dataset.cal_fraction=0" if self.train_split else "an evaluation-only dataset"
                raise UserError(f"dataset '{self.name}' has no calibration split '{CAL_SPLIT}' ({why})")
            raise UserError(f"dataset '{self.name}' has no split '{split}'; allowed: {', '.join(allowed)}")
        source = self.train_split if cal else split   # the hub split the rows come from
        table = self.fetch(source)
        self.check_columns(table.column_names, source)
        rows = np.arange(len(table))
        if self.cal_split is not None and source == self.train_split:
            held = self.cal_rows(table)
            rows = np.flatnonzero(held if cal else ~held)
            table = table.select(rows)
        key = "dataset.num_samples" if split == self.train_split else "dataset.eval_num_samples"
        amount = self.num_samples if split == self.train_split else self.eval_num_samples
        keep = sample_indices(len(table), amount, self.sample_seed, key)
        if keep is not None:
            table = table.select(keep)
            rows = rows[keep]
        frame = self.normalise(table, source, rows)
        return validate_preferences(frame, f"dataset '{self.name}'") if self.kind == "pairs" else frame

    def cal_rows(self, table) -> np.ndarray:
        """The rows of the training split ``table`` held out as the calibration split (a boolean mask): those of
        ``cal_fraction`` of its prompts, grouped by :meth:`group_keys`, in an order keyed with ``sample_seed``."""
        return calibration_rows(self.group_keys(table), self.cal_fraction, salt=f"{CAL_SPLIT}:{self.sample_seed}",
                                source=f"dataset '{self.name}' (split {self.train_split})")

    def group_keys(self, table) -> list[str]:
        """One text per row of ``table`` (a ``datasets.Dataset`` in the hub schema): its prompt's opening turns, the
        messages before the first assistant turn, of ``chosen`` or, where that starts with the reply (or is a text),
        of the prompt column. Read in Arrow: only the opening turns become Python strings."""
        prompt_column = getattr(self, "prompt_column", None)
        columns = [c for c in ("chosen", prompt_column) if c and c in table.column_names]
        data = table.select_columns(list(dict.fromkeys(columns))).with_format("arrow")[:]
        chosen = (opening_turns(data.column("chosen"), "assistant") if "chosen" in columns
                  else [[] for _ in range(len(data))])
        prompt = opening_turns(data.column(prompt_column), "user") if prompt_column in columns else None
        return [group_key(turns or (prompt[i] if prompt is not None else None) or [])
                for i, turns in enumerate(chosen)]

    def check_columns(self, found, split: str) -> None:
        missing = [c for c in self.required_columns if c not in found]
        if missing:
            raise UserError(f"dataset '{self.name}' ({self.hub_id}, split {split}) lacks column(s) "
                            f"{', '.join(missing)}; found: {', '.join(found)}")

    def normalise(self, table, split: str, row_index: np.ndarray):
        raise NotImplementedError


def opening_turns(column, default_role: str) -> list[list]:
    """Per row of ``column`` (a pyarrow ChunkedArray of conversations or texts), the ``[role, content]`` of its turns
    before the first assistant turn. A text is one turn of ``default_role`` (none when that is ``assistant``: a
    reply). Lists of ``{role, content}`` structs are read in Arrow (only the opening turns' contents are converted);
    any other value becomes one turn holding its JSON text."""
    import pyarrow as pa
    import pyarrow.compute as pc

    out: list[list] = []
    for chunk in column.chunks:
        kind = chunk.type
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            if default_role == "assistant":
                out.extend([] for _ in range(len(chunk)))
            else:
                out.extend([] if v is None else [[default_role, v]] for v in chunk.to_pylist())
            continue
        item = kind.value_type if pa.types.is_list(kind) or pa.types.is_large_list(kind) else None
        if item is None or not pa.types.is_struct(item) or not {"role", "content"} <= {f.name for f in item}:
            out.extend([] if v is None else [["", group_key(v)]] for v in chunk.to_pylist())
            continue
        offsets = chunk.offsets.to_numpy().astype(np.int64)
        start, stop = int(offsets[0]), int(offsets[-1])
        messages = chunk.values.slice(start, stop - start)
        offsets -= start
        roles = pc.struct_field(messages, "role").to_numpy(zero_copy_only=False)
        n = len(roles)
        # the first assistant turn at or after each message (n: none)
        first_assistant = np.minimum.accumulate(np.where(roles == "assistant", np.arange(n), n)[::-1])[::-1]
        first_assistant = np.append(first_assistant, n)
        begin, end = offsets[:-1], np.minimum(first_assistant[offsets[:-1]], offsets[1:])
        counts = np.maximum(end - begin, 0)
        index = np.repeat(begin - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        contents = pc.struct_field(messages, "content").take(pa.array(index, type=pa.int64())).to_pylist()
        turns = [[str(r), c] for r, c in zip(roles[index], contents)]
        bounds = np.concatenate([[0], np.cumsum(counts)])
        out.extend(turns[bounds[i]:bounds[i + 1]] for i in range(len(chunk)))
    return out


class HubPreferencePairs(HubDataset):
    """Pairwise sources: UltraFeedback, Skywork, Tulu 3 (implicit-prompt conversations) and RewardBench (strings).

    ``id_column`` / ``subset_column`` name the source's columns for the contract's ``id`` / ``subset`` (null when
    the source has none: ids are then ``<split>-<row>``, stable under subsampling).
    """

    required_columns = ("chosen", "rejected")

    def __init__(self, *args, prompt_column: str | None = None, id_column: str | None = None,
                 subset_column: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompt_column = prompt_column
        self.id_column = id_column
        self.subset_column = subset_column
        self.required_columns = ("chosen", "rejected") + tuple(
            c for c in (prompt_column, id_column, subset_column) if c)

    def normalise(self, table, split: str, row_index: np.ndarray):
        from rewarduq_exp.data.conversation import PairColumns, normalise_pairs

        wanted = [c for c in ("chosen", "rejected", self.prompt_column, self.id_column, self.subset_column) if c]
        raw = table.select_columns(list(dict.fromkeys(wanted))).to_dict()
        cols = PairColumns(
            chosen=raw["chosen"],
            rejected=raw["rejected"],
            prompt=raw[self.prompt_column] if self.prompt_column else None,
            ids=[str(v) for v in raw[self.id_column]] if self.id_column else [f"{split}-{i}" for i in row_index],
            subset=[str(v) for v in raw[self.subset_column]] if self.subset_column else None,
        )
        return normalise_pairs(cols, f"dataset '{self.name}'")
