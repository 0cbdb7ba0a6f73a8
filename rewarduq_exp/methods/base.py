"""The method contract (:class:`Method`, with :class:`RewardMethod` and :class:`LabelRankingMethod`), loading a
saved method (:func:`load_method`) and the shared machinery of frozen-backbone methods. A method's settings are a
dataclass (:mod:`rewarduq_exp.methods.settings`); the one training loop is :func:`~rewarduq_exp.methods.training.
run_training` and the pairwise loss :func:`~rewarduq_exp.methods.losses.bradley_terry_loss` (both importable from here
too).

A method is built by ``hydra.utils.instantiate`` from ``conf/method/<name>.yaml``. ``fit(...)`` returns the method,
``save(dir)`` / ``load(dir)`` store only what was trained plus the configuration needed to rebuild it (never the
frozen backbone), in formats that load without executing code; :func:`load_method` rebuilds a saved one from the
method's name in the method registry and its checked hyperparameters (a saved folder may come from anyone, so nothing
in it is imported or called), and a missing or damaged file is one line naming it. A reward model also offers
``score(prompts, completions) -> Scores`` with bounds ``reward ± beta * u`` (paper eq. 9); a label-ranking learner
``predict_distribution(X)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from rewarduq_exp.core import distributed, heap
from rewarduq_exp.core.atomic_write import atomic_path, write_atomic
from rewarduq_exp.core.errors import UserError, one_line
from rewarduq_exp.core.saved_files import load_safetensors, read_json_object
from rewarduq_exp.core.strict_json import dumps_json, nulls_to_nan
from rewarduq_exp.methods.losses import (  # noqa: F401  (importable from here too)
    bradley_terry_loss,
    bradley_terry_nll,
    weighted_mean,
)
from rewarduq_exp.methods.schedule import LR_SCHEDULES, TrainingSchedule  # noqa: F401  (importable from here too)
from rewarduq_exp.methods.settings import FeatureHeadSettings, LabelRankingSettings, MethodSettings
from rewarduq_exp.methods.training import cosine_schedule_with_warmup, run_training  # noqa: F401  (importable here)
from rewarduq_exp.models.backbone import resolve_device

log = logging.getLogger("rewarduq_exp")


@dataclass
class Scores:
    """Per-completion reward r and uncertainty u, with the method's bound width beta: the bounds are r -+ beta u
    (paper eq. 9), derived, never stored, so u is never rebuilt from them."""

    reward: np.ndarray
    u: np.ndarray
    beta: float = 1.0

    def __post_init__(self):
        self.reward, self.u = (np.asarray(a, dtype=np.float64) for a in (self.reward, self.u))
        self.beta = float(self.beta)
        if self.reward.shape != self.u.shape:
            raise ValueError(f"reward {self.reward.shape} and u {self.u.shape} differ in shape")

    @property
    def lower(self) -> np.ndarray:
        return self.reward - self.beta * self.u

    @property
    def upper(self) -> np.ndarray:
        return self.reward + self.beta * self.u

    def __len__(self) -> int:
        return len(self.reward)

    def __getitem__(self, index) -> Scores:
        """The scores of some rows (a slice, a mask or indices), with the same beta."""
        return Scores(self.reward[index], self.u[index], self.beta)




def write_method_info(directory: Path, method, **extra) -> None:
    """``method.json`` beside a saved method: what rebuilds it (class, hyperparameters) and what it was fit on."""
    # model_id: this saved model's identity, new at every save; a run's calibration.json names the model it was
    # fitted on by it, so that one copied from another run (or another model of this run) is refused.
    info = {"class": f"{type(method).__module__}.{type(method).__qualname__}", "method": method.name,
            "task": method.task, "model_id": uuid.uuid4().hex,
            "hyperparameters": method.hyperparameters(), "fit_summary": method.fit_summary, **extra}
    write_atomic(Path(directory) / "method.json", dumps_json(info, what=f"{directory}/method.json"))


def read_method_info(directory: Path, name: str | None = None) -> dict:
    """The ``method.json`` of a saved method (of method ``name`` when given), with one-line errors for a wrong or
    missing folder and for a corrupt file (not JSON, not an object)."""
    info_path = Path(directory) / "method.json"
    if not info_path.exists():
        raise UserError(f"no saved method in {directory} (method.json missing); is this a completed run folder?")
    info = read_json_object(info_path, "the saved method")
    if name is not None and info.get("method") != name:
        raise UserError(f"{directory} holds a {info.get('method')!r} model, not '{name}'")
    return info


def saved_size(info: dict, field: str, key: str, cap: int, directory) -> int | None:
    """The whole number ``info[field][key]`` of a ``method.json`` (a size the saved arrays are bounded by: feature
    dimension, training rows, labels), in 1..``cap``; None when it is not there (the caller falls back to ``cap``).
    Anything else is one line naming the file and the field."""
    block = info.get(field)
    value = block.get(key) if isinstance(block, dict) else None
    if value is None:
        return None
    if type(value) is not int or not 1 <= value <= cap:
        raise UserError(one_line(f"{Path(directory) / 'method.json'}: field \"{field}.{key}\" is {value!r}, not a "
                                 f"whole number in 1..{cap}; the run folder is damaged: copy it again or retrain"))
    return value


def feature_dim_bound(info: dict, directory):
    """(feature dimension or :class:`~rewarduq_exp.core.payload_bounds.AtMost` bound, where it comes from) of a
    saved frozen-backbone method: ``fit_summary.feature_dim`` of its ``method.json``, else at most
    :data:`~rewarduq_exp.core.payload_bounds.MAX_FEATURE_DIM`."""
    from rewarduq_exp.core.payload_bounds import MAX_FEATURE_DIM, AtMost

    d = saved_size(info, "fit_summary", "feature_dim", MAX_FEATURE_DIM, directory)
    if d is None:
        return AtMost(MAX_FEATURE_DIM), f"no feature_dim in method.json: at most {MAX_FEATURE_DIM}"
    return d, f"feature_dim={d} in method.json"


def constructor_settings(cls) -> set[str]:
    """The keyword arguments ``cls(...)`` accepts: the fields of its settings class (:attr:`Method.settings_class`),
    and ``encoder`` for a reward model (the backbone, which comes from the caller)."""
    return set(cls.settings_class.names()) | ({"encoder"} if issubclass(cls, RewardMethod) else set())


def load_method(directory: str | os.PathLike, *, encoder=None, **runtime) -> Method:
    """Rebuild a saved method from its ``method.json``: the class of the method it names (from this package's
    registry, :mod:`rewarduq_exp.methods.registry`; a class path in the file is never imported), with the
    hyperparameters it was trained with (each one checked: a setting of that method, a plain value) and the
    ``runtime`` settings of the caller (device, show_progress, ...), then ``load`` its trained parameters. A reward
    model's backbone comes in through ``encoder`` (built from the run's model config); a label-ranking learner needs
    none. Anything wrong with the file is one :class:`UserError` line naming it and the field."""
    directory = Path(directory)
    cls, name, settings = read_saved_method(directory)
    accepted = constructor_settings(cls)
    settings.update({k: v for k, v in runtime.items() if k in accepted})
    if "encoder" in accepted:
        settings["encoder"] = encoder
    try:
        method = cls(**settings)
    except (TypeError, ValueError) as err:  # UserError is a ValueError: a saved value the constructor refuses
        raise UserError(one_line(f"{directory / 'method.json'}: its hyperparameters do not build {name}: {err}")) \
            from None
    return method.load(directory)


def read_saved_method(directory: str | os.PathLike) -> tuple[type, str, dict]:
    """(class, method name, constructor settings) of the method saved in ``directory``, from its ``method.json``,
    checked without building anything: the class comes from the registry by the file's ``"method"`` name (a
    ``"class"`` that is not that method's class is refused), every hyperparameter must be a non-runtime setting of
    that class (or a value its ``hyperparameters()`` records) with a plain value."""
    from rewarduq_exp.methods.registry import (
        METHOD_CLASSES,
        allowed_classes,
        check_settings,
        method_class,
        method_name_of_target,
        method_names,
    )

    info_path = Path(directory) / "method.json"
    info = read_method_info(directory)
    name, recorded = info.get("method"), info.get("class")
    if recorded is not None and method_name_of_target(recorded) is None:
        raise UserError(one_line(f"{info_path}: field \"class\" names {recorded!r}, not a method of rewarduq_exp "
                                 f"(allowed: {allowed_classes()}); a run folder cannot import any other class"))
    if not isinstance(name, str) or name not in METHOD_CLASSES:
        raise UserError(one_line(f"{info_path}: field \"method\" names {name!r}, not a method of rewarduq_exp "
                                 f"(allowed: {', '.join(method_names())})"))
    if recorded is not None and recorded != METHOD_CLASSES[name]:
        raise UserError(f"{info_path}: field \"class\" names {recorded!r}, but field \"method\" says {name!r}, "
                        f"whose class is {METHOD_CLASSES[name]!r}; the file is inconsistent")
    settings = check_settings(name, info.get("hyperparameters", {}), str(info_path), "hyperparameters.",
                              records=True)
    return method_class(name), name, settings


class Method(ABC):
    """What every method offers the runner, ``evaluate.py`` and the Python API: the reward models, BoRP and the
    label-ranking learners alike.

    * It is built from ``conf/method/<name>.yaml`` with its hyperparameters, ``seed`` included: the fields of its
      settings dataclass (``settings_class``, :mod:`rewarduq_exp.methods.settings`: defaults from that YAML, each
      field checked, the runtime-only ones flagged). The constructor takes them as keywords and keeps the checked
      settings as ``self.settings``; to keep the methods' code short, each field is also copied onto the instance
      (``self.num_heads``; not where the class has a method of that name, such as BoRP's ``baselines()``), and a
      method replaces the copies it derives something from (``self.device``: the resolved device; a scoring batch
      of ``auto``: None).
    * ``fit(...)`` trains it and returns the method itself, with ``fit_summary`` (what the run reports) and
      ``history`` (the training log) filled in.
    * ``hyperparameters()`` is what rebuilds it (the settings that are not runtime-only, plus what :meth:`records`
      adds beside them); ``save(dir)`` writes them to ``method.json`` beside what was trained,
      in formats that load without executing code (safetensors, ``.npz`` read with ``allow_pickle=False``, JSON;
      scikit-learn estimators through skops with a fixed list of trusted types), and ``load(dir)`` reads it back into
      a constructed method. :func:`load_method` rebuilds one from the folder alone.
    * Where methods differ, they say so with flags (``task``, ``uses_feature_cache``, ...) instead of the callers
      testing their type.
    """

    name = "method"
    task = "preferences"            # what it trains on: preferences (pairs), pointwise (BoRP) or label_ranking
    settings_class: type[MethodSettings] = MethodSettings
    fit_summary: dict
    history: list

    def __init__(self, **values):
        self.settings = self.settings_class.build(values)
        for name in self.settings.names():
            if not callable(getattr(type(self), name, None)):   # BoRP's baselines() keeps its name
                setattr(self, name, getattr(self.settings, name))
        self.history: list[dict] = []
        self.fit_summary: dict = {}

    @abstractmethod
    def fit(self, *data) -> Method: ...

    def hyperparameters(self) -> dict:
        """The configuration that rebuilds this method (saved beside what it learned): its settings that are not
        runtime-only, and :meth:`records`."""
        return {**self.settings.saved(), **self.records()}

    def records(self) -> dict:
        """What ``method.json`` records beside the settings (never passed back to the constructor): values derived
        from them, such as the schedule's ``lr_schedule`` or the head initialisation a run used."""
        return {}

    @abstractmethod
    def save(self, directory: str | os.PathLike) -> None: ...

    @abstractmethod
    def load(self, directory: str | os.PathLike) -> Method: ...

    @classmethod
    def has_memory_model(cls) -> bool:
        """Whether ``plan=true`` (and the Slurm launcher's memory check) can plan a run of this method."""
        return False


class RewardMethod(Method):
    """An uncertainty-aware reward model. It is constructed with its hyperparameters and ``encoder=`` (a
    :class:`FeatureEncoder`: the backbone with its feature cache), then offers ``fit(train, eval=None) -> self``,
    ``score(prompts, completions) -> Scores`` (bounds reward +- beta * u, eq. 9) and
    ``score_pairs(frame) -> (chosen, rejected)``."""

    beta: float = 1.0               # bound width in units of u (eq. 9); set by each method
    uses_feature_cache = False      # reads frozen-backbone features through the shared cache (ENS-MLP, BAY-LIN);
    #                                 otherwise it runs the backbone itself, per row (ENS-LoRA, MCD-DPO)
    fine_tunes_backbone = False     # trains (adapters of) the backbone, not only a head on its features
    uses_eval_set = False           # fit(train, eval) reads eval (the runner passes the first pairwise eval set)

    def __init__(self, encoder=None, **values):
        self.encoder = encoder
        super().__init__(**values)

    @abstractmethod
    def fit(self, train: pd.DataFrame, eval: pd.DataFrame | None = None) -> RewardMethod: ...  # noqa: A002

    @abstractmethod
    def score(self, prompts, completions) -> Scores: ...

    @abstractmethod
    def score_pairs(self, frame: pd.DataFrame) -> tuple[Scores, Scores]: ...

    @classmethod
    def plan_memory(cls, ctx):
        """The method's memory model: the :class:`~rewarduq_exp.models.memory_plan.Plan` of a run of it described by
        ``ctx`` (a :class:`~rewarduq_exp.models.memory_plan.PlanContext`: the composed config with the method's
        settings, the backbone's shapes, the device, the data sizes), computed with the same formulas the method
        sizes its own batches with. None: the method has no memory model, and ``plan=true`` says so."""
        return None

    @classmethod
    def has_memory_model(cls) -> bool:
        return cls.plan_memory.__func__ is not RewardMethod.plan_memory.__func__


class LabelRankingMethod(Method):
    """A label-ranking learner (calibrated-label-ranking paper): ``fit(X, ranks) -> self`` on features X (n, d) and
    ranks per item (n, m, 1 = best); ``predict_distribution(X)`` gives, per sample, a ranking distribution that
    answers the marginals the ranking metrics need from the model's own structure.

    ``save`` writes ``method.json`` (class, hyperparameters, fit summary and the fitted scalars of
    :meth:`fitted_values`) and ``state.safetensors`` (the fitted arrays of :meth:`fitted_arrays`); learners with more
    (RPC's trees) add their own file."""

    task = "label_ranking"
    settings_class = LabelRankingSettings

    def __init__(self, **values):
        super().__init__(**values)
        self.m: int | None = None

    @abstractmethod
    def fit(self, X, ranks) -> LabelRankingMethod: ...

    @abstractmethod
    def predict_distribution(self, X): ...

    def predict_ranks(self, X) -> np.ndarray:
        return self.predict_distribution(X).mode_ranks()

    def _require_fit(self):
        if self.m is None:
            raise RuntimeError(f"{type(self).__name__} is not fitted: call fit(X, ranks) first")

    # ------------------------------------------------------------------ persistence hooks
    def fitted_arrays(self) -> dict[str, np.ndarray]:
        """The fitted arrays (network weights, centers, classes), saved as safetensors."""
        return {}

    def fitted_values(self) -> dict:
        """The fitted scalars (m, theta, temperature, ...), saved as JSON in method.json."""
        return {"m": self.m}

    def load_fitted(self, arrays: dict[str, np.ndarray], values: dict) -> None:
        self.m = int(values["m"])

    def expected_arrays(self, info: dict, directory) -> dict | None:
        """{array: :class:`~rewarduq_exp.core.payload_bounds.Expected`} of the saved ``state.safetensors``, from the
        hyperparameters and the fitted sizes in ``info`` (method.json); None: structural checks only."""
        return None

    def saved_labels(self, info: dict, directory) -> int:
        """The number of labels ``fitted.m`` of a saved learner (at most
        :data:`~rewarduq_exp.core.payload_bounds.MAX_LABELS`)."""
        from rewarduq_exp.core.payload_bounds import MAX_LABELS

        m = saved_size(info, "fitted", "m", MAX_LABELS, directory)
        if m is None:
            raise UserError(f"{Path(directory) / 'method.json'}: field \"fitted.m\" is missing; the run folder is "
                            "damaged: copy it again or retrain")
        return m

    def save(self, directory: str | os.PathLike) -> None:
        from safetensors.numpy import save_file

        self._require_fit()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_path(directory / "state.safetensors") as tmp:
            save_file({k: np.ascontiguousarray(v) for k, v in self.fitted_arrays().items()}, str(tmp))
        write_method_info(directory, self, fitted=self.fitted_values())

    def load(self, directory: str | os.PathLike) -> LabelRankingMethod:
        directory = Path(directory)
        info = read_method_info(directory, self.name)
        path = directory / "state.safetensors"
        fitted = info.get("fitted", {})
        fitted = nulls_to_nan(fitted) if isinstance(fitted, dict) else {}  # null: a NaN/inf scalar, written strictly
        # A missing or cut-short file is one line naming it; the arrays' declared shapes are checked against the
        # learner's settings and fitted sizes before any is read.
        arrays = load_safetensors(path, framework="np", expected=self.expected_arrays(info, directory))
        try:
            self.load_fitted(arrays, fitted)
        except (KeyError, TypeError, ValueError) as err:  # a tensor or fitted value missing or of the wrong kind
            raise UserError(one_line(f"{path} and {directory / 'method.json'} (field \"fitted\") do not hold a "
                                     f"fitted {self.name} ({type(err).__name__}: {err}); the run folder is "
                                     "damaged: copy it again or retrain")) from None
        self.fit_summary = info.get("fit_summary", {})
        return self


class FeatureHeadMethod(RewardMethod):
    """A head trained on frozen backbone features read through the shared :class:`FeatureEncoder`. Its settings
    subclass :class:`~rewarduq_exp.methods.settings.FeatureHeadSettings` and hold the fields of its training schedule
    (``learning_rate`` at least; :class:`~rewarduq_exp.methods.settings.AdamWSettings` has them all)."""

    name = "feature_head"
    uses_feature_cache = True
    uses_eval_set = True            # reports the eval set's Bradley-Terry loss and win rate in the fit summary

    settings_class = FeatureHeadSettings

    def __init__(self, encoder=None, **values):
        super().__init__(encoder, **values)
        self.device = resolve_device(self.settings.device)
        self.show_progress = self.settings.show_progress and not os.environ.get("TQDM_DISABLE")
        # every head trains by run_training: its schedule from the settings' learning_rate, batch_size, ...
        self.schedule = TrainingSchedule.of(self.settings)

    def records(self) -> dict:
        return {"lr_schedule": self.schedule.lr_schedule}

    # ------------------------------------------------------------------ subclass hooks
    @abstractmethod
    def _build(self, feature_dim: int) -> None:
        """Create the trainable parts for features of size ``feature_dim``."""

    @abstractmethod
    def _fit_features(self, zc: torch.Tensor, zr: torch.Tensor, weight: torch.Tensor) -> None: ...

    @abstractmethod
    def _score_features(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(reward, u) for features ``z`` (B, d); bounds are reward ± beta * u."""

    @abstractmethod
    def state_tensors(self) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None: ...

    @classmethod
    def head_memory(cls, ctx, feature_dim: int, batch: int):
        """What the head holds in training beside the train features
        (:class:`~rewarduq_exp.models.memory_plan.HeadMemory`) for features of ``feature_dim`` and minibatches of
        ``batch`` pairs, with the settings ``ctx.method``; None: no memory model."""
        return None

    @classmethod
    def plan_memory(cls, ctx):
        """Extraction and the features on the device as every feature-cache head has them, plus :meth:`head_memory`
        (:func:`~rewarduq_exp.models.memory_plan.feature_head_plan`)."""
        from rewarduq_exp.models.memory_plan import feature_head_plan

        head = cls.head_memory(ctx, ctx.arch.hidden, min(int(ctx.method.batch_size), ctx.n_train))
        return None if head is None else feature_head_plan(ctx, head)

    @classmethod
    def has_memory_model(cls) -> bool:
        return cls.head_memory.__func__ is not FeatureHeadMethod.head_memory.__func__

    def expected_state(self, feature_dim, why: str) -> dict | None:
        """{tensor: :class:`~rewarduq_exp.core.payload_bounds.Expected`} of :meth:`state_tensors` for features of
        ``feature_dim`` (an int, or an ``AtMost`` bound) and these hyperparameters; ``why`` says where the feature
        dimension comes from. None: structural checks only."""
        return None

    # ------------------------------------------------------------------ contract
    def _require_encoder(self):
        if self.encoder is None:
            raise RuntimeError(f"{type(self).__name__} needs a feature encoder (pass encoder=...)")
        return self.encoder

    def fit(self, train: pd.DataFrame, eval: pd.DataFrame | None = None) -> FeatureHeadMethod:  # noqa: A002
        encoder = self._require_encoder()
        t0 = time.perf_counter()
        zc, zr = encoder.encode_pairs(train, desc="features (train)")
        t_features = time.perf_counter() - t0
        self._build(zc.shape[1])
        weight = torch.tensor(train["weight"].to_numpy(dtype=np.float32))
        t1 = time.perf_counter()
        if distributed.is_main():
            # every step frees and allocates the same blocks: on a CPU, keep them (core/heap.py: a fifth of an epoch)
            keep = heap.keeping_freed_memory() if torch.device(self.device).type == "cpu" else contextlib.nullcontext()
            with torch.random.fork_rng(devices=[]), keep:
                torch.manual_seed(self.seed)
                self._fit_features(zc.to(self.device), zr.to(self.device), weight.to(self.device))
        if distributed.world_size() > 1:
            # The head fit takes seconds on cached features: rank 0 does it (exactly the one-process fit) and the
            # others take its result rather than repeating it.
            state, self.history = distributed.broadcast_from_main(
                ({k: v.detach().cpu() for k, v in self.state_tensors().items()} if distributed.is_main() else None,
                 self.history))
            if not distributed.is_main():
                self.load_state_tensors({k: v.to(self.device) for k, v in state.items()})
        self.fit_summary = {"train_pairs": len(train), "feature_dim": int(zc.shape[1]),
                            "seconds_features": t_features, "seconds_training": time.perf_counter() - t1}
        if self.history:
            self.fit_summary["final_train_loss"] = self.history[-1]["loss"]
        if eval is not None:
            ec, er = encoder.encode_pairs(eval, desc="features (eval)")
            m = torch.as_tensor(self.score_features(ec).reward - self.score_features(er).reward)
            self.fit_summary["eval_bt_loss"] = float(bradley_terry_nll(m).mean())
            self.fit_summary["eval_win_rate"] = float((m > 0).double().mean())
        return self

    @torch.no_grad()
    def score_features(self, z: torch.Tensor) -> Scores:
        rewards, us = [], []
        for i in range(0, len(z), self.score_batch_size):
            r, u = self._score_features(z[i:i + self.score_batch_size].to(self.device))
            rewards.append(r.double().cpu())
            us.append(u.double().cpu())
        reward, u = torch.cat(rewards).numpy(), torch.cat(us).numpy()
        return Scores(reward=reward, u=u, beta=self.beta)

    def score(self, prompts, completions) -> Scores:
        return self.score_features(self._require_encoder().encode(prompts, completions, desc="features (score)"))

    def _sample_features(self, z: torch.Tensor) -> torch.Tensor | None:
        """(S, B) rewards of features ``z`` under S draws of the model (ensemble members, posterior samples), the
        same S draws for every row; None where the method has no such draws."""
        return None

    @torch.no_grad()
    def pair_reward_samples(self, frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray] | None:
        """(S, n) rewards of the chosen and the rejected completions under the same S draws of the model, so that
        ``chosen[s] - rejected[s]`` are samples of each pair's margin (what disagreement-based acquisition such as
        BALD needs); None where the method has no draws."""
        zc, zr = self._require_encoder().encode_pairs(frame, desc="features (score)")
        if self._sample_features(zc[:1].to(self.device)) is None:
            return None
        return (self._sample_features(zc.to(self.device)).double().cpu().numpy(),
                self._sample_features(zr.to(self.device)).double().cpu().numpy())

    def score_pairs(self, frame: pd.DataFrame) -> tuple[Scores, Scores]:
        """Chosen and rejected scores of a preference frame (one feature-cache entry for both)."""
        zc, zr = self._require_encoder().encode_pairs(frame, desc="features (score)")
        return self.score_features(zc), self.score_features(zr)

    def save(self, directory: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_path(directory / "state.safetensors") as tmp:
            save_file({k: v.detach().cpu().contiguous() for k, v in self.state_tensors().items()}, str(tmp))
        extra = {}
        if self.encoder is not None:
            extra = {"backbone": self.encoder.backbone.identity(), "probe": self.encoder.probe_identity()}
        write_method_info(directory, self, **extra)

    def load(self, directory: str | os.PathLike) -> FeatureHeadMethod:
        directory = Path(directory)
        info = read_method_info(directory, self.name)
        path = directory / "state.safetensors"
        # A missing or cut-short file is one line naming it, not a SafetensorError; the tensors' declared shapes are
        # checked against the hyperparameters and the feature dimension before any is read.
        d, why = feature_dim_bound(info, directory)
        tensors = load_safetensors(path, expected=self.expected_state(d, why))
        try:
            self.load_state_tensors({k: v.to(self.device) for k, v in tensors.items()})
        except (KeyError, RuntimeError, ValueError) as err:  # a tensor missing or of another shape
            raise UserError(one_line(f"{path} does not hold the weights of a {self.name} model with these "
                                     f"hyperparameters ({type(err).__name__}: {str(err)[:200]}); the run folder "
                                     "is damaged: copy it again or retrain")) from None
        self.fit_summary = info.get("fit_summary", {})
        return self

    # ------------------------------------------------------------------ training loop
    def _train_loop(self, params, loss_fn, n: int, schedule: TrainingSchedule, desc: str) -> None:
        """Minibatch AdamW over ``n`` pairs; ``loss_fn(index) -> (loss, parts)`` computes one batch's loss.

        Gradients are clipped to a total norm of ``schedule.max_grad_norm`` over ALL ``params`` (as the Hugging Face
        Trainer the authors used does: for ENS-MLP that is the norm over the K heads together, which the authors
        trained as one model); ``grad_norm`` (before clipping) is logged like the Trainer logs it.
        """

        def step(index: torch.Tensor) -> dict:
            loss, parts = loss_fn(index.to(self.device))
            loss.backward()
            return {"loss": loss.detach(), **parts}

        run_training(params, n, schedule, step, seed=self.seed, desc=desc, history=self.history,
                     show_progress=self.show_progress, log_every=self.log_every)
