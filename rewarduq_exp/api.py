"""Use a trained run from Python: score text with uncertainty, compare pairs, pick the best of n, reward an RL policy.

    import rewarduq_exp as r
    model = r.load_run("outputs/runs/<run>")
    model.score(["What is 2+2?"], ["4"])              # reward, lower, upper, uncertainty per completion
    model.score_pairs(prompts, chosen, rejected)      # P(chosen > rejected) with its interval

Every method gives bounds ``reward +- beta * u`` (paper eq. 9); ``uncertainty`` is that u (the ensemble's std, the
Laplace posterior's sqrt(z^T H^-1 z), the spread over dropout masks), recovered as (upper - reward) / beta. The
conservative reward ``reward - k u`` and the optimistic ``reward + k u`` are the usual ways to use it: rank or filter
by what the model is sure of, or explore where it is not. ``k`` is in units of u, so ``k = beta`` gives exactly the
lower (upper) bound.

Scoring is local to the calling process: under torchrun / accelerate (TRL's GRPO on several GPUs) each process scores
its own texts and never waits for the others. Features of scored texts stay in a bounded in-memory store (an RL loop
running for days writes nothing to disk); a completion's score depends on that completion alone (MC-dropout masks
are seeded per sequence), never on the rest of the batch.
"""

from __future__ import annotations

import numbers
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass

import numpy as np
import pandas as pd

from rewarduq_exp.core.checks import check_positive
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.contract import as_messages, joined_passes, render, render_all, rendering_pass, token_lengths
from rewarduq_exp.methods.base import Scores
from rewarduq_exp.models.memory_features import MemoryFeatures
from rewarduq_exp.runner.trained_run import load_trained_method

REWARD_KINDS = ("conservative", "optimistic", "mean")
SIGN = {"conservative": -1.0, "optimistic": 1.0, "mean": 0.0}


def check_reward_kind(kind: str, k) -> float:
    """``k`` as a float (numpy scalars are fine, booleans are not) once ``kind`` and ``k`` are valid."""
    if kind not in REWARD_KINDS:
        raise UserError(f"kind={kind!r} is invalid: allowed values are {', '.join(REWARD_KINDS)}")
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, numbers.Real) or not np.isfinite(k) or k < 0:
        raise UserError(f"k={k!r} is invalid: must be a number >= 0 (in units of the uncertainty u)")
    return float(k)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free logistic


def _check_raw(raw) -> None:
    if not isinstance(raw, (bool, np.bool_)):
        raise UserError(f"raw={raw!r} is invalid: must be True (the model's own scores) or False (recalibrated)")


def _is_one_conversation(value) -> bool:
    """A single prompt or completion: a string or one list of {role, content} messages."""
    return isinstance(value, str) or (isinstance(value, (list, tuple)) and len(value) > 0
                                      and all(isinstance(m, dict) for m in value))


def _messages(values, role: str, what: str) -> list[list[dict]]:
    """Strings or lists of {role, content} messages (TRL's conversational format) as message lists."""
    if values is None or isinstance(values, (str, dict)):
        got = "None" if values is None else f"a single {type(values).__name__}"
        raise UserError(f"{what} must be a list with one entry per text (strings or lists of chat messages), "
                        f"got {got}")
    out = [as_messages(v, role, source="score", column=what) for v in values]
    for i, messages in enumerate(out):
        for message in messages:
            _check_text(message["content"], f"{what}[{i}]")
    return out


