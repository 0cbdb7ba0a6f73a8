"""Argument checks shared by every layer: each returns the checked value or raises a one-line :class:`UserError`
that names the setting and what is allowed."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence

import numpy as np

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.setting_bounds import MAX_BINS, REAL_VALUED, check_bound, integer_kind_problem

# The devices every method is written and tested for (bf16 autocast, dropout-mask generators and distributed backends
# are only written for these two): the command line checks the form before any run folder exists, the backbone again.
DEVICE_FORM = re.compile(r"auto|cpu|cuda(:\d+)?")


def device_problem(value) -> str | None:
    """The one-line message for a ``device`` that is not auto, cpu, cuda or cuda:N (None when it is one)."""
    if isinstance(value, str) and DEVICE_FORM.fullmatch(value):
        return None
    return f"device={value!r} is not supported: use auto, cpu, cuda or cuda:N"


def check_positive(value, key: str, *, integer: bool = False, minimum: float = 0.0, inclusive: bool = False):
    """``value`` > ``minimum`` (>= with ``inclusive``), finite, and an integer when asked; booleans are refused."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if ok:
        ok = (value >= minimum) if inclusive else (value > minimum)
        if integer and int(value) != value:
            ok = False
        if isinstance(value, (float, np.floating)) and not math.isfinite(value):
            ok = False
    if not ok:
        kind = "an integer" if integer else "a number"
        rel = ">=" if inclusive else ">"
        raise UserError(f"{key}={value!r} is invalid: must be {kind} {rel} {minimum:g}")
    return value


