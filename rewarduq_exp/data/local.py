"""Users' own preference files (``dataset=local``): JSONL, JSON, Parquet or CSV, one pair per row.

Read through ``datasets.load_dataset`` (the same machinery as the hub loaders), then mapped onto the contract:
``columns`` says which file column holds each contract column. ``prompt``/``chosen``/``rejected`` may be plain
strings or lists of ``{role, content}`` messages; a chosen/rejected list that repeats the prompt's turns (the
"implicit prompt" layout) is reduced to the assistant reply, so no turn is duplicated.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rewarduq_exp.data.contract import as_messages, make_preference_frame, validate_preferences
from rewarduq_exp.errors import UserError

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
REQUIRED = ("prompt", "chosen", "rejected")
OPTIONAL = ("id", "weight", "subset")


def _text_if_scalar(value):
    if isinstance(value, (int, float, np.integer, np.floating)) and not (isinstance(value, float) and np.isnan(value)):
        return str(value)
    return value


def _completion(prompt: list[dict], value, source: str, column: str) -> list[dict]:
    msgs = as_messages(value, "assistant", source=source, column=column)
    if len(msgs) > len(prompt) and msgs[: len(prompt)] == prompt:
        msgs = msgs[len(prompt):]  # implicit-prompt layout: chosen/rejected repeat the conversation
    return msgs


class LocalPreferenceFile:
    def __init__(self, path: str, eval_path: str | None = None, columns: dict | None = None, name: str = "local",
                 train_split: str = "train", eval_splits=("eval",)):
        self.name = name
        self.paths = {"train": path, "eval": eval_path}
        self.columns = {c: c for c in REQUIRED + OPTIONAL} | dict(columns or {})
        self.train_split = train_split
        self.eval_splits = tuple(eval_splits)

    def load(self, split: str):
        import datasets

        datasets.disable_progress_bars()

        if split not in self.paths:
            raise UserError(f"dataset '{self.name}' has splits train and eval, not '{split}'")
        path = self.paths[split]
        key = "dataset.path" if split == "train" else "dataset.eval_path"
        if not path:
            raise UserError(f"dataset '{self.name}' split '{split}' has no file: set {key}=<file>")
        path = Path(path)
        if not path.exists():
            raise UserError(f"{key}={path}: file not found")
        fmt = FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise UserError(f"{key}={path}: unsupported file type '{path.suffix}'; allowed: {', '.join(FORMATS)}")
        source = f"dataset '{self.name}' ({path})"
        try:
            table = datasets.load_dataset(fmt, data_files=str(path), split="train").to_pandas()
        except Exception as err:  # malformed file: report it as the user's input, in one line
            root = err
            while root.__cause__ is not None:  # the parser's own message (e.g. pyarrow's) says what is wrong
                root = root.__cause__
            raise UserError(f"{source}: could not be read as {fmt} ({type(root).__name__}: {root})") from None
        found = ", ".join(map(str, table.columns))
        if fmt == "csv":  # CSV infers numbers for texts such as the answer "4"; the text columns must stay text
            for col in REQUIRED:
                if self.columns[col] in table.columns:
                    table[self.columns[col]] = table[self.columns[col]].map(_text_if_scalar)
        for col in REQUIRED:
            if self.columns[col] not in table.columns:
                raise UserError(f"{source}: missing column '{self.columns[col]}' (for {col}); found: {found}; "
                                f"map it with dataset.columns.{col}=<column>")
        prompts = [as_messages(v, "user", source=source, column=self.columns["prompt"])
                   for v in table[self.columns["prompt"]]]
        chosen = [_completion(p, v, source, self.columns["chosen"]) for p, v in zip(prompts, table[self.columns["chosen"]])]
        rejected = [_completion(p, v, source, self.columns["rejected"])
                    for p, v in zip(prompts, table[self.columns["rejected"]])]
        n = len(table)
        ids = table[self.columns["id"]].astype(str) if self.columns["id"] in table else [f"{split}-{i}" for i in range(n)]
        weight = table[self.columns["weight"]].to_numpy(float) if self.columns["weight"] in table else np.ones(n)
        subset = table[self.columns["subset"]].astype(str) if self.columns["subset"] in table else None
        frame = make_preference_frame(ids, prompts, chosen, rejected, weight=weight, subset=subset)
        return validate_preferences(frame, source)
