"""A method's settings: one dataclass per method (:class:`MethodSettings`), its defaults, types and checks.

Each method class names its settings (``settings_class = EnsMLPSettings``); its constructor takes the settings as
keywords, builds the dataclass (every field checked, one line naming the setting when one is wrong; an unknown
setting is one line naming it and the allowed ones) and keeps it as ``method.settings``.

**Defaults are written once, in the method's config** ``conf/method/<name>.yaml``. That file is what users read (it is
commented), what Hydra composes (``python train.py method.num_heads=5`` needs the key in the composed config) and
what the per-backbone overlays ``conf/tuned/<method>/<model>.yaml`` override. So a settings class names its config
(``class EnsMLPSettings(FeatureHeadSettings, config="ens_mlp")``) and takes its defaults from it when the class is
defined: a field declared without a default gets the file's value. The alternative, defaults in code with the YAML
generated or checked against them, would either leave the YAML a second copy or need the method modules (torch:
about 6 s for all of them) imported when Hydra starts. Rules, checked when the class is defined (an error there is
a broken package, not a user's mistake):

* a YAML value that is an interpolation (``${seed}``, ``${device}``, ``${progress}``) keeps the default written in code
  on the base class (``seed=0``, ``device="auto"``, ...): what ``Method()`` gets without Hydra;
* a field with a default both in code and in the YAML is an error, and so is a YAML key that is no field;
* a field the YAML does not hold must have a default in code (the runtime settings a run never configures, such as a
  feature head's ``score_batch_size``, which the caller sets when it scores).

A method registered at runtime (:func:`~rewarduq_exp.methods.registry.register_method`) gives its defaults the same
way: ``config=`` is the name of a file in the config tree, or the path of a YAML file of its own.

Which settings are *runtime-only* (they change how a method runs, not what it learns or the numbers it gives, so
``method.json`` never saves them: device, progress, scoring batches, ...) is a flag on each field
(``setting(runtime=True)``); :meth:`MethodSettings.saved` is what ``hyperparameters()`` saves.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import MISSING, dataclass, field
from pathlib import Path

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.setting_bounds import AUTO, BATCH_ROWS, TOKENS, Bound, check_bound

# Bounds several families share (a method's own are written on its fields).
_ROWS_WHY = ("more than most preference datasets hold, UltraFeedback 62K pairs; the paper's batches are 16-64 "
             "pairs, and a batch's activations are held at once")
PAIRS_PER_STEP = Bound(1, BATCH_ROWS, "pairs", _ROWS_WHY)
PAIRS_PER_FORWARD = Bound(1, BATCH_ROWS, "pairs", _ROWS_WHY, allow=(AUTO,))
ROWS_PER_SCORING_FORWARD = Bound(1, BATCH_ROWS, "rows", "one forward holds the activations of every row; auto lets "
                                 "the token budget decide", allow=(AUTO,))
TOKENS_PER_SCORING_FORWARD = Bound(1, TOKENS, "tokens", "16x the largest budget auto picks, 65,536 on a GPU; one "
                                   "forward holds the activations of every token", allow=(AUTO,))
LOG_EVERY = Bound(1, None, "steps")


def setting(*, default=MISSING, runtime: bool = False, check=None, bound: Bound | None = None, doc: str = ""):
    """A field of a settings dataclass. ``default``: only on a base class, for a value its configs never write (or
    write as an interpolation); otherwise the default comes from the method's YAML. ``runtime``: changes how the
    method runs, never saved in ``method.json``. ``check(value, key) -> value``: the one-line check of the value (it
    may normalise it, e.g. ``float``), ``key`` is ``method.<name>``. ``bound``: an integer setting's range
    (:class:`~rewarduq_exp.core.setting_bounds.Bound`: the limit and why), checked before ``check`` here and, before
    anything is built, on the command line and in a run's composed config (:meth:`MethodSettings.bounds`): the one
    place a method's integer bounds are written. ``doc``: what it is (the YAML's comment says more)."""
    meta = {"runtime": runtime, "check": check, "bound": bound, "doc": doc}
    if isinstance(default, list):
        return field(default_factory=functools.partial(list, default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(kw_only=True)
class MethodSettings:
    """The settings of a method; subclasses add fields (:func:`setting`) and extend :meth:`validate` for the checks
    that involve several of them."""

    config = None   # the YAML the defaults come from (``config=`` of the class statement); not a field

    def __init_subclass__(cls, config: str | Path | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.config = config
        if config is not None:
            _take_defaults(cls, config)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.metadata.get("bound") is not None:
                check_bound(f"method.{f.name}", getattr(self, f.name), bound=f.metadata["bound"])
            check = f.metadata.get("check")
            if check is not None:
                setattr(self, f.name, check(getattr(self, f.name), f"method.{f.name}"))
        self.validate()

    def validate(self) -> None:
        """Checks across fields (each field's own check has run); subclasses extend it."""

    @classmethod
    def build(cls, values: dict) -> MethodSettings:
        """The settings from ``values`` (keywords of the method's constructor), an unknown one refused in one line."""
        unknown = [key for key in values if key not in cls.names()]
        if unknown:
            raise UserError(f"method.{unknown[0]} is not a setting of {cls.method_name()}; allowed: "
                            f"{', '.join(cls.names())}")
        return cls(**values)

    @classmethod
    def method_name(cls) -> str:
        return Path(cls.config).stem if cls.config is not None else cls.__name__

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def bounds(cls) -> dict[str, Bound]:
        """``method.<name>`` -> the bound of each integer setting (the command line's and the composed config's checks
        read them from here, through :func:`~rewarduq_exp.methods.registry.method_bounds`)."""
        return {f"method.{f.name}": f.metadata["bound"] for f in dataclasses.fields(cls)
                if f.metadata.get("bound") is not None}

    @classmethod
    def real_valued(cls) -> frozenset[str]:
        """``method.<name>`` of the settings typed ``float`` (or ``list[float]``, ``float | None``): they take any
        number though their config may write a whole one (``num_epochs: 1``); every other setting with a whole
        default takes integers only."""
        return frozenset(f"method.{f.name}" for f in dataclasses.fields(cls) if "float" in str(f.type))

    @classmethod
    def takes_text(cls) -> frozenset[str]:
        """``method.<name>`` of the settings typed ``str`` among others and without a bound (``str | float``:
        ``marglik`` or a number): a word is theirs to judge whatever kind their default is. (A bounded ``int | str``
        setting, ``auto`` or a batch size, has its words in its bound.)"""
        return frozenset(f"method.{f.name}" for f in dataclasses.fields(cls)
                         if "str" in str(f.type) and str(f.type).replace(" ", "") != "str"
                         and f.metadata.get("bound") is None)

    @classmethod
    def runtime_names(cls) -> list[str]:
        """The settings that change how the method runs, not what it learns: never saved in ``method.json``."""
        return [f.name for f in dataclasses.fields(cls) if f.metadata.get("runtime")]

    @classmethod
    def saved_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if not f.metadata.get("runtime")]

    def saved(self) -> dict:
        """{name: value} of the settings ``method.json`` saves (every one that is not runtime-only)."""
        return {name: getattr(self, name) for name in self.saved_names()}


