"""Loading an evaluation or training split as ``train.py`` and ``evaluate.py`` both do: normalise it to the data
contract, drop what exceeds ``max_length`` tokens (counted through the shared token-count cache) and log how much."""

from __future__ import annotations

import logging

from rewarduq_exp.data.contract import data_kind, filter_by_length, validate_preferences

log = logging.getLogger("rewarduq_exp")


def load_split(loader, split: str, name: str, tokenizer, max_length: int, count=None):
    frame = loader.load(split)
    if data_kind(frame) == "pairs":
        frame = validate_preferences(frame, f"dataset '{name}'")
    unsplittable = int(frame.attrs.get("dropped_unsplittable", 0))
    frame, report = filter_by_length(frame, tokenizer, max_length, name, count)
    report.unsplittable = unsplittable
    log.info(report.line())
    return frame, report


def quiet_datasets_unless(progress: bool) -> None:
    """``progress=false`` also silences the ``datasets`` library's bars (split generation, filters)."""
    if not progress:
        import datasets

        datasets.disable_progress_bars()
