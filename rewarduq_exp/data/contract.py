"""The preference-data contract and the steps every source goes through.

After loading, every preference dataset is a DataFrame with columns ``id`` (str), ``prompt`` (list of
``{role, content}`` messages), ``chosen`` and ``rejected`` (lists of assistant messages), ``weight`` (float, default
1) and ``subset`` (str, may be empty). Extra columns (e.g. the synthetic world's ``true_margin``) travel along.

Rendering uses the backbone tokenizer's own chat template. The length filter drops (never truncates) a pair whose
prompt + chosen or prompt + rejected exceeds ``max_length`` tokens, and reports how many pairs it dropped. A text
too long in characters for any count of ``max_length`` tokens is dropped without being tokenised (the tokenizer's
lower bound, :mod:`rewarduq_exp.models.token_counter`); a loader may drop such rows even before loading them, from
the characters of their message contents (:func:`content_chars`), and they are counted in the same report.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from rewarduq_exp.core.errors import UserError

PREFERENCE_COLUMNS = ("id", "prompt", "chosen", "rejected", "weight", "subset")
ROLES = ("system", "user", "assistant", "tool")
# The roles whose message contents count towards a conversation's length before it is rendered: the ones the chat
# template is checked to render verbatim (``tool`` turns are rendered in too many ways to rely on, so they count 0).
COUNTED_ROLES = ("system", "user", "assistant")


def make_preference_frame(ids, prompts, chosen, rejected, weight=None, subset=None) -> pd.DataFrame:
    n = len(ids)
    return pd.DataFrame(
        {
            "id": [str(i) for i in ids],
            "prompt": list(prompts),
            "chosen": list(chosen),
            "rejected": list(rejected),
            "weight": np.ones(n) if weight is None else np.asarray(weight, dtype=float),
            "subset": [""] * n if subset is None else [str(s) for s in subset],
        }
    )


def make_kwise_frame(ids, prompts, completions, best, weight=None, subset=None, num_correct=None) -> pd.DataFrame:
    """K-wise data (e.g. RewardBench 2): ``completions`` is a list of K completions per prompt; completions
    ``best .. best + num_correct - 1`` are the correct ones (``num_correct`` default 1)."""
    frame = make_preference_frame(ids, prompts, [None] * len(ids), [None] * len(ids), weight, subset)
    frame = frame.drop(columns=["chosen", "rejected"])
    frame.insert(2, "completions", list(completions))
    frame.insert(3, "best", np.asarray(best, dtype=np.int64))
    frame.insert(4, "num_correct", np.ones(len(ids), dtype=np.int64) if num_correct is None
                 else np.asarray(num_correct, dtype=np.int64))
    return frame


def make_pointwise_frame(ids, prompts, responses, scores: dict, target: str, weight=None, subset=None) -> pd.DataFrame:
    """Pointwise data (e.g. HelpSteer2): one response per row with its rating(s); ``score`` is the ``target`` one."""
    frame = make_preference_frame(ids, prompts, [None] * len(ids), [None] * len(ids), weight, subset)
    frame = frame.drop(columns=["chosen", "rejected"])
    frame.insert(2, "response", list(responses))
    for name, values in scores.items():
        frame[name] = np.asarray(values, dtype=float)
    frame["score"] = frame[target]
    return frame


def data_kind(frame: pd.DataFrame) -> str:
    """pairs | kwise | pointwise, from the columns of a contract frame."""
    if "completions" in frame.columns:
        return "kwise"
    if "response" in frame.columns:
        return "pointwise"
    return "pairs"


def message_text(content, source: str, column: str) -> str:
    """A message's content as text: a string, or the OpenAI / transformers list of parts
    (``[{"type": "text", "text": ...}, ...]``), whose text parts are concatenated in order, as chat templates that
    accept parts render them. Other parts (images, audio) are refused: a text reward model cannot score them, and
    printing the list (what happened before) would score its Python repr."""
    if isinstance(content, str):
        return content
    if isinstance(content, np.ndarray):
        content = content.tolist()
    if isinstance(content, (list, tuple)) and all(isinstance(part, dict) for part in content):
        kinds = [part.get("type") for part in content]
        if all(kind == "text" and isinstance(part.get("text"), str) for kind, part in zip(kinds, content)):
            return "".join(part["text"] for part in content)
        raise UserError(f"{source}: column '{column}' holds content parts of type {sorted(set(map(str, kinds)))}; "
                        "only text parts ({'type': 'text', 'text': ...}) can be scored")
    if isinstance(content, (list, tuple, dict)):
        raise UserError(f"{source}: column '{column}' holds a message whose content is a {type(content).__name__} "
                        "that is not a list of content parts; allowed: a string or a list of "
                        "{'type': 'text', 'text': ...} parts")
    return str(content)  # numbers and other scalars: their text, as before


def as_messages(value, default_role: str, *, source: str, column: str) -> list[dict]:
    """Normalise a plain string, one message dict or a list of messages into a list of messages."""
    if isinstance(value, str):
        return [{"role": default_role, "content": value}]
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)) and all(isinstance(m, dict) for m in value):
        out = []
        for m in value:
            if "role" not in m or "content" not in m or m["role"] not in ROLES:
                raise UserError(
                    f"{source}: column '{column}' holds a message without a valid role/content "
                    f"(got keys {sorted(m)}; roles allowed: {', '.join(ROLES)})"
                )
            out.append({"role": str(m["role"]), "content": message_text(m["content"], source, column)})
        return out
    raise UserError(
        f"{source}: column '{column}' must hold a string or a list of {{role, content}} messages, "
        f"got {type(value).__name__}"
    )


def validate_preferences(frame: pd.DataFrame, source: str) -> pd.DataFrame:
    missing = [c for c in PREFERENCE_COLUMNS if c not in frame.columns]
    if missing:
        found = ", ".join(map(str, frame.columns))
        raise UserError(f"{source}: missing column(s) {', '.join(missing)}; found: {found}")
    if len(frame) == 0:
        raise UserError(f"{source}: no preference pairs")
    weight = frame["weight"].to_numpy(dtype=float)
    if not np.all(np.isfinite(weight)) or (weight < 0).any():
        raise UserError(f"{source}: column 'weight' must hold finite numbers >= 0")
    return frame


# ---------------------------------------------------------------------------------------------------- rendering
# A scoring call renders each conversation for its length check, its features and its prompt's head, and tokenises
# the texts for each; within a rendering pass (:func:`rendering_pass`) each is made once and read again (three
# renders and two tokenisations per conversation made a CPU scoring call 1.18x [95 % CI 1.06, 1.32] slower).
# Outside a pass nothing is kept.
_PASS: ContextVar[dict | None] = ContextVar("rendering_pass", default=None)


@contextmanager
def rendering_pass(remembered: dict | None = None):
    """Within it, each (prompt, completion) is rendered once, each prompt head once and each text tokenised once,
    however often the steps of one call ask. Conversations are found by identity (the same message lists passed
    along, not changed in place meanwhile) and prompts by their messages. Yields what the pass remembers, which a
    later pass over the same conversations may continue (``remembered``; several joined by :func:`joined_passes`);
    the memory lasts as long as that dict is kept."""
    outer = _PASS.get()
    if remembered is None and outer is not None:   # an outer pass already remembers
        yield outer
        return
    token = _PASS.set({} if remembered is None else remembered)
    try:
        yield _PASS.get()
    finally:
        _PASS.reset(token)


def joined_passes(passes) -> dict:
    """What several rendering passes remember, as one (to continue them in a single pass)."""
    joined: dict = {}
    for remembered in passes:
        for key, part in remembered.items():
            into = joined.setdefault(key, {"tokenizer": part["tokenizer"], "texts": {}, "heads": {}, "ids": {}})
            for kind in ("texts", "heads", "ids"):
                into[kind].update(part[kind])
    return joined


def _remembered(tokenizer) -> dict | None:
    """What the current rendering pass remembers for ``tokenizer``; None outside a pass."""
    memo = _PASS.get()
    if memo is None:
        return None
    # the tokenizer is kept with its memory: an id is only unique among living objects
    return memo.setdefault(id(tokenizer), {"tokenizer": tokenizer, "texts": {}, "heads": {}, "ids": {}})


def render(tokenizer, prompt: list[dict], completion: list[dict]) -> str:
    """One conversation rendered by the backbone's chat template (the same text the backbone is scored on)."""
    return tokenizer.apply_chat_template(list(prompt) + list(completion), tokenize=False)