# ---------------------------------------------------------------------------------------------------- the checks
# Each returns ``check(value, key) -> value`` for :func:`setting`, calling the checks every layer shares
# (:mod:`rewarduq_exp.core.checks`), whose messages the docs and tests quote.

def positive(*, cast=None, integer: bool = False, minimum: float = 0.0, inclusive: bool = False):
    """A number > ``minimum`` (>= with ``inclusive``; an integer with ``integer``), then ``cast`` if given."""
    from rewarduq_exp.core.checks import check_positive

    def check(value, key):
        value = check_positive(value, key, integer=integer, minimum=minimum, inclusive=inclusive)
        return value if cast is None else cast(value)
    return check


def one_of(allowed):
    """One of ``allowed`` (names)."""
    from rewarduq_exp.core.checks import check_choice

    return lambda value, key: check_choice(key, value, allowed)


def listed(allowed):
    """One of ``allowed``, refused as ``key='x' is invalid; allowed: a, b`` (the methods' older message form)."""
    def check(value, key):
        if value not in allowed:
            raise UserError(f"{key}={value!r} is invalid; allowed: {', '.join(allowed)}")
        return value
    return check


_KINDS = {int: "an integer", float: "a number", bool: "true or false", tuple: "a list", list: "a list"}


def cast(kind, what: str | None = None):
    """No check, only ``kind(value)`` (what the method always did with it, e.g. ``int(seed)``); a value it cannot
    convert is one line naming the setting and ``what`` it must be."""
    what = what or _KINDS.get(kind, "a valid value")

    def check(value, key):
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise UserError(f"{key}={value!r} is invalid: must be {what}") from None
    return check


def auto_flag(value, key):
    """``auto``, true or false."""
    from rewarduq_exp.core.checks import check_auto_flag

    return check_auto_flag(value, key)


# The most passes over the training pairs a reward model's schedule may take. The paper trains one epoch (heads and
# adapters alike); 10,000 leaves room for studies on a handful of pairs, while num_epochs=10000000 of 8000 pairs
# planned 9.5e17 FLOPs: a typo, refused before anything runs. (The label-ranking nets, which train on a few hundred
# rows for many epochs, have their own integer bound.)
MAX_EPOCHS = 10_000


def epochs(value, key):
    """A number of epochs in (0, :data:`MAX_EPOCHS`], as a float (a fraction of one is a shorter schedule)."""
    from rewarduq_exp.core.checks import check_positive

    if check_positive(value, key) > MAX_EPOCHS:
        raise UserError(f"{key}={value} is too large: at most {MAX_EPOCHS} epochs (each epoch passes over every "
                        "training pair; the paper trains 1)")
    return float(value)


def grad_norm(value, key):
    """null (no clipping) or a number > 0, as a float."""
    from rewarduq_exp.core.checks import check_max_grad_norm

    return check_max_grad_norm(value, key)


# ---------------------------------------------------------------------------------------------------- the defaults
def _is_interpolation(value) -> bool:
    return isinstance(value, str) and "${" in value


