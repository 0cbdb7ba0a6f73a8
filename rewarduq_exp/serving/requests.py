"""What a request may hold, and how the two request shapes become (prompt, completion) pairs.

Every refusal is a :class:`RequestError`: an HTTP status and one line naming the field, the limit or what is
allowed, sent to the client as ``{"error": "<line>"}``.

* ``POST /get_reward`` takes OpenRLHF's remote reward-model request unchanged: ``{"query": [...], "prompts": [...]}``
  (``labels`` and other keys are ignored). OpenRLHF sends each ``query`` as the prompt and the response in one string
  (the prompt as the policy rendered it, then the generated text) and the prompt itself in ``prompts``; the response
  is what follows the prompt in its query. The end-of-text and padding tokens the policy leaves at the end of a
  response (``strip``: the reward model's tokenizer's own, and any given) are removed, as OpenRLHF's own server does.
* ``POST /score`` takes ``{"prompts": [...], "completions": [...]}`` (strings, or lists of chat messages) or
  ``{"conversations": [[messages], ...]}`` whose last message is the assistant's completion.

Both take ``"k"`` (a number >= 0): ``rewards`` is then r - k u for that request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class RequestError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class Scoring:
    """A request as the model sees it: pairs to score and the k of its ``rewards`` (None: the reward itself)."""

    prompts: list
    completions: list
    k: float | None


def _list(body: dict, key: str) -> list:
    value = body.get(key)
    if not isinstance(value, list):
        raise RequestError(422, f"{key} must be a list, not {type(value).__name__}")
    return value


def _k(body: dict, default: float | None) -> float | None:
    if "k" not in body or body["k"] is None:
        return default
    k = body["k"]
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k) or k < 0:
        raise RequestError(422, f"k={k!r} is invalid: must be a number >= 0 (rewards = r - k u) or null")
    return float(k)


def _check_text(value, where: str, max_chars: int) -> None:
    """A string, or a list of {role, content} messages with string contents, each within ``max_chars``."""
    if isinstance(value, str):
        if len(value) > max_chars:
            raise RequestError(413, f"{where} has {len(value)} characters, more than serve.max_chars={max_chars}")
        return
    if not isinstance(value, list) or not value:
        raise RequestError(422, f"{where} must be a string or a non-empty list of {{role, content}} messages")
    for j, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str) \
                or not isinstance(message.get("role"), str):
            raise RequestError(422, f"{where}[{j}] must be a message {{\"role\": ..., \"content\": <string>}}")
        if len(message["content"]) > max_chars:
            raise RequestError(413, f"{where}[{j}] has {len(message['content'])} characters, more than "
                                    f"serve.max_chars={max_chars}")


def _check_count(n: int, max_items: int) -> None:
    if n > max_items:
        raise RequestError(413, f"the request holds {n} completions, more than serve.max_items={max_items}")
    if n == 0:
        raise RequestError(422, "the request holds no completion to score")


def openrlhf_request(body: dict, *, max_items: int, max_chars: int, default_k: float | None,
                     strip: tuple[str, ...] = ()) -> Scoring:
    """OpenRLHF's ``{"query": [...], "prompts": [...]}``: each response is its query after its prompt."""
    queries = _list(body, "query")
    if "prompts" not in body:
        raise RequestError(422, "prompts is missing: OpenRLHF sends the prompt of every query beside it; the response "
                                "scored is what follows the prompt in its query")
    prompts = _list(body, "prompts")
    _check_count(len(queries), max_items)
    if len(prompts) != len(queries):
        raise RequestError(422, f"query has {len(queries)} entries but prompts {len(prompts)}: one prompt per query")
    completions = []
    for i, (query, prompt) in enumerate(zip(queries, prompts)):
        if not isinstance(query, str) or not isinstance(prompt, str):
            raise RequestError(422, f"query[{i}] and prompts[{i}] must be strings")
        _check_text(query, f"query[{i}]", max_chars)
        if not query.startswith(prompt):
            raise RequestError(422, f"query[{i}] does not start with prompts[{i}]: the response is what follows the "
                                    "prompt in its query")
        completions.append(strip_end(query[len(prompt):], strip))
    return Scoring(list(prompts), completions, _k(body, default_k))


def strip_end(text: str, tokens: tuple[str, ...]) -> str:
    """``text`` without the special tokens (end of text, padding) that end it, however repeated; the generated text
    itself, whitespace included, is scored as it is."""
    changed = True
    while changed and tokens:
        changed = False
        for token in tokens:
            if token and text.endswith(token):
                text, changed = text[: -len(token)], True
    return text


def score_request(body: dict, *, max_items: int, max_chars: int, default_k: float | None) -> Scoring:
    """``{"prompts": [...], "completions": [...]}`` or ``{"conversations": [...]}``."""
    if "conversations" in body:
        conversations = _list(body, "conversations")
        _check_count(len(conversations), max_items)
        prompts, completions = [], []
        for i, conversation in enumerate(conversations):
            _check_text(conversation, f"conversations[{i}]", max_chars)
            if isinstance(conversation, str) or len(conversation) < 2 or conversation[-1]["role"] != "assistant":
                raise RequestError(422, f"conversations[{i}] must be a list of messages ending with the assistant's "
                                        "completion, after at least one message of the prompt")
            prompts.append(conversation[:-1])
            completions.append(conversation[-1:])
        return Scoring(prompts, completions, _k(body, default_k))
    if "prompts" not in body or "completions" not in body:
        raise RequestError(422, "the request needs prompts and completions (lists of the same length) or "
                                "conversations")
    prompts, completions = _list(body, "prompts"), _list(body, "completions")
    _check_count(len(completions), max_items)
    if len(prompts) != len(completions):
        raise RequestError(422, f"prompts has {len(prompts)} entries but completions {len(completions)}: one prompt "
                                "per completion")
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        _check_text(prompt, f"prompts[{i}]", max_chars)
        _check_text(completion, f"completions[{i}]", max_chars)
    return Scoring(prompts, completions, _k(body, default_k))