def render_all(tokenizer, prompts, completions) -> list[str]:
    memo = _remembered(tokenizer)
    if memo is None:
        return [render(tokenizer, p, c) for p, c in zip(prompts, completions)]
    texts, out = memo["texts"], []
    for p, c in zip(prompts, completions):
        seen = texts.get((id(p), id(c)))
        if seen is None or seen[0] is not p or seen[1] is not c:   # the objects are kept and compared, as above
            seen = texts[id(p), id(c)] = (p, c, render(tokenizer, p, c))
        out.append(seen[2])
    return out


def _messages_key(messages) -> tuple | None:
    """Plain {role, content} messages of strings as a hashable key; None for anything else (never shared then)."""
    if all(isinstance(m, dict) and len(m) == 2 and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
           for m in messages):
        return tuple((m["role"], m["content"]) for m in messages)
    return None


def render_prompt_heads(tokenizer, prompts) -> list[str]:
    """Each prompt as the template opens the reply: the start that every text rendered with that prompt shares.
    Equal prompts (n completions of one prompt) are rendered once."""
    memo = _remembered(tokenizer)
    heads = {} if memo is None else memo["heads"]
    out = []
    for p in prompts:
        key = _messages_key(p)
        head = heads.get(key) if key is not None else None
        if head is None:
            head = tokenizer.apply_chat_template(list(p), tokenize=False, add_generation_prompt=True)
            if key is not None:
                heads[key] = head
        out.append(head)
    return out


