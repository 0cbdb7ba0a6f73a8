"""nvidia/HelpSteer2: pointwise (prompt, response) with five 0-4 human ratings, the regression target of probes.

Multi-turn prompts are stored in one string whose earlier turns are separated by ``<extra_id_1>Assistant`` /
``<extra_id_1>User`` markers (dataset card); they are split back into messages so the backbone's chat template
renders them like any other conversation. The calibration split (``cal``, see ``hub.py``) groups rows by the
prompt's first user turn, so the responses to one prompt are on one side only.
"""

from __future__ import annotations

import re

import numpy as np

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.calibration_split import group_key
from rewarduq_exp.data.contract import make_pointwise_frame
from rewarduq_exp.data.hub import HubDataset

ATTRIBUTES = ("helpfulness", "correctness", "coherence", "complexity", "verbosity")
_TURN = re.compile(r"\s*<extra_id_1>(User|Assistant)\s*\n?")


def parse_prompt(text: str) -> list[dict]:
    parts = _TURN.split(text)
    messages = [{"role": "user", "content": parts[0].strip()}]
    for role, content in zip(parts[1::2], parts[2::2]):
        messages.append({"role": role.lower(), "content": content.strip()})
    return messages


class HelpSteer2(HubDataset):
    kind = "pointwise"
    required_columns = ("prompt", "response", *ATTRIBUTES)

    def __init__(self, *args, target: str = "verbosity", score_offset: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        if target not in ATTRIBUTES:
            raise UserError(f"dataset.target={target} is invalid; allowed: {', '.join(ATTRIBUTES)}")
        self.target = target
        # BoRP reads the 0-4 ratings on its 1-5 scale (paper, table 6): score = rating + 1; the attribute columns
        # keep the hub's 0-4 values.
        self.score_offset = float(score_offset)

    def group_keys(self, table) -> list[str]:
        """The prompt's first user turn (the text before any ``<extra_id_1>`` turn marker)."""
        prompts = table.select_columns(["prompt"]).with_format("arrow")[:].column("prompt").to_pylist()
        return [group_key(_TURN.split(p or "")[0].strip()) for p in prompts]

    def normalise(self, table, split: str, row_index: np.ndarray):
        raw = table.select_columns(list(self.required_columns)).to_dict()
        prompts = [parse_prompt(p) for p in raw["prompt"]]
        responses = [[{"role": "assistant", "content": r}] for r in raw["response"]]
        scores = {a: np.asarray(raw[a], dtype=float) for a in ATTRIBUTES}
        frame = make_pointwise_frame([f"{split}-{i}" for i in row_index], prompts, responses, scores,
                                     target=self.target)
        frame["score"] = frame["score"] + self.score_offset
        return frame
