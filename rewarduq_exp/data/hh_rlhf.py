"""Anthropic/hh-rlhf: chosen/rejected are full transcripts ("\\n\\nHuman: ...\\n\\nAssistant: ...").

The hub repository keeps each subset in its own folder (``harmless-base/train.jsonl.gz``, ...); each chosen subset
is fetched with ``data_dir=<subset>`` and its name goes into the contract's ``subset`` column, so dropped pairs and
metrics can be broken down per subset. ``red-team-attempts`` has another schema (no chosen/rejected) and is not a
preference subset. Transcripts are parsed into messages and the turns both sides share become the prompt. The
calibration split (``cal``, see ``hub.py``) groups the pairs of all subsets by their transcript's opening, the text
before its first ``Assistant:`` turn.
"""

from __future__ import annotations

import numpy as np

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.calibration_split import group_key
from rewarduq_exp.data.conversation import PairColumns, normalise_pairs
from rewarduq_exp.data.hub import HubDataset

SUBSETS = ("harmless-base", "helpful-base", "helpful-online", "helpful-rejection-sampled")


class HHRLHF(HubDataset):
    required_columns = ("chosen", "rejected")

    def __init__(self, *args, subsets=SUBSETS, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(subsets, str):
            subsets = [subsets]
        unknown = [s for s in subsets if s not in SUBSETS]
        if unknown or not subsets:
            raise UserError(f"dataset.subsets={list(subsets)} is invalid: choose from {', '.join(SUBSETS)}")
        self.subsets = tuple(subsets)

    def fetch(self, split: str, data_dir: str | None = None):
        import datasets

        if self.data_files:  # the user's own file(s) in this schema: one source, no subset folders
            table = super().fetch(split, data_dir)
            return table.select_columns(["chosen", "rejected"]).add_column("subset", [""] * len(table))
        parts = []
        for subset in self.subsets:
            part = super().fetch(split, data_dir=subset)
            self.check_columns(part.column_names, f"{split} of {subset}")
            parts.append(part.select_columns(["chosen", "rejected"]).add_column("subset", [subset] * len(part)))
        return datasets.concatenate_datasets(parts)

    def group_keys(self, table) -> list[str]:
        """The transcript's opening: the text of ``chosen`` before its first ``Assistant:`` turn (read in Arrow)."""
        import pyarrow.compute as pc

        chosen = table.select_columns(["chosen"]).with_format("arrow")[:].column("chosen")
        heads = pc.list_element(pc.split_pattern(chosen, pattern="\n\nAssistant:", max_splits=1), 0)
        return [group_key(head) for head in heads.to_pylist()]

    def normalise(self, table, split: str, row_index: np.ndarray):
        raw = table.to_dict()
        cols = PairColumns(chosen=raw["chosen"], rejected=raw["rejected"], subset=raw["subset"],
                           ids=[f"{s}/{split}-{i}" for s, i in zip(raw["subset"], row_index)])
        return normalise_pairs(cols, f"dataset '{self.name}'", transcripts=True)
