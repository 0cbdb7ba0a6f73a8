"""Human gold for the downstream tasks: runs trained on ``dataset=vader_pairs`` (ENS-MLP, BAY-LIN, ENS-LoRA,
MCD-DPO) or ``dataset=vader_ratings`` (BoRP) are studied against the crowd's mean sentiment rating (-4..4) of real
sentences, the same number their training labels came from.

Best-of-n candidates are real sentences, never generated ones: for each prompt, one corpus of the split (prompts
spread evenly over the split's corpora), the user turn the run was trained with for that corpus (the pairs' "... with
a positive feeling."; BoRP's plain corpus prompt), and ``n_candidates`` sentences of that corpus and split drawn
without replacement. Only held-out splits are candidates (eval: held-out documents of the training corpora; ood: the
other register): a proxy would have seen the train sentences' labels. The draw depends only on the split's sentences
and the seed, so a pairs run and a BoRP run on the same data settings meet the same candidates. Active learning
reads the run's own pairs (``load``): the pool is its train split, evaluation its eval or ood split.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from rewarduq_exp.core.checks import check_integer
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.synthetic import Candidates
from rewarduq_exp.data.vader_ratings import CORPORA, PROMPTS, VaderPairs, VaderRatings, pair_prompt

HELD_OUT = ("eval", "ood")
# A stream of its own per split, so the eval and ood draws of one seed are independent.
_SPLIT_STREAM = {"eval": 2, "ood": 3}


def _words(texts: pd.Series) -> np.ndarray:
    return texts.str.count(r"\S+").to_numpy(np.int64)


class VaderGold:
    """The world of a VADER run: candidates with human gold for best-of-n, the run's pairs for active learning."""

    def __init__(self, data: VaderRatings):
        self.data = data
        self.name = data.name

    def prompt(self, corpus: str) -> list[dict]:
        """The user turn the run's model was trained with for ``corpus``."""
        return pair_prompt(corpus) if isinstance(self.data, VaderPairs) else [{"role": "user",
                                                                               "content": PROMPTS[corpus]}]

    @property
    def sizes(self) -> dict:
        """Rows per split as the run's config sets them (None: all of a corpus), known before anything is read."""
        return self.data.sizes

    def load(self, split: str):
        return self.data.load(split)

    def training_feature_max(self) -> dict[str, float]:
        """The longest training text in words (pairs: chosen and rejected; ratings: the responses): the range of
        the ``words`` feature the proxy was trained on."""
        frame = self.data.load(self.data.train_split)
        columns = ("chosen", "rejected") if isinstance(self.data, VaderPairs) else ("response",)
        texts = pd.Series([messages[-1]["content"] for c in columns for messages in frame[c]], dtype=object)
        return {"words": float(_words(texts).max())}

    def candidates(self, split: str, n_prompts: int, n_candidates: int, seed: int = 0) -> Candidates:
        """``n_prompts`` prompts of ``split`` with ``n_candidates`` sentences each; ``gold`` is each sentence's mean
        human rating, ``topic`` the corpus's index in ``CORPORA``, ``features["words"]`` its length in words."""
        if split not in HELD_OUT:
            raise UserError(f"best-of-n on {self.name} draws its candidates from held-out sentences: task.splits may "
                            f"name {' or '.join(HELD_OUT)}, not '{split}' (the run was trained on that split's labels)")
        check_integer("task.prompts", n_prompts, minimum=1)
        check_integer("task.n_max", n_candidates, minimum=1)
        rows = self.data.split_rows(split)
        present = set(rows["corpus"])
        corpora = [c for c in (self.data.corpora + self.data.ood_corpora) if c in present]
        if not corpora:
            raise UserError(f"dataset '{self.name}' split '{split}' holds no sentence; no candidates to draw")
        per_prompt = np.array([corpora[p % len(corpora)] for p in range(n_prompts)])
        sizes = rows.groupby("corpus").size()
        used = sizes[list(dict.fromkeys(per_prompt))]
        if n_candidates > used.min():
            raise UserError(f"task.n_max={n_candidates} exceeds the {used.min()} sentences of corpus "
                            f"{used.idxmin()} in split '{split}' of {self.name} (drawn without replacement); "
                            f"largest allowed: task.n_max={used.min()}")
        texts = np.empty((n_prompts, n_candidates), dtype=object)
        gold = np.empty((n_prompts, n_candidates))
        words = np.empty((n_prompts, n_candidates), dtype=np.int64)
        rng = np.random.default_rng([int(seed), _SPLIT_STREAM[split]])
        for corpus in used.index:  # a few corpora; the prompts of one corpus are drawn at once
            mine = np.flatnonzero(per_prompt == corpus)
            part = rows[rows["corpus"] == corpus]
            # n without replacement per prompt: the first n of a random permutation of the corpus, row by row
            pick = np.argsort(rng.random((len(mine), len(part))), axis=1)[:, :n_candidates]
            texts[mine] = part["text"].to_numpy(object)[pick]
            gold[mine] = part["mean_rating"].to_numpy(float)[pick]
            words[mine] = _words(part["text"])[pick]
        topic = np.array([list(CORPORA).index(c) for c in per_prompt], dtype=np.int64)
        return Candidates(topic=topic, prompts=[self.prompt(c) for c in per_prompt], texts=texts.tolist(),
                          gold=gold, features={"words": words})
