"""Use a trained run from Python: score text with uncertainty, compare pairs, pick the best of n, reward an RL policy.

    import rewarduq_exp as r
    model = r.load_run("outputs/runs/<run>")
    model.score(["What is 2+2?"], ["4"])              # reward, lower, upper, uncertainty per completion
    model.score_pairs(prompts, chosen, rejected)      # P(chosen > rejected) with its interval

Every method gives bounds ``reward +- beta * u`` (paper eq. 9); ``uncertainty`` is that u (the ensemble's std, the
Laplace posterior's sqrt(z^T H^-1 z), the spread over dropout masks), recovered as (upper - reward) / beta. The
conservative reward ``reward - k u`` and the optimistic ``reward + k u`` are the usual ways to use it: rank or filter
by what the model is sure of, or explore where it is not.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.contract import as_messages
from rewarduq_exp.methods.base import Scores
from rewarduq_exp.runner.trained_run import load_trained_method

REWARD_KINDS = ("conservative", "optimistic", "mean")


def check_reward_kind(kind: str, k: float) -> None:
    if kind not in REWARD_KINDS:
        raise UserError(f"kind={kind!r} is invalid: allowed values are {', '.join(REWARD_KINDS)}")
    if not isinstance(k, (int, float)) or not np.isfinite(k) or k < 0:
        raise UserError(f"k={k!r} is invalid: must be a number >= 0")


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free logistic


def _messages(values, role: str, what: str) -> list[list[dict]]:
    """Strings or lists of {role, content} messages (TRL's conversational format) as message lists."""
    if isinstance(values, (str, dict)):
        raise UserError(f"{what} must be a list (one entry per text), got a single {type(values).__name__}")
    return [as_messages(v, role, source="score", column=what) for v in values]


class RewardModel:
    """A trained uncertainty-aware reward model (any of the four methods), as rebuilt from its run folder."""

    def __init__(self, method, run_dir: Path, config):
        self.method = method
        self.run_dir = run_dir
        self.config = config

    @property
    def name(self) -> str:
        return type(self.method).__name__

    @property
    def beta(self) -> float:
        return float(self.method.beta)

    def __repr__(self) -> str:
        return f"RewardModel({self.name} on {self.config.model.name}, beta={self.beta:g}, run={self.run_dir})"

    def _scores(self, prompts, completions) -> Scores:
        prompts, completions = _messages(prompts, "user", "prompts"), _messages(completions, "assistant",
                                                                                 "completions")
        if len(prompts) != len(completions):
            raise UserError(f"prompts and completions differ in length ({len(prompts)} vs {len(completions)})")
        if not prompts:
            return Scores(np.empty(0), np.empty(0), np.empty(0))
        return self.method.score(prompts, completions)

    def score(self, prompts, completions) -> pd.DataFrame:
        """One row per (prompt, completion): ``reward``, ``lower``, ``upper`` and ``uncertainty`` (u, with bounds
        reward +- beta u). Prompts and completions are strings or lists of chat messages."""
        s = self._scores(prompts, completions)
        return pd.DataFrame({"reward": s.reward, "lower": s.lower, "upper": s.upper,
                             "uncertainty": (s.upper - s.reward) / self.beta})

    def score_pairs(self, prompts, chosen, rejected) -> pd.DataFrame:
        """P(chosen > rejected) = sigmoid(r_c - r_r) per pair, with the interval the bounds give:
        [sigmoid(lower_c - upper_r), sigmoid(upper_c - lower_r)] (the bound probabilities of the paper's ELCE/EUCE)."""
        prompts = list(prompts)
        c = self.score(prompts, chosen)
        r = self.score(prompts, rejected)
        return pd.DataFrame({
            "p_chosen": _sigmoid((c.reward - r.reward).to_numpy()),
            "p_lower": _sigmoid((c.lower - r.upper).to_numpy()),
            "p_upper": _sigmoid((c.upper - r.lower).to_numpy()),
            "margin": (c.reward - r.reward).to_numpy(),
        })

    def reward(self, prompts, completions, kind: str = "conservative", k: float = 1.0) -> np.ndarray:
        """``conservative``: reward - k u; ``optimistic``: reward + k u; ``mean``: the reward itself."""
        check_reward_kind(kind, k)
        table = self.score(prompts, completions)
        sign = {"conservative": -1.0, "optimistic": 1.0, "mean": 0.0}[kind]
        return (table.reward + sign * k * table.uncertainty).to_numpy()

    def best_of_n(self, prompt, candidates, k: float = 1.0) -> dict:
        """The candidate with the highest conservative reward (reward - k u), with its score and interval: a sample
        the model is sure is good beats one it merely guesses is better."""
        candidates = list(candidates)
        if not candidates:
            raise UserError("best_of_n needs at least one candidate")
        table = self.score([prompt] * len(candidates), candidates)
        conservative = (table.reward - k * table.uncertainty).to_numpy()
        i = int(np.argmax(conservative))
        return {"index": i, "completion": candidates[i], "conservative_reward": float(conservative[i]),
                **{col: float(table[col].iloc[i]) for col in table.columns}, "table": table.assign(
                    conservative_reward=conservative)}

    def reward_function(self, kind: str = "conservative", k: float = 1.0) -> TRLRewardFunction:
        """A reward function for TRL's GRPOTrainer / RLOOTrainer (``reward_funcs=model.reward_function()``)."""
        check_reward_kind(kind, k)  # now, not at the first training step
        return TRLRewardFunction(self, kind, k)


class TRLRewardFunction:
    """``reward_func(prompts, completions, **kwargs) -> list[float]``, the callable form TRL's GRPO and RLOO trainers
    accept (TRL 1.16: called with prompts, completions, completion_ids and the dataset's extra columns; named after
    ``__name__`` in their logs). Works for the standard (strings) and the conversational (messages) format."""

    def __init__(self, model: RewardModel, kind: str, k: float):
        self.model, self.kind, self.k = model, kind, k
        self.__name__ = f"rewarduq_{kind}_reward"

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        return [float(v) for v in self.model.reward(prompts, completions, kind=self.kind, k=self.k)]


def load_run(path: str | os.PathLike, *, device: str = "auto", cache_dir: str | os.PathLike | None = None,
             progress: bool = True) -> RewardModel:
    """A completed run folder (``outputs/runs/<run>`` or a multirun job folder) as a :class:`RewardModel`.

    The method is rebuilt from the run's config and ``model/``; the backbone is loaded from the run's model config
    (hub id, ``model.path`` or the tiny builder). ``cache_dir`` (default: the run's ``paths.cache_dir``) holds
    downloaded or built models and, for ENS-MLP and BAY-LIN, the features of what is scored.
    """
    run = load_trained_method(path, device=device, cache_dir=cache_dir, progress=progress)
    return RewardModel(run.method, run.folder.root, run.config)
