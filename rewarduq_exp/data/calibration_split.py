"""The calibration split (``cal``): rows set aside for post-hoc recalibration, never trained on and never evaluated.

Every loader that can be a training dataset has ``cal_split``: ``"cal"``, the name ``load`` takes for that split, or
None when the dataset has none (``dataset.cal_fraction=0``, ``dataset.n_cal=0`` for the synthetic world, an
evaluation-only dataset). ``load("cal")`` returns a frame in the contract of the training split (pairs or rated
responses), whose rows are in neither the training split nor any eval split. ``cal`` is not among ``eval_splits``:
nothing evaluates it by default; ``eval_datasets=[<name>_cal]`` does.

Where a loader carves ``cal`` out of its training rows (local files, the hub datasets, the VADER sentences), the
rows are held out by group, so that no group (a prompt, or a document) is on both sides: :func:`hold_out` orders
the distinct groups by a hash of their text (salted, so each hold-out has its own order) and takes the first ones.
The sides depend neither on the order of the rows nor on the run's seed, so every run on the data fits its
calibration on the same rows.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence

import numpy as np

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.setting_bounds import shown

CAL_SPLIT = "cal"
CAL_FRACTION_KEY = "dataset.cal_fraction"


def check_fraction(value, key: str = CAL_FRACTION_KEY) -> float:
    """``value`` as a float in [0, 1); else a one-line :class:`UserError` naming ``key`` and the allowed values."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if not ok or not math.isfinite(float(value)) or not 0 <= float(value) < 1:
        raise UserError(f"{key}={shown(value)} is invalid: must be a number in [0, 1) (the share held out; 0: none)")
    return float(value)


def group_key(value) -> str:
    """A prompt (a list of messages, a text, ...) as one stable text: JSON with sorted keys, the group it is held out
    with."""
    return json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)


def _order(key: str, salt: str) -> bytes:
    secret = salt.encode()
    if len(secret) > 64:   # blake2b's key is at most 64 bytes
        secret = hashlib.sha256(secret).digest()
    return hashlib.blake2b(key.encode(), digest_size=8, key=secret).digest()


def hold_out(keys: Sequence[str], fraction: float, *, salt: str = "", by_rows: bool = False) -> np.ndarray | None:
    """The rows to hold out (a boolean mask over ``keys``, one group text per row), or None when there are fewer
    than two groups (nothing can be held out while some group stays).

    The distinct groups are ordered by a hash of their text (keyed with ``salt``; an empty salt is the plain hash)
    and the first ones are held out: ``fraction`` of the groups (``by_rows=False``: round(fraction x groups)), or the
    first groups whose rows add up to at most ``fraction`` of the rows (``by_rows=True``, for groups of very unequal
    size such as documents). Either way at least one group is held out and at least one stays."""
    keys = list(keys)
    groups, inverse = np.unique(np.asarray(keys, dtype=object), return_inverse=True) if keys else ([], [])
    if len(groups) < 2:
        return None
    order = sorted(range(len(groups)), key=lambda g: (_order(groups[g], salt), groups[g]))
    if by_rows:
        sizes = np.bincount(inverse, minlength=len(groups))[order]
        n_held = int((np.cumsum(sizes) <= fraction * len(keys)).sum())
    else:
        n_held = round(fraction * len(groups))
    n_held = min(max(1, n_held), len(groups) - 1)
    held = np.zeros(len(groups), dtype=bool)
    held[order[:n_held]] = True
    return held[inverse]


def calibration_rows(keys: Sequence[str], fraction: float, *, salt: str, source: str, group: str = "prompt",
                     by_rows: bool = False, key: str = CAL_FRACTION_KEY) -> np.ndarray:
    """The rows of a training split (one group text per row in ``keys``) that form its calibration split, as a
    boolean mask (:func:`hold_out`); a one-line :class:`UserError` naming ``source`` when they cannot be held out
    (one group only) or would leave fewer than two training rows."""
    held = hold_out(keys, fraction, salt=salt, by_rows=by_rows)
    if held is None:
        raise UserError(f"{source}: every training row has the same {group}, so none can be held out as the "
                        f"calibration split; set {key}=0 (no calibration split) or give more {group}s")
    left = int((~held).sum())
    if left < 2:
        raise UserError(f"{source}: {key}={fraction:g} leaves {left} training row(s) of {len(held)}, fewer than 2; "
                        f"lower it (0: no calibration split)")
    return held


def no_cal_split(name: str, why: str) -> UserError:
    """The one-line error of ``load("cal")`` on a dataset without a calibration split (``why``: the setting)."""
    return UserError(f"dataset '{name}' has no calibration split '{CAL_SPLIT}' ({why})")
