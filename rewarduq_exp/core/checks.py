"""Argument checks shared by every layer: each returns the checked value or raises a one-line :class:`UserError`
that names the setting and what is allowed."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from rewarduq_exp.core.errors import UserError


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


def check_integer(key: str, value, minimum: int) -> int:
    """``value`` must be a whole number >= ``minimum``. Hydra hands ``seed=abc`` over as a string and ``seed=1.5`` as
    a float, which ``int()`` would refuse with a traceback or silently round down; ``seed=true`` is a bool, which
    Python counts as the integer 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        shown = str(value).lower() if isinstance(value, bool) else value
        raise UserError(f"{key}={shown} is invalid: must be an integer >= {minimum}")
    return value


def check_max_grad_norm(value, key: str = "method.max_grad_norm") -> float | None:
    """``None`` (no clipping) or a number > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{key}={value!r} is invalid: must be a number > 0, or null for no clipping")
    return float(check_positive(value, key))


def check_choice(name: str, value, allowed: Sequence[str]) -> str:
    """``value`` when it is one of ``allowed``."""
    if value not in allowed:
        raise UserError(f"{name}={value!r} is invalid: allowed values are {', '.join(allowed)}")
    return value


def check_n_bins(n_bins: object) -> int:
    """``n_bins`` as an int, unless it is not an integer >= 1."""
    if isinstance(n_bins, bool) or not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
        raise UserError(f"n_bins must be an integer >= 1, got {n_bins!r}")
    return int(n_bins)