def _check_text(text: str, where: str) -> None:
    """Text the tokenizer can take: valid Unicode, i.e. encodable as UTF-8. A lone surrogate ('\\ud800', from a JSON
    escape or bytes decoded with errors='surrogateescape') is not: one line naming the text, not a tokenizer's
    traceback."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UserError(f"{where} holds {text[err.start]!r} at character {err.start}, a lone surrogate, which is not "
                        "text: prompts and completions must be valid Unicode (encodable as UTF-8); replace it, e.g. "
                        "text.encode('utf-8', 'replace').decode()") from None


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _path_argument(name: str, value, what: str, optional: bool = False) -> str | None:
    """``value`` as a file-system path (a str), or a one-line :class:`UserError` naming the argument ``name`` and
    what is allowed: a str or an os.PathLike (pathlib.Path), ``None`` too when ``optional``."""
    if value is None and optional:
        return None
    allowed = f"{what} as a str or an os.PathLike (e.g. pathlib.Path){', or None' if optional else ''}"
    if not isinstance(value, (str, os.PathLike)):
        hint = " (decode it first: os.fsdecode(...))" if isinstance(value, (bytes, bytearray)) else ""
        raise UserError(f"{name}={_shown(value)} is invalid: must be {allowed}, got {type(value).__name__}{hint}")
    text = os.fspath(value)
    if not isinstance(text, str):
        raise UserError(f"{name}={_shown(value)} is invalid: must be {allowed}; its os.fspath() is "
                        f"{type(text).__name__} (decode it first: os.fsdecode(...))")
    if not text:
        raise UserError(f"{name}='' is invalid: must be {allowed}, not empty")
    if "\0" in text:
        raise UserError(f"{name}={_shown(text)} is invalid: a path cannot hold a NUL character")
    try:
        os.fsencode(text)
    except UnicodeEncodeError as err:
        raise UserError(f"{name}={_shown(text)} is invalid: {text[err.start]!r} at character {err.start} cannot be "
                        "part of a file name on this system") from None
    return text


def _cache_folder(cache_dir) -> tuple[str, str | None]:
    """(the folder models are built or downloaded into, the temporary folder to remove afterwards or None): see
    :func:`load_run`'s ``cache_dir``."""
    path = _path_argument("cache_dir", cache_dir, "a folder", optional=True)
    if path is None:
        temporary = tempfile.mkdtemp(prefix="rewarduq-load-run-")
        return temporary, temporary
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"cache_dir={path} is not a folder: pass a folder to keep downloaded or built models in "
                        "(created when missing), or leave cache_dir out (a temporary folder, removed afterwards)")
    return path, None


def fit_to_length(tokenizer, prompts: list, completions: list, max_length: int, truncate: bool) -> list:
    """The completions, with those whose conversation renders to more than ``max_length`` tokens cut at the end of
    their last message's text (``truncate``) or refused in one line. The chat template's closing tokens stay: the
    model scores a complete, shorter turn, as it saw them in training."""
    lengths = token_lengths(tokenizer, render_all(tokenizer, prompts, completions))
    over = np.flatnonzero(lengths > max_length)
    if len(over) and not truncate:
        raise UserError(f"{len(over)} of {len(prompts)} conversations render to more than max_length={max_length} "
                        f"tokens (longest {int(lengths.max())}); pass load_run(..., truncation=True) to cut the "
                        "completions or a larger max_length")
    completions = list(completions)
    for i in over:  # only the over-long rows: re-rendering is per row
        messages = [dict(m) for m in completions[i]]
        ids = tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        excess = int(lengths[i]) - max_length
        while excess > 0:
            keep = len(ids) - excess
            if keep < 0:
                raise UserError(f"conversation {i}: its prompt and template alone exceed max_length={max_length} "
                                "tokens; truncation cuts completions only, so shorten the prompt or raise max_length")
            ids = ids[:keep]
            messages[-1]["content"] = tokenizer.decode(ids)
            # Decoding and re-encoding can merge tokens differently at the cut: measure again.
            excess = int(token_lengths(tokenizer, [render(tokenizer, prompts[i], messages)])[0]) - max_length
        completions[i] = messages
    return completions


@dataclass
class PreparedTexts:
    """Conversations ready for the model (:meth:`RewardModel.prepare`): message lists fitted to its length, and
    what the rendering pass that fitted them remembers (their rendered texts and token ids)."""

    prompts: list
    completions: list
    remembered: dict

    def __len__(self) -> int:
        return len(self.prompts)

    def rows(self, start: int, stop: int) -> PreparedTexts:
        return PreparedTexts(self.prompts[start:stop], self.completions[start:stop], self.remembered)


