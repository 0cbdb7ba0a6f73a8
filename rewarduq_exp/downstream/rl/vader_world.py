"""VADER as an RL world, in Gao et al.'s (2023) gold-model setup: no human rates the policy's new sentences, so the
gold is a second reward model, trained on more of the crowd's ratings than the proxy (``task.gold_run``: any
completed run on ``dataset=vader_pairs`` or ``vader_ratings``; docs/downstream.md says which one the study used).

The prompts are the run's own user turns, one per training corpus; the reference imitates the held-out sentences
best-of-n draws from (the ``eval`` split); the shortcut feature is the length in words (the proxy was trained on
sentences up to its training split's longest).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from rewarduq_exp.data.synthetic import Candidates
from rewarduq_exp.downstream.vader_gold import VaderGold


class VaderTextWorld:
    """The parts of a world the RL task reads (:class:`~rewarduq_exp.data.synthetic.SyntheticWorld`'s names)."""

    def __init__(self, vader: VaderGold):
        self.vader = vader
        self.corpora = list(vader.data.corpora)
        self.num_topics = len(self.corpora)
        self.train_split = vader.data.train_split
        self.name = vader.name

    def prompt(self, topic: int) -> list[dict]:
        return self.vader.prompt(self.corpora[int(topic)])

    def load(self, split: str) -> pd.DataFrame:
        return self.vader.load(split)

    def training_feature_max(self) -> dict[str, float]:
        return self.vader.training_feature_max()

    @staticmethod
    def text_features(texts) -> dict[str, np.ndarray]:
        return {"words": pd.Series(list(texts), dtype=object).str.count(r"\S+").to_numpy(np.int64)}

    def candidates(self, split: str, n_prompts: int, n_candidates: int, seed: int = 0) -> Candidates:
        """Held-out sentences (``eval``), ``n_prompts`` prompts cycling over the training corpora; a request for
        more sentences than the smallest corpus holds draws that many (each sentence once per prompt)."""
        rows = self.vader.data.split_rows("eval")
        smallest = int(rows.groupby("corpus").size().reindex(self.corpora).fillna(0).min())
        c = self.vader.candidates("eval", n_prompts, min(int(n_candidates), smallest), seed=seed)
        c.topic = np.arange(n_prompts) % self.num_topics
        return c


class GoldModelText:
    """``gold(topics, texts)``: the gold run's reward of each text under its corpus's prompt (as the gold run was
    trained: its own prompt format), and the length feature."""

    def __init__(self, world: VaderTextWorld, gold_model, gold_world: VaderGold):
        self.world = world
        self.gold_model = gold_model
        self.gold_world = gold_world

    def gold(self, topics, texts) -> np.ndarray:
        prompts = [self.gold_world.prompt(self.world.corpora[int(t)]) for t in topics]
        completions = [[{"role": "assistant", "content": t}] for t in texts]
        return self.gold_model.score(prompts, completions).reward.to_numpy(np.float64)

    def features(self, texts) -> dict[str, np.ndarray]:
        return self.world.text_features(texts)


def gold_world_of(gold_run) -> VaderGold:
    """The world of ``task.gold_run`` (read from its config, nothing loads); one line when it is missing, is no
    completed run or was not trained on VADER ratings."""
    from pathlib import Path

    from rewarduq_exp.core.errors import UserError
    from rewarduq_exp.downstream.world_runs import VADER_WORLDS, world_of
    from rewarduq_exp.runner.trained_run import read_run_config

    if gold_run is None:
        raise UserError("task=rl on a VADER run needs a gold: task.gold_run=<a completed run on dataset=vader_pairs or "
                        "vader_ratings, trained on more ratings than the proxy> (Gao et al.'s gold-model setup)")
    try:
        _, gold_config = read_run_config(Path(str(gold_run)))
    except UserError as err:   # its message names run=: say which setting it is
        raise UserError(f"task.gold_run: {err}") from None
    if gold_config.dataset.get("_target_") not in VADER_WORLDS:
        raise UserError(f"task.gold_run={gold_run} was not trained on VADER ratings; the gold of a VADER run must be")
    return world_of(gold_config, Path(str(gold_run)) / ".hydra" / "config.yaml")


def check_gold_run(configs, gold_run) -> None:
    """Before anything loads: a study of any VADER run (``configs``: the runs' configs) needs ``task.gold_run``, a
    completed VADER run (:func:`gold_world_of`); a study of synthetic runs only does not read it."""
    from rewarduq_exp.downstream.world_runs import VADER_WORLDS

    if any(c.dataset.get("_target_") in VADER_WORLDS for c in configs):
        gold_world_of(gold_run)


_GOLD_MODELS: dict = {}


def _gold_model(gold_run: str, device: str, cache_dir, batch_size, trust_remote_code: bool):
    """The gold run's model, loaded once per process (every proxy run of a study, and every RL run of a worker,
    shares it)."""
    key = (gold_run, device, str(cache_dir), batch_size, trust_remote_code)
    if key not in _GOLD_MODELS:
        from rewarduq_exp.api import load_run

        _GOLD_MODELS[key] = load_run(gold_run, device=device, cache_dir=cache_dir, batch_size=batch_size,
                                     progress=False, trust_remote_code=trust_remote_code)
    return _GOLD_MODELS[key]


def rl_world(config, config_path, gold_run=None, *, device: str = "cpu", cache_dir=None, batch_size=None,
             trust_remote_code: bool = False):
    """(world, text gold) of a run for the RL task: the synthetic world with its own gold, or VADER with the gold
    run's reward (``gold_run`` required there)."""
    from rewarduq_exp.data.synthetic import SyntheticWorld
    from rewarduq_exp.downstream.rl.world_text import WorldText
    from rewarduq_exp.downstream.world_runs import world_of

    world = world_of(config, config_path)
    if isinstance(world, SyntheticWorld):
        return world, WorldText(world)
    gold_world = gold_world_of(gold_run)
    gold_model = _gold_model(str(gold_run), device, cache_dir, batch_size, trust_remote_code)
    text_world = VaderTextWorld(world)
    return text_world, GoldModelText(text_world, gold_model, gold_world)
