"""Data that trains or scores nothing, refused or warned in one line once a split is loaded and length-filtered.

Every dataset goes through :func:`check_split` (``runner.data_loading.load_split``, for ``train.py`` and
``evaluate.py``, the synthetic world, local files and the hub datasets alike). A file whose completions are all
``""``, or whose chosen equals its rejected on every pair, used to train and report a win rate of 0.0000 without a
word. Now:

* refused (:class:`UserError`), where any result would be meaningless: every completion empty; chosen identical to
  rejected in every pair; fewer than :data:`MIN_TRAIN_PAIRS` training pairs left (``n_train=1``, or every other pair
  dropped);
* warned (one line through the ``rewarduq_exp`` logger, with counts), where the result is merely weaker:

  - some pairs have chosen identical to rejected: they hold no preference (a Bradley-Terry label needs two different
    replies). They are DROPPED from training, where they only pull both rewards together, and KEPT in evaluation,
    where the dataset's own scoring counts them (a published win rate on it includes them; they can never be won);
  - some pairs have an empty chosen or rejected reply (but not both: that pair is identical): KEPT, since an empty
    reply against a real one is a legitimate, if weak, preference (a model that answers nothing should lose);
  - fewer training pairs than one batch (``method.batch_size``): every step then sees the whole training set;
  - fewer eval pairs than calibration bins (``metric.n_bins``): some bins are necessarily empty and ECE / MCE rest on
    a handful of pairs.

Rated responses (pointwise) and K-wise sets are refused when every response / completion is empty.
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.contract import data_kind

log = logging.getLogger("rewarduq_exp")

MIN_TRAIN_PAIRS = 2
UNITS = {"pairs": "pairs", "kwise": "prompts", "pointwise": "responses"}


def _text(messages) -> tuple:
    """A completion (a list of messages, or a string) as a comparable value: (role, content) per message."""
    if isinstance(messages, str):
        return (("assistant", messages),)
    if isinstance(messages, np.ndarray):
        messages = messages.tolist()
    if isinstance(messages, dict):
        messages = [messages]
    try:
        return tuple((str(m.get("role", "")), str(m.get("content", ""))) for m in messages)
    except (AttributeError, TypeError):
        return ((None, str(messages)),)


def is_empty(messages) -> bool:
    """No message, or only messages whose content is blank."""
    return all(not content.strip() for _, content in _text(messages))


def _plural(n: int, unit: str) -> str:
    return f"{n} {unit[:-1] if n == 1 and unit.endswith('s') else unit}"


def check_split(frame: pd.DataFrame, name: str, *, training: bool = False, batch_size=None,
                n_bins=None) -> tuple[pd.DataFrame, int]:
    """(``frame`` without the pairs dropped here, how many pairs were dropped), or a one-line :class:`UserError`
    (see the module docstring). ``name``: the split as runs name it (``local_train``); ``training``: the split a
    method trains on; ``batch_size`` (the method's, if it has one) and ``n_bins`` (the metric's) for the size
    warnings."""
    kind = data_kind(frame)
    unit = UNITS[kind]
    n = len(frame)
    dropped = 0
    if kind == "pairs":
        frame, dropped = _check_pairs(frame, name, training)
    elif kind == "pointwise":
        empty = np.fromiter((is_empty(r) for r in frame["response"]), dtype=bool, count=n)
        if n and empty.all():
            raise UserError(f"dataset '{name}': every response is empty (all {n}); a probe cannot be trained or "
                            "scored on empty replies; check that the response column holds the replies")
        if empty.any():
            log.warning("dataset '%s': %d of %d responses are empty; kept", name, int(empty.sum()), n)
    elif kind == "kwise":
        empty = np.fromiter((all(is_empty(c) for c in cs) for cs in frame["completions"]), dtype=bool, count=n)
        if n and empty.all():
            raise UserError(f"dataset '{name}': every completion is empty (all {n} prompts); there is nothing to "
                            "rank; check that the completions column holds the replies")
    n_left = len(frame)
    if training:
        if n_left < MIN_TRAIN_PAIRS:
            after = f" after dropping {dropped} with chosen identical to rejected" if dropped else ""
            raise UserError(f"dataset '{name}' has {_plural(n_left, unit)} to train on{after}: at least "
                            f"{MIN_TRAIN_PAIRS} are needed to train a method; give it more data")
        if _integer(batch_size) and n_left < batch_size:
            log.warning("dataset '%s' has %s to train on, fewer than one batch (method.batch_size=%d): every step "
                        "sees all of them", name, _plural(n_left, unit), batch_size)
    elif kind == "pairs" and _integer(n_bins) and n_left < n_bins:
        log.warning("dataset '%s' has %s, fewer than the metric.n_bins=%d calibration bins: at least %d bins are "
                    "empty and ECE/MCE rest on a few pairs each", name, _plural(n_left, unit), n_bins,
                    n_bins - n_left)
    return frame, dropped


def _check_pairs(frame: pd.DataFrame, name: str, training: bool) -> tuple[pd.DataFrame, int]:
    n = len(frame)
    if not n:
        return frame, 0
    chosen = [_text(c) for c in frame["chosen"]]
    rejected = [_text(r) for r in frame["rejected"]]
    chosen_empty = np.fromiter((all(not t.strip() for _, t in c) for c in chosen), dtype=bool, count=n)
    rejected_empty = np.fromiter((all(not t.strip() for _, t in r) for r in rejected), dtype=bool, count=n)
    if (chosen_empty & rejected_empty).all():
        raise UserError(f"dataset '{name}': every completion is empty (chosen and rejected of all {n} pairs); a "
                        "reward model cannot learn or be scored on empty replies; check that chosen and rejected "
                        "hold the replies (dataset=local: map them with dataset.columns.chosen / .rejected)")
    identical = np.fromiter((c == r for c, r in zip(chosen, rejected)), dtype=bool, count=n)
    if identical.all():
        raise UserError(f"dataset '{name}': chosen is identical to rejected in every pair (all {n}), so there is no "
                        "preference to learn or score; check that chosen and rejected are different columns "
                        "(dataset=local: dataset.columns.chosen / .rejected)")
    one_empty = (chosen_empty ^ rejected_empty)
    if one_empty.any():
        log.warning("dataset '%s': %d of %d pairs have an empty %s reply; kept (an empty reply against a real one is "
                    "a weak but valid preference)", name, int(one_empty.sum()), n,
                    "chosen" if not rejected_empty[one_empty].any() else
                    "rejected" if not chosen_empty[one_empty].any() else "chosen or rejected")
    if not identical.any():
        return frame, 0
    count = int(identical.sum())
    if training:
        log.warning("dataset '%s': %d of %d pairs have chosen identical to rejected (no preference); dropped from "
                    "training, %d left", name, count, n, n - count)
        kept = frame.loc[~identical].reset_index(drop=True)
        kept.attrs = dict(frame.attrs)
        return kept, count
    log.warning("dataset '%s': %d of %d pairs have chosen identical to rejected (no preference); kept, as the "
                "dataset's own scoring counts them (they can never be won)", name, count, n)
    return frame, 0


def _integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0