class RewardModel:
    """A trained uncertainty-aware reward model (any of the four methods), as rebuilt from its run folder."""

    def __init__(self, method, run_dir, config, tokenizer=None, max_length: int | None = None,
                 truncation: bool = False, calibration=None):
        self.method = method
        # The run's recalibration (calibration.json), applied to every score unless raw=True; None: raw only.
        self.calibration = calibration
        self.run_dir = run_dir
        self.config = config
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.truncation = truncation

    @property
    def name(self) -> str:
        return type(self.method).__name__

    @property
    def beta(self) -> float:
        return float(self.method.beta)

    @property
    def recalibrated(self) -> bool:
        """Whether scores are recalibrated by default (the run has a calibration.json and it was not turned off)."""
        return self.calibration is not None

    def __repr__(self) -> str:
        state = "recalibrated" if self.recalibrated else "raw"
        return (f"RewardModel({self.name} on {self.config.model.name}, beta={self.beta:g}, {state}, "
                f"run={self.run_dir})")

    def prepare(self, prompts, completions) -> PreparedTexts:
        """The conversations checked and fitted to the model's length (``truncation``), with what that rendered and
        tokenised: :meth:`score_prepared` scores them without rendering them again. A server prepares each request
        as it arrives, while the model is busy with others."""
        prompts, completions = _messages(prompts, "user", "prompts"), _messages(completions, "assistant",
                                                                                 "completions")
        if len(prompts) != len(completions):
            raise UserError(f"prompts and completions differ in length ({len(prompts)} vs {len(completions)})")
        with rendering_pass() as remembered:
            if prompts and self.tokenizer is not None and self.max_length:
                completions = fit_to_length(self.tokenizer, prompts, completions, self.max_length, self.truncation)
        return PreparedTexts(prompts, completions, remembered)

    def score_prepared(self, parts, raw: bool = False) -> Scores:
        """Scores of prepared texts (:meth:`prepare`; several in one call of the model, in order)."""
        _check_raw(raw)
        prompts = [p for part in parts for p in part.prompts]
        completions = [c for part in parts for c in part.completions]
        if not prompts:
            return Scores(np.empty(0), np.empty(0), self.beta)
        with rendering_pass(joined_passes(part.remembered for part in parts)):   # nothing rendered twice
            scores = self.method.score(prompts, completions)
        return scores if raw or self.calibration is None else self.calibration.apply(scores)

    def _scores(self, prompts, completions, raw: bool = False) -> Scores:
        return self.score_prepared([self.prepare(prompts, completions)], raw)

    def score(self, prompts, completions, raw: bool = False) -> pd.DataFrame:
        """One row per (prompt, completion): ``reward``, ``lower``, ``upper`` and ``uncertainty`` (u, with bounds
        reward +- beta u). Prompts and completions are strings, lists of chat messages, or messages whose content is
        a list of ``{"type": "text", "text": ...}`` parts (OpenAI style).

        Recalibrated when the run has a ``calibration.json`` (reward / T, bounds reward / T +- beta s u / T: the
        temperature and interval scale fitted on its calibration split; orderings, hence best-of-n picks by reward,
        are unchanged); ``raw=True`` gives the model's own scores."""
        s = self._scores(prompts, completions, raw)
        return pd.DataFrame({"reward": s.reward, "lower": s.lower, "upper": s.upper, "uncertainty": s.u})

    def score_pairs(self, prompts, chosen, rejected, raw: bool = False) -> pd.DataFrame:
        """P(chosen > rejected) = sigmoid(r_c - r_r) per pair, with the interval the bounds give:
        [sigmoid(lower_c - upper_r), sigmoid(upper_c - lower_r)] (the bound probabilities of the paper's ELCE/EUCE).
        Recalibrated scores (see :meth:`score`) give the temperature-scaled probabilities, mapped once more by the
        run's isotonic map where its calibration split supported one; ``raw=True``: the model's own."""
        prompts = _messages(prompts, "user", "prompts")
        c = self.score(prompts, chosen, raw)
        r = self.score(prompts, rejected, raw)
        mapped = (lambda p: p) if raw or self.calibration is None else self.calibration.probability
        return pd.DataFrame({
            "p_chosen": mapped(_sigmoid((c.reward - r.reward).to_numpy())),
            "p_lower": mapped(_sigmoid((c.lower - r.upper).to_numpy())),
            "p_upper": mapped(_sigmoid((c.upper - r.lower).to_numpy())),
            "margin": (c.reward - r.reward).to_numpy(),
        })

    def reward(self, prompts, completions, kind: str = "conservative", k: float = 1.0,
               raw: bool = False) -> np.ndarray:
        """``conservative``: reward - k u; ``optimistic``: reward + k u; ``mean``: the reward itself. ``k`` is in units
        of u: ``k = beta`` gives the lower (upper) bound of the run's intervals (recalibrated ones unless ``raw``)."""
        k = check_reward_kind(kind, k)
        table = self.score(prompts, completions, raw)
        return (table.reward + SIGN[kind] * k * table.uncertainty).to_numpy()

    def best_of_n(self, prompts, candidates, k: float = 1.0, kind: str = "conservative", raw: bool = False):
        """The candidate with the highest ``kind`` reward (default conservative: reward - k u, a sample the model is
        sure is good beats one it merely guesses is better), with its score and interval.

        One prompt (a string or a list of messages) and its candidates give one dict; a list of prompts and a list
        of candidate lists (``best_of_n(prompts, candidates_per_prompt)``, any number per prompt) give one dict per
        prompt, all candidates scored in one batched call. Recalibrated scores (unless ``raw``): reward / T - k s u / T
        ranks as reward - k s u, so k = 1 uses the interval scale s fitted on the run's calibration split."""
        k = check_reward_kind(kind, k)
        if _is_one_conversation(prompts):
            return self._best_of_n_batch([prompts], [candidates], k, kind, raw)[0]
        if prompts is None or isinstance(prompts, dict):
            raise UserError("best_of_n needs a prompt (a string or a list of messages) or a list of prompts")
        prompts, candidates = list(prompts), list(candidates)
        if len(prompts) != len(candidates):
            raise UserError(f"best_of_n: {len(prompts)} prompts but {len(candidates)} candidate lists (one list of "
                            "candidates per prompt)")
        return self._best_of_n_batch(prompts, candidates, k, kind, raw)

    def _best_of_n_batch(self, prompts: list, candidates: list, k: float, kind: str, raw: bool = False) -> list[dict]:
        groups = []
        for i, group in enumerate(candidates):
            if _is_one_conversation(group) or group is None:
                raise UserError(f"best_of_n: the candidates of prompt {i} must be a list of completions")
            group = list(group)
            if not group:
                raise UserError(f"best_of_n needs at least one candidate (prompt {i} has none)")
            groups.append(group)
        sizes = np.array([len(g) for g in groups])
        flat_prompts = [p for p, n in zip(prompts, sizes) for _ in range(n)]
        table = self.score(flat_prompts, [c for g in groups for c in g], raw)
        value = (table.reward + SIGN[kind] * k * table.uncertainty).to_numpy()
        out, start = [], 0
        for group, n in zip(groups, sizes):
            chosen_by = value[start:start + n]
            part = table.iloc[start:start + n].reset_index(drop=True).assign(**{f"{kind}_reward": chosen_by})
            i = int(np.argmax(chosen_by))
            out.append({"index": i, "completion": group[i], f"{kind}_reward": float(chosen_by[i]),
                        **{col: float(part[col].iloc[i]) for col in table.columns}, "table": part})
            start += n
        return out

    def reward_function(self, kind: str = "conservative", k: float = 1.0) -> TRLRewardFunction:
        """A reward function for TRL's GRPOTrainer / RLOOTrainer (``reward_funcs=model.reward_function()``)."""
        return TRLRewardFunction(self, kind, check_reward_kind(kind, k))  # checked now, not at the first step