@functools.lru_cache(maxsize=None)
def _config_values(path: Path) -> dict:
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    values.pop("_target_", None)
    return values


def config_path(config: str | Path) -> Path:
    """The YAML file of ``config``: a method name of the config tree, or a path."""
    if isinstance(config, Path) or str(config).endswith((".yaml", ".yml")):
        return Path(config)
    from rewarduq_exp.core.config_dir import CONF_DIR

    return CONF_DIR / "method" / f"{config}.yaml"


def _has_default(f) -> bool:
    return f.default is not MISSING or f.default_factory is not MISSING


def _take_defaults(cls, config) -> None:
    """Give the fields of ``cls`` (not yet a dataclass: its decorator runs after this) their defaults from the YAML
    of ``config`` (module docstring: the rules)."""
    path = config_path(config)
    values = _config_values(path)
    own = cls.__dict__.get("__annotations__")
    if own is None:
        own = cls.__annotations__ = {}
    inherited = {}   # the fields of the base classes, as the decorator will collect them (reversed MRO)
    for base in reversed(cls.__mro__[1:]):
        inherited.update({name: f for name, f in base.__dict__.get("__dataclass_fields__", {}).items()
                          if f._field_type is dataclasses._FIELD})

    def broken(message):
        return TypeError(f"{cls.__qualname__} ({path}): {message}")

    for key, value in values.items():
        if key not in own and key not in inherited:
            raise broken(f"{key} is in the config but is no field of the settings")
        current = cls.__dict__.get(key, MISSING) if key in own else inherited[key]
        if not isinstance(current, dataclasses.Field):
            current = setting(default=current)
        if _is_interpolation(value):
            if not _has_default(current):
                raise broken(f"{key}: {value} in the config needs a default in code (on the base class)")
            continue
        if _has_default(current):
            raise broken(f"{key} has a default both in code and in the config; write it once, in the config")
        if key not in own:
            own[key] = current.type
        setattr(cls, key, setting(default=value, **{k: current.metadata.get(k) for k in ("runtime", "check", "bound")},
                                  doc=current.metadata.get("doc", "")))
    for key in list(own) + list(inherited):
        current = cls.__dict__.get(key, MISSING) if key in own else inherited[key]
        if key not in values and isinstance(current, dataclasses.Field) and not _has_default(current):
            raise broken(f"{key} has no default: write it in the config")
        if key not in values and current is MISSING:
            raise broken(f"{key} has no default: write it in the config")


# ---------------------------------------------------------------------------------------------------- families
# The settings every method of a family shares; each method's own class adds its fields and names its config.

@dataclass(kw_only=True)
class AdamWSettings(MethodSettings):
    """The schedule of a method trained by :func:`~rewarduq_exp.methods.base.run_training`: AdamW, cosine warm-up,
    clipping (:class:`~rewarduq_exp.methods.schedule.TrainingSchedule`, which checks them together)."""

    learning_rate: float = setting(doc="AdamW's peak learning rate")
    batch_size: int = setting(bound=PAIRS_PER_STEP, doc="pairs per optimiser step")
    num_epochs: float = setting(check=epochs, doc="passes over the training pairs")
    warmup_ratio: float = setting(doc="share of the steps of linear warm-up")
    weight_decay: float = setting(doc="AdamW's decoupled weight decay")
    adam_betas: tuple = setting(check=cast(tuple), doc="AdamW's moment decay rates")
    adam_eps: float = setting(doc="AdamW's epsilon")
    max_grad_norm: float | None = setting(doc="clip the total gradient norm at this (null: no clipping)")

    def schedule(self):
        from rewarduq_exp.methods.schedule import TrainingSchedule

        return TrainingSchedule.of(self)

    def validate(self) -> None:
        super().validate()
        self.schedule().validate()


@dataclass(kw_only=True)
class FeatureHeadSettings(MethodSettings):
    """What every head on frozen backbone features has (:class:`~rewarduq_exp.methods.base.FeatureHeadMethod`)."""

    seed: int = setting(default=0, check=cast(int), doc="initialisation and minibatch order")
    device: str = setting(default="auto", runtime=True, doc="auto | cpu | cuda | cuda:<i>")
    score_batch_size: int = setting(default=4096, runtime=True, check=cast(int), bound=ROWS_PER_SCORING_FORWARD,
                                    doc="features per scoring batch")
    show_progress: bool = setting(default=True, runtime=True, doc="progress bars")
    log_every: int = setting(default=10, runtime=True, bound=LOG_EVERY,
                             doc="a training-log record every this many steps")


@dataclass(kw_only=True)
class LabelRankingSettings(MethodSettings):
    """What every label-ranking learner has (:class:`~rewarduq_exp.methods.base.LabelRankingMethod`)."""

    seed: int = setting(default=0, check=cast(int), doc="initialisation, minibatch order, random_state")
    show_progress: bool = setting(default=False, runtime=True, check=cast(bool), doc="progress bars")
    log_every: int = setting(default=10, runtime=True, bound=LOG_EVERY,
                             doc="a training-log record every this many steps")