def token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """The token ids of rendered texts; in a rendering pass, one batched call for the texts not tokenised yet."""
    # The template already holds the special tokens; adding them again would change the text being scored.
    memo = _remembered(tokenizer)
    if memo is None:
        return tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    known = memo["ids"]
    todo = list(dict.fromkeys(t for t in texts if t not in known))
    if todo:
        known.update(zip(todo, tokenizer(todo, add_special_tokens=False)["input_ids"]))
    return [known[t] for t in texts]


def token_lengths(tokenizer, texts: list[str]) -> np.ndarray:
    return np.fromiter((len(ids) for ids in token_ids(tokenizer, texts)), dtype=np.int64, count=len(texts))


def content_chars(column) -> np.ndarray:
    """Characters of the message contents of each row of a pyarrow column, counted in Arrow without making Python
    strings of them (so a huge row costs no memory before it is dropped).

    A string counts whole (a plain reply, or the prompt); a ``{role, content}`` message or a list of them counts the
    contents of :data:`COUNTED_ROLES`, a content given as text parts its ``text`` parts (what :func:`message_text`
    keeps). Anything else counts 0, so the count never exceeds the contents a row holds.
    """
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    return np.concatenate([_chunk_chars(chunk) for chunk in chunks] or [np.zeros(0, dtype=np.int64)])


def _chunk_chars(array) -> np.ndarray:
    kind = array.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return pc.fill_null(pc.utf8_length(array), 0).to_numpy().astype(np.int64)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        per_item = _chunk_chars(pc.list_flatten(array))
        parents = pc.list_parent_indices(array).to_numpy()
        return np.bincount(parents, weights=per_item, minlength=len(array)).astype(np.int64)
    if pa.types.is_struct(kind):
        names = {kind.field(i).name for i in range(kind.num_fields)}
        if "content" in names:  # a message: only the contents of the counted roles
            chars = _chunk_chars(pc.struct_field(array, "content"))
            if "role" in names:
                counted = pc.fill_null(pc.is_in(pc.struct_field(array, "role"), pa.array(COUNTED_ROLES)), False)
                chars = np.where(counted.to_numpy(zero_copy_only=False), chars, 0)
            return chars
        if "text" in names:  # a content part
            return _chunk_chars(pc.struct_field(array, "text"))
    return np.zeros(len(array), dtype=np.int64)


@dataclass
class FilterReport:
    dataset: str
    before: int
    after: int
    max_length: int
    dropped_by_subset: dict[str, int] = field(default_factory=dict)
    length_percentiles: dict[str, float] = field(default_factory=dict)
    unsplittable: int = 0  # dropped earlier, when the source's rows did not split into prompt + replies
    unit: str = "pairs"    # what a row is: pairs, prompts (K-wise) or responses (pointwise)
    not_tokenised: int = 0  # of the dropped: too long in characters for max_length tokens, never tokenised
    identical_dropped: int = 0  # after the filter: training pairs whose chosen equals rejected (data/degenerate.py)

    @property
    def dropped(self) -> int:
        return self.before - self.after

    def line(self) -> str:
        pct = ", ".join(f"p{k}={v:.0f}" for k, v in self.length_percentiles.items())
        extra = ""
        if self.not_tokenised:
            extra += f"; {self.not_tokenised} of them too long in characters to tokenise"
        if self.dropped_by_subset and any(self.dropped_by_subset):
            extra += "; dropped per subset: " + ", ".join(f"{k}={v}" for k, v in self.dropped_by_subset.items())
        if self.unsplittable:
            extra += f"; {self.unsplittable} unsplittable rows dropped while loading"
        if self.identical_dropped:
            extra += f"; {self.identical_dropped} pairs with chosen identical to rejected dropped from training"
        counted = f" (token lengths {pct})" if pct else ""
        return (f"{self.dataset}: {self.after}/{self.before} {self.unit} kept, {self.dropped} dropped by the "
                f"max_length={self.max_length} filter{counted}{extra}")