def check_integer(key: str, value, minimum: int, maximum: int | None = None) -> int:
    """``value`` must be a whole number >= ``minimum`` (and <= ``maximum``). Hydra hands ``seed=abc`` over as a
    string and ``seed=1.5`` as a float, which ``int()`` would refuse with a traceback or silently round down;
    ``seed=true`` is a bool, which Python counts as the integer 1. numpy integers count as whole numbers."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum
            or (maximum is not None and value > maximum)):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise UserError(f"{key}={_shown(value)} is invalid: must be an integer {allowed}")
    return value


def _shown(value) -> str:
    """A value as it is written on the command line (``true``, not Python's ``True``)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


# Seeds in [0, 2**32 - 1]: what every generator a run seeds accepts (numpy's legacy ``np.random.seed`` and
# ``datasets``' shuffles stop at 2**32 - 1, torch's at 2**64 - 1); a larger seed is a traceback in torch or, where
# it was reduced modulo 2**32, the same run as a smaller seed.
SEED_MAX = 2**32 - 1


def is_seed(key: str) -> bool:
    """Whether setting ``key`` (dotted) is a seed: ``seed``, ``method.seed``, ``dataset.sample_seed``, ..."""
    name = key.rsplit(".", 1)[-1]
    return name == "seed" or name.endswith("_seed")


def check_seed(key: str, value) -> int:
    return check_integer(key, value, minimum=0, maximum=SEED_MAX)


def check_like_default(key: str, value, default, shown: str | None = None, bound=None,
                       real_valued: bool | None = None, takes_text: bool = False):
    """A value given for setting ``key`` must be of the kind of its default: true or false for a boolean, a number
    for a number (null too: several numbers mean "off" or "all" when null), settings one by one for a group of
    settings; seeds as :func:`check_seed`. Text and null defaults take anything (their own checks judge it).

    Our configs are plain YAML, so OmegaConf types nothing: ``progress=maybe`` would arrive as the text "maybe"
    (and count as true), ``dataset.n_train=abc`` as the text "abc", which fails deep inside a constructor.
    ``shown``: the value as the user wrote it (default: as it is written on the command line). ``bound``: the
    setting's own bound (a method's settings carry theirs), else the table's; ``real_valued``: whether a whole
    default still takes any number (default: :data:`~rewarduq_exp.core.setting_bounds.REAL_VALUED`);
    ``takes_text``: the setting also takes a word (a method's ``str | float`` setting such as ``prior_precision``:
    ``marglik`` or a number), which its own check judges whatever the default's kind."""
    from omegaconf import DictConfig

    shown = _shown(value) if shown is None else shown
    if isinstance(value, str) and ("${" in value or takes_text):
        return value  # an interpolation (judged once resolved) or a word the setting takes: its own check judges it
    if is_seed(key) and value is not None:
        return check_seed(key, value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise UserError(f"{key}={shown} is invalid: must be true or false")
    elif isinstance(default, (int, float)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UserError(f"{key}={shown} is invalid: must be a number (its default is {default})")
        # An integer default makes an integer setting (probe.layer=-1.5 ran as -1 while the config said -1.5), except
        # the few that take any number (minutes, epochs: setting_bounds.REAL_VALUED); 2.0 is refused too (why:
        # rewarduq_exp/core/setting_bounds.py)
        real = key in REAL_VALUED if real_valued is None else real_valued
        if (isinstance(default, int) and value is not None and not real
                and (problem := integer_kind_problem(key, value, default, shown))):
            raise UserError(problem)
    elif isinstance(default, (DictConfig, dict)) and not isinstance(value, (DictConfig, dict)) and value is not None:
        first = next(iter(default.keys()), "<key>")
        raise UserError(f"{key}={shown} is invalid: {key} is a group of settings ({', '.join(map(str, default))}), "
                        f"not one value; set them one by one, e.g. {key}.{first}=<value>")
    # the bounds of the settings that size an allocation (bins, K, batches, max_length, ...), whatever the default
    return check_bound(key, value, shown, bound=bound)


def check_max_grad_norm(value, key: str = "method.max_grad_norm") -> float | None:
    """``None`` (no clipping) or a number > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{key}={value!r} is invalid: must be a number > 0, or null for no clipping")
    return float(check_positive(value, key))


def check_adam_betas(betas, key: str = "method.adam_betas") -> tuple[float, float]:
    """Adam's two decay rates, each in [0, 1): a list of any other length is refused in one line before anything is
    built (a method.json may hold millions of numbers there)."""
    listed = isinstance(betas, Sequence) and not isinstance(betas, str)
    ok = listed and len(betas) == 2
    if ok:
        ok = all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)
    if not ok:
        shown = f"a list of {len(betas)} values" if listed and len(betas) != 2 else repr(betas)
        raise UserError(f"{key}={shown} is invalid: must be two numbers in [0, 1), e.g. [0.9, 0.999]")
    return float(betas[0]), float(betas[1])


def check_choice(name: str, value, allowed: Sequence[str]) -> str:
    """``value`` when it is one of ``allowed``."""
    if value not in allowed:
        raise UserError(f"{name}={value!r} is invalid: allowed values are {', '.join(allowed)}")
    return value


def check_n_bins(n_bins: object) -> int:
    """``n_bins`` as an int, unless it is not an integer in [1, :data:`MAX_BINS`] (beyond it the bins' arrays grow
    without any pair to fill them: 1e9 bins took 18.7 GB)."""
    if isinstance(n_bins, bool) or not isinstance(n_bins, (int, np.integer)) or not 1 <= n_bins <= MAX_BINS:
        raise UserError(f"n_bins must be an integer in [1, {MAX_BINS}], got {n_bins!r}")
    return int(n_bins)


AUTO_FLAGS = {"auto": "auto", "true": True, "false": False}


def check_auto_flag(value, key: str):
    """``"auto"``, True or False from a setting that takes auto, true or false (a bool, or those words in any case,
    as a command line or a YAML file gives them): the one parser of such settings (gradient checkpointing, the
    mixed-adapter passes, ...)."""
    choice = value if isinstance(value, bool) else AUTO_FLAGS.get(str(value).lower())
    if choice is None:
        raise UserError(f"{key}={value} is invalid; allowed: auto, true, false")
    return choice

