"""Turning the many layouts of preference data into (prompt conversation, chosen turns, rejected turns).

Sources store a pair in one of these layouts:

* plain strings: ``prompt`` str, ``chosen``/``rejected`` str (RewardBench);
* implicit prompt: ``chosen``/``rejected`` are whole conversations that share the prompt turns (UltraFeedback,
  Skywork), sometimes with a redundant ``prompt`` column next to them (Tulu 3);
* explicit prompt: ``prompt`` messages, ``chosen``/``rejected`` only the assistant reply;
* transcripts: one string "\\n\\nHuman: ...\\n\\nAssistant: ..." per side (HH-RLHF), see :func:`parse_transcript`.

The prompt is always the longest common message prefix of the two conversations that ends before an assistant turn
(the rule TRL's ``maybe_extract_prompt`` uses). A separate prompt column is used only when the conversations share
no prefix: adding it in front of conversations that already hold the user turn would duplicate that turn, which is
the mistake the reference code makes on Tulu 3.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.contract import as_messages, make_preference_frame

log = logging.getLogger(__name__)

_TRANSCRIPT_TURN = re.compile(r"\n\n(Human|Assistant):[ ]?")
_TRANSCRIPT_ROLE = {"Human": "user", "Assistant": "assistant"}


def parse_transcript(text: str) -> list[dict] | None:
    """An HH-RLHF transcript ("\\n\\nHuman: ...\\n\\nAssistant: ...") as messages; None if it is not one."""
    parts = _TRANSCRIPT_TURN.split(text)
    # parts = [text before the first marker, role, content, role, content, ...]
    if len(parts) < 3 or parts[0].strip():
        return None
    return [{"role": _TRANSCRIPT_ROLE[role], "content": content} for role, content in zip(parts[1::2], parts[2::2])]


def _shared_prompt_length(chosen: list[dict], rejected: list[dict]) -> int:
    k = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        k += 1
    # Back off until both completions start with an assistant turn (a shared assistant turn stays in the prompt).
    while k > 0 and not (k < len(chosen) and k < len(rejected)
                         and chosen[k]["role"] == "assistant" and rejected[k]["role"] == "assistant"):
        k -= 1
    return k


def split_pair(prompt, chosen: list[dict], rejected: list[dict]) -> tuple[list[dict], list[dict], list[dict]] | None:
    """(prompt, chosen completion, rejected completion), or None when the pair has no valid split.

    ``prompt`` is the source's prompt value already as messages, or None. A valid split has a non-empty prompt and two
    non-empty completions that each start with an assistant turn.
    """
    k = _shared_prompt_length(chosen, rejected)
    if k > 0:
        prompt_msgs = chosen[:k]  # a prompt column, if any, is a copy of these turns
    elif prompt:
        prompt_msgs = prompt
    else:
        return None
    c, r = chosen[k:], rejected[k:]
    if not c or not r or c[0]["role"] != "assistant" or r[0]["role"] != "assistant":
        return None
    return prompt_msgs, c, r


@dataclass
class PairColumns:
    """Raw column values of one source, row-aligned; ``prompt``, ``ids``, ``weight``, ``subset`` may be None."""

    chosen: list
    rejected: list
    prompt: list | None = None
    ids: list | None = None
    weight: list | None = None
    subset: list | None = None


def normalise_pairs(cols: PairColumns, source: str, transcripts: bool = False):
    """The preference-data contract frame of one source; pairs without a valid prompt/completion split are dropped.

    ``transcripts=True`` parses chosen/rejected as HH-RLHF transcripts. The number of dropped pairs is logged and
    kept in ``frame.attrs["dropped_unsplittable"]``.
    """
    n = len(cols.chosen)
    ids = cols.ids if cols.ids is not None else [str(i) for i in range(n)]
    keep, prompts, chosen, rejected = [], [], [], []
    for i in range(n):
        if transcripts:
            c, r = parse_transcript(cols.chosen[i]), parse_transcript(cols.rejected[i])
            p = None
            if c is None or r is None:
                continue
        else:
            c = as_messages(cols.chosen[i], "assistant", source=source, column="chosen")
            r = as_messages(cols.rejected[i], "assistant", source=source, column="rejected")
            value = None if cols.prompt is None else cols.prompt[i]
            missing = value is None or (isinstance(value, str) and not value)
            p = None if missing else as_messages(value, "user", source=source, column="prompt")
        split = split_pair(p, c, r)
        if split is None:
            continue
        keep.append(i)
        prompts.append(split[0])
        chosen.append(split[1])
        rejected.append(split[2])
    pick = lambda values: None if values is None else [values[i] for i in keep]  # noqa: E731
    frame = make_preference_frame([ids[i] for i in keep], prompts, chosen, rejected,
                                  weight=pick(cols.weight), subset=pick(cols.subset))
    dropped = n - len(keep)
    if n and not keep:
        raise UserError(f"{source}: none of the {n} pairs splits into a prompt and two assistant replies; give a "
                        "prompt column, or chosen/rejected conversations that share the prompt turns")
    frame.attrs["dropped_unsplittable"] = dropped
    if dropped:
        log.warning("%s: dropped %d of %d pairs whose chosen and rejected do not split into a shared prompt and two "
                    "assistant replies", source, dropped, n)
    return frame