class TRLRewardFunction:
    """``reward_func(prompts, completions, **kwargs) -> list[float]``, the callable form TRL's GRPO and RLOO trainers
    accept (TRL 1.16: called with prompts, completions, completion_ids and the dataset's extra columns; named after
    ``__name__`` in their logs). Works for the standard (strings) and the conversational (messages) format."""

    def __init__(self, model: RewardModel, kind: str, k: float):
        self.model, self.kind, self.k = model, kind, k
        self.__name__ = f"rewarduq_{kind}_reward"

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        return [float(v) for v in self.model.reward(prompts, completions, kind=self.kind, k=self.k)]


def load_run(path: str | os.PathLike, *, device: str = "auto", dtype: str | None = None,
             batch_size: int | None = None, max_length: int | None = None, truncation: bool = False,
             backbone_path: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None,
             feature_memory_mb: float = 256, progress: bool = True, trust_remote_code: bool = False,
             recalibrated: bool = True) -> RewardModel:
    """A completed run folder (``outputs/runs/<run>`` or a multirun job folder) as a :class:`RewardModel`.

    The method is rebuilt from the run's config and ``model/``; the backbone is loaded from the run's model config
    (hub id, ``model.path`` or the tiny builder), or from ``backbone_path`` when the checkpoint has moved.

    * ``device``: auto, cpu, cuda or cuda:N; ``dtype``: float32, bfloat16 or float16 (default: the run's).
    * ``batch_size``: sequences per forward pass when scoring (default: the run's).
    * ``max_length``: the longest conversation in tokens (default: the run's ``max_length``). A longer one is an
      error, unless ``truncation=True``: then its completion is cut to fit (an RL policy's runaway sample must not
      abort the training step).
    * ``cache_dir``: the folder that keeps models this package builds or converts (the tiny test model, a GGUF file
      dequantised), created when missing. Without it nothing is kept: they go into a temporary folder, removed when
      the model's backbone is no longer used (at the latest when Python exits). Never the run's own
      ``paths.cache_dir``: a run folder names a path of another machine or user, and reading a run writes nothing
      there (``evaluate.py`` likewise uses its own ``paths.cache_dir``). Hub models are downloaded into the
      Hugging Face cache (``HF_HOME``), as by ``from_pretrained``. Features of scored texts are kept in memory, at most
      ``feature_memory_mb`` (least recently used rows leave first), never on disk.
    * A wrong argument (``path`` not a str or os.PathLike, ``cache_dir`` a file, ...) is one :class:`UserError` line
      naming it and what is allowed.
    * ``recalibrated``: apply the run's ``calibration.json`` (fitted on its calibration split after training) to every
      score by default; each scoring call takes ``raw=True`` for the model's own scores. A run without one (trained
      before recalibration existed, or with ``recalibrate.enabled=false``) scores raw, and one log line says so.
    * ``trust_remote_code``: a run whose model config says ``trust_remote_code: true`` is refused (one line) unless
      this is True: its backbone checkpoint would run code of its own, and a run folder is a file anyone can edit.
      The run folder itself never runs code: its method and dataset come from this package's registries.
    """
    path = _path_argument("path", path, "a run folder")
    if not isinstance(recalibrated, bool):
        raise UserError(f"recalibrated={recalibrated!r} is invalid: must be True or False")
    backbone_path = _path_argument("backbone_path", backbone_path, "a checkpoint folder", optional=True)
    if not isinstance(truncation, bool):
        raise UserError(f"truncation={truncation!r} is invalid: must be True or False")
    if max_length is not None:
        check_positive(max_length, "max_length", integer=True)
    check_positive(feature_memory_mb, "feature_memory_mb", inclusive=True)
    cache_dir, temporary = _cache_folder(cache_dir)
    try:
        run = load_trained_method(path, device=device, cache_dir=cache_dir, progress=progress,
                                  max_length=max_length, dtype=dtype, batch_size=batch_size,
                                  backbone_path=backbone_path,
                                  feature_store=MemoryFeatures(int(feature_memory_mb * 2**20)),
                                  trust_remote_code=trust_remote_code)
    except BaseException:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    if temporary is not None:  # the backbone reads its files lazily: removed once nothing uses it (or at exit)
        weakref.finalize(run.backbone, shutil.rmtree, temporary, True)
    limit = int(max_length or run.config.max_length)
    from rewarduq_exp.recalibration import read_calibration

    calibration = read_calibration(run.folder.root) if recalibrated else None
    return RewardModel(run.method, run.folder.root, run.config, tokenizer=run.backbone.tokenizer, max_length=limit,
                       truncation=truncation, calibration=calibration)