# The length of a text dropped by the character bound: it was not tokenised, and it exceeds every max_length.
NOT_TOKENISED = np.iinfo(np.int64).max


def _row_lengths(frame: pd.DataFrame, lengths) -> tuple[np.ndarray, np.ndarray]:
    """(longest rendered prompt+completion per row, every rendered length) for any kind of contract frame;
    ``lengths(prompts, completions)`` gives the lengths of the rendered conversations."""
    kind = data_kind(frame)
    if kind == "kwise":
        k = frame["completions"].map(len).to_numpy()
        prompts = list(np.repeat(frame["prompt"].to_numpy(), k))
        flat = [c for cs in frame["completions"] for c in cs]
        every = lengths(prompts, flat)
        return np.maximum.reduceat(every, np.concatenate([[0], np.cumsum(k)[:-1]])), every
    if kind == "pointwise":
        every = lengths(list(frame["prompt"]), list(frame["response"]))
        return every, every
    n = len(frame)
    both = lengths(list(frame["prompt"]) * 2, list(frame["chosen"]) + list(frame["rejected"]))
    return np.maximum(both[:n], both[n:]), both


def _count_unless_too_long(count, bound, max_length: int):
    """``count``, except that texts the bound shows longer than ``max_length`` tokens get :data:`NOT_TOKENISED`
    without reaching the tokenizer (a 30 MB text took minutes and gigabytes to count, only to be dropped)."""
    def bounded(texts: list[str]) -> np.ndarray:
        over = bound.too_long(texts, max_length)
        lengths = np.full(len(texts), NOT_TOKENISED, dtype=np.int64)
        if not over.all():
            lengths[~over] = count([text for text, drop in zip(texts, over) if not drop])
        return lengths
    return bounded


def filter_by_length(frame: pd.DataFrame, tokenizer, max_length: int, dataset: str, count=None, bound=None,
                     dropped_before_loading: Sequence[str] = (), lengths=None) -> tuple[pd.DataFrame, FilterReport]:
    """Drop rows whose longest rendered prompt+completion exceeds ``max_length`` tokens (never truncate).

    A pair is dropped if prompt+chosen or prompt+rejected is too long; a K-wise row if any of its completions is.
    ``count(texts) -> lengths`` counts tokens (default: the tokenizer directly; runs pass a cached
    :class:`~rewarduq_exp.models.token_counter.TokenCounter`). ``bound`` (the tokenizer's
    :class:`~rewarduq_exp.models.token_counter.TokenLowerBound`, None: none) drops texts too long in characters
    before they are counted. ``dropped_before_loading``: the subset of each row the loader already dropped as too
    long (counted in the report as dropped by this filter). ``lengths(prompts, completions)``, when given, replaces
    rendering and counting (``tokenizer``, ``count`` and ``bound`` are then unused): the lengths of the rendered
    conversations, :data:`NOT_TOKENISED` where the bound drops them (runs pass
    :meth:`~rewarduq_exp.models.conversation_index.ConversationIndex.lengths`, which renders only what it has not
    recorded).
    """
    if lengths is None:
        count = count or (lambda texts: token_lengths(tokenizer, texts))
        if bound is not None:
            count = _count_unless_too_long(count, bound, max_length)
        lengths = lambda prompts, completions: count(render_all(tokenizer, prompts, completions))  # noqa: E731
    longest, every = _row_lengths(frame, lengths)
    keep = longest <= max_length
    dropped = Counter(frame.loc[~keep, "subset"].astype(str)) + Counter(map(str, dropped_before_loading))
    counted = every[every != NOT_TOKENISED]
    report = FilterReport(
        dataset=dataset,
        before=len(frame) + len(dropped_before_loading),
        after=int(keep.sum()),
        max_length=max_length,
        dropped_by_subset={k: int(v) for k, v in dropped.most_common()},
        length_percentiles={str(q): float(np.percentile(counted, q)) for q in (50, 90, 99, 100)} if counted.size
        else {},
        unit={"pairs": "pairs", "kwise": "prompts", "pointwise": "responses"}[data_kind(frame)],
        not_tokenised=int((longest == NOT_TOKENISED).sum()) + len(dropped_before_loading),
    )
    if report.after == 0:
        longest_counted = f"longest counted {int(counted.max())}" if counted.size else "none fits"
        raise UserError(
            f"dataset '{dataset}' is empty after the length filter: all {report.before} rows exceed "
            f"max_length={max_length} tokens ({longest_counted}); raise max_length"
        )
    return frame.loc[keep].reset_index(drop=True), report
