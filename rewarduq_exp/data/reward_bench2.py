"""allenai/reward-bench-2: one prompt, one correct completion and three incorrect ones, kept K-wise.

The hub stores ``chosen`` and ``rejected`` as lists of strings. A K-wise row keeps ``completions`` = chosen +
rejected (each as an assistant turn) and ``best`` = 0, the index of the correct one. The ``Ties`` subset has several
correct answers per prompt and its own scoring rule, so it is excluded by default (``exclude_subsets``).
"""

from __future__ import annotations

import numpy as np

from rewarduq_exp.data.contract import make_kwise_frame
from rewarduq_exp.data.hub import HubDataset
from rewarduq_exp.errors import UserError


class RewardBench2(HubDataset):
    kind = "kwise"
    required_columns = ("id", "prompt", "chosen", "rejected", "subset")

    def __init__(self, *args, exclude_subsets=("Ties",), **kwargs):
        super().__init__(*args, **kwargs)
        self.exclude_subsets = tuple(exclude_subsets or ())

    def fetch(self, split: str, data_dir: str | None = None):
        table = super().fetch(split, data_dir)
        if self.exclude_subsets and "subset" in table.column_names:
            excluded = set(self.exclude_subsets)
            table = table.filter(lambda subset: subset not in excluded, input_columns="subset")
        return table

    def normalise(self, table, split: str, row_index: np.ndarray):
        raw = table.select_columns(list(self.required_columns)).to_dict()
        several = sorted({s for s, c in zip(raw["subset"], raw["chosen"]) if len(c) != 1})
        if several:
            raise UserError(f"dataset '{self.name}': subset(s) {', '.join(several)} have more or less than one "
                            "correct completion per prompt; keep them in dataset.exclude_subsets (default [Ties])")
        completions = [[[{"role": "assistant", "content": text}] for text in c + r]
                       for c, r in zip(raw["chosen"], raw["rejected"])]
        prompts = [[{"role": "user", "content": p}] for p in raw["prompt"]]
        return make_kwise_frame(raw["id"], prompts, completions, best=np.zeros(len(prompts), dtype=int),
                                subset=raw["subset"])
