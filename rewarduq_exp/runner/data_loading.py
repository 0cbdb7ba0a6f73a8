"""Loading an evaluation or training split as ``train.py`` and ``evaluate.py`` both do: normalise it to the data
contract, drop what exceeds ``max_length`` tokens (counted through the shared token-count cache, or read from the
conversation index's records without a tokenizer) and log how much.

What is too long in characters for any count of ``max_length`` tokens (the tokenizer's lower bound) is dropped
without being tokenised, and by loaders that accept ``max_chars`` before it is even loaded."""

from __future__ import annotations

import inspect
import logging
import os
import sys

from rewarduq_exp.data.contract import data_kind, filter_by_length, validate_preferences
from rewarduq_exp.data.degenerate import check_split
from rewarduq_exp.models.token_counter import token_lower_bound

log = logging.getLogger("rewarduq_exp")


def load_split(loader, split: str, name: str, tokenizer, max_length: int, count=None, *, training: bool = False,
               batch_size=None, n_bins=None, conversations=None):
    """The split as a contract frame, length-filtered, and checked for data that trains or scores nothing
    (:func:`rewarduq_exp.data.degenerate.check_split`: ``training`` for the split a method trains on, with the
    method's ``batch_size``; ``n_bins``: the metric's calibration bins, for an eval split).

    ``conversations`` (a :class:`~rewarduq_exp.models.conversation_index.ConversationIndex`), when given, measures
    the conversations instead of ``tokenizer`` and ``count`` (which may then be None): from its records, loading the
    tokenizer only for conversations it has not recorded."""
    lengths, bound = None, None
    if conversations is not None:
        max_chars = conversations.content_char_limit(max_length)

        def lengths(prompts, completions):
            return conversations.lengths(prompts, completions, max_length)
    else:
        bound = token_lower_bound(tokenizer)
        max_chars = bound.content_char_limit(max_length) if bound is not None else None
    if max_chars is not None and "max_chars" in inspect.signature(loader.load).parameters:
        frame = loader.load(split, max_chars=max_chars)
    else:
        frame = loader.load(split)
    if data_kind(frame) == "pairs":
        frame = validate_preferences(frame, f"dataset '{name}'")
    unsplittable = int(frame.attrs.get("dropped_unsplittable", 0))
    frame, report = filter_by_length(frame, tokenizer, max_length, name, count, bound,
                                     dropped_before_loading=frame.attrs.get("dropped_too_long", ()), lengths=lengths)
    report.unsplittable = unsplittable
    frame, report.identical_dropped = check_split(frame, name, training=training, batch_size=batch_size,
                                                  n_bins=n_bins)
    log.info(report.line())
    return frame, report


def quiet_datasets_unless(progress: bool) -> None:
    """``progress=false`` also silences the ``datasets`` library's bars (split generation, filters).

    Without importing ``datasets`` when nothing has yet (0.2 s of a run on cached features or the synthetic world,
    which never use it): then through the variable it reads when it is imported, unless the user has set it."""
    if progress:
        return
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    else:
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
