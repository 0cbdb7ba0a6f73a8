"""allenai/reward-bench-2: one prompt, its correct completion(s) and three or more incorrect ones, kept K-wise.

The hub stores ``chosen`` and ``rejected`` as lists of strings. A K-wise row keeps ``completions`` = chosen +
rejected (each as an assistant turn), ``best`` = 0 and ``num_correct`` = the number of chosen ones (1 except in the
``Ties`` subset, whose "tied" prompts have several correct answers and which is scored by its own rule,
``metrics/kwise.py``). Ties is kept by default, as the official score includes it; ``dataset.exclude_subsets=[Ties]``
leaves it out.
"""

from __future__ import annotations

import numpy as np

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.contract import make_kwise_frame
from rewarduq_exp.data.hub import HubDataset


class RewardBench2(HubDataset):
    kind = "kwise"
    required_columns = ("id", "prompt", "chosen", "rejected", "subset")

    def __init__(self, *args, exclude_subsets=(), **kwargs):
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
        no_correct = sorted({s for s, c in zip(raw["subset"], raw["chosen"]) if len(c) < 1})
        if no_correct:
            raise UserError(f"dataset '{self.name}': subset(s) {', '.join(no_correct)} have prompts without a correct "
                            "completion; leave them out with dataset.exclude_subsets=[...]")
        completions = [[[{"role": "assistant", "content": text}] for text in c + r]
                       for c, r in zip(raw["chosen"], raw["rejected"])]
        prompts = [[{"role": "user", "content": p}] for p in raw["prompt"]]
        return make_kwise_frame(raw["id"], prompts, completions, best=np.zeros(len(prompts), dtype=int),
                                subset=raw["subset"], num_correct=[len(c) for c in raw["chosen"]])
