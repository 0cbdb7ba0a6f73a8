"""What each conversation renders to under one tokenizer, recorded beside the features, so that a run whose features
and token counts are all known loads no tokenizer (and never imports transformers) and renders no chat template.

Features are stored per rendered TEXT (:mod:`rewarduq_exp.models.feature_cache`: a row's key is a hash of the text the
chat template renders) and the length filter counts the tokens of rendered texts. Finding either by the text means
rendering every conversation of every split on every run (about 0.8 s for the default run's 46K conversations, after
0.6 s importing transformers to load the tokenizer), even when nothing is computed. So the first run that renders a
conversation records what rendering gave: the text's feature key, its length in characters (and, where the tokenizer
normalises, in normalised characters: the length filter's lower bound reads both) and its token count. Later runs
find these facts by a hash of the conversation as given and load the tokenizer only for what is not recorded yet.

A conversation's key is a hash of ``repr(prompt + completion)``, the message list the template receives, in its own
order (a template may iterate a message's keys). repr is exact for the plain values messages hold (str, int, float,
bool, None in dicts, lists and tuples): two conversations with the same repr are the same messages, so they render to
the same text. A conversation holding anything else (a numpy array, an object) gets no key: it is rendered on every
run, as before, and never recorded.

The facts hold for one renderer only. They live in ``<features>/conversations/<hash>/``, the hash of the tokenizer's
files (chat template, vocabulary, special tokens, config), the versions of the libraries that render and tokenise
(transformers, tokenizers, jinja2) and :data:`INDEX_VERSION`: a changed file or library renders once more and
records anew. The features themselves stay keyed by the text, so a text that renders as before still finds its row,
and feature shards written before this index existed serve it unchanged (the first run afterwards renders once to
record the facts, and says so in one line). Where the tokenizer's files cannot be found without loading it (a hub
model not in the local cache yet) or the template reads the clock (``strftime_now``: its text changes with the
date), nothing is recorded and every conversation is rendered, as before.

Records are shard files (safetensors: 16-byte conversation keys, 16-byte text keys, the lengths), written to a
temporary name and renamed, under a file lock named after the conversations being recorded, so that sweep jobs
asking for the same ones render them once.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from importlib import metadata
from itertools import repeat
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from rewarduq_exp.core import file_locks
from rewarduq_exp.core.atomic_write import atomic_path, write_atomic
from rewarduq_exp.core.hashing import stable_hash
from rewarduq_exp.data.contract import NOT_TOKENISED, render_all, token_lengths
from rewarduq_exp.models.feature_cache import TEXT_KEY_BYTES, text_key, unread_shards

log = logging.getLogger("rewarduq_exp")

# Bump when what is recorded changes meaning (how texts are rendered or counted, the lower bound's rules): part of
# every folder's identity, so records of an older meaning are never read.
INDEX_VERSION = 1
KEY_BYTES = 16
UNKNOWN = -1  # a length not measured yet
CHARS, NORMALISED, TOKENS = range(3)  # the columns of the recorded lengths
# The files a tokenizer is read from (AutoTokenizer reads config.json to choose its class); weights are not.
TOKENIZER_FILE_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "chat_template*", "vocab*",
                           "merges*", "*.model", "*.tiktoken", "config.json", "additional_chat_templates/*")
LIBRARIES = ("transformers", "tokenizers", "jinja2")
_LEAVES = frozenset((str, int, float, bool, type(None)))


def _plain(value) -> bool:
    """Whether ``value`` is made of plain values only, whose repr is exact (see the module docstring)."""
    kind = type(value)
    if kind in _LEAVES:
        return True
    if kind is dict:
        return all(type(k) in _LEAVES and _plain(v) for k, v in value.items())
    if kind is list or kind is tuple:
        return all(map(_plain, value))
    return False


def conversation_keys(prompts, completions) -> list[bytes | None]:
    """The key of each conversation ``prompt + completion`` as the template receives it; None for one that holds
    something other than plain values (it is then rendered every time, never recorded). One loop for all of them:
    a run keys 46K conversations twice (length filter, features), so each costs a few microseconds, not more."""
    sha256, plain_types = hashlib.sha256, _LEAVES.issuperset
    keys = []
    for prompt, completion in zip(prompts, completions):
        messages = [*prompt, *completion]
        for message in messages:
            # the common case (a dict of strings) without a Python call per value; anything else is checked in full
            if (type(message) is not dict or not plain_types(map(type, message.values()))
                    or not plain_types(map(type, message))) and not _plain(message):
                keys.append(None)
                break
        else:
            keys.append(sha256(repr(messages).encode()).digest()[:KEY_BYTES])
    return keys


def tokenizer_fingerprint(folder: Path) -> str | None:
    """A hash of the tokenizer files in ``folder`` (names and contents); None when there are none, or when the chat
    template reads the clock (its text then depends on the day it is rendered)."""
    files = sorted({p for pattern in TOKENIZER_FILE_PATTERNS for p in folder.glob(pattern) if p.is_file()})
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        content = path.read_bytes()
        if b"strftime_now" in content:
            return None
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(content).digest())
    return digest.hexdigest()[:32]


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class BoundFacts:
    """What the length filter needs of the tokenizer's lower bound
    (:class:`~rewarduq_exp.models.token_counter.TokenLowerBound`) once the texts' lengths are recorded."""

    chars_per_token: int
    normalizes: bool
    contents_verbatim: bool

    def char_limit(self, max_length: int) -> int:
        return max_length * self.chars_per_token

    def content_char_limit(self, max_length: int) -> int | None:
        """As :meth:`TokenLowerBound.content_char_limit`."""
        if self.normalizes or not self.contents_verbatim:
            return None
        return self.char_limit(max_length)


class ConversationIndex:
    """The recorded facts of one backbone's tokenizer, in ``root`` (None: record nothing, render every time);
    token counts of a miss go through the token-count cache ``token_cache`` (None: counted directly)."""

    def __init__(self, backbone, root: str | Path | None, token_cache: str | Path | None = None):
        self.backbone = backbone
        self.root = Path(root) if root is not None else None
        self.token_cache = Path(token_cache) if token_cache is not None else None
        self.stats = {"rendered": 0, "recorded": 0}
        self._folder: Path | None = None
        self._resolved = False
        self._counter = None
        self._identity: dict | None = None
        self._checked_after_load = False
        self._logged = False
        self._bound: BoundFacts | None | str = "unknown"
        self._reset()

    def _reset(self) -> None:
        self._row: dict[bytes, int] = {}
        self._text_keys: list[bytes] = []
        self._lengths = np.zeros((0, 3), dtype=np.int64)
        self._read: set[str] = set()

    # ------------------------------------------------------------------------------------------- where, for whom
    def identity(self) -> dict | None:
        """What the records depend on, found without loading the tokenizer; None where it cannot be."""
        folder = self.backbone.tokenizer_folder()
        fingerprint = tokenizer_fingerprint(folder) if folder is not None else None
        if fingerprint is None:
            return None
        return {"index_version": INDEX_VERSION, "tokenizer_files": fingerprint,
                "libraries": {name: _version(name) for name in LIBRARIES}}

    @property
    def folder(self) -> Path | None:
        if not self._resolved:
            self._resolved = True
            self._use(self.identity())
        return self._folder

    def _use(self, identity: dict | None) -> None:
        self._folder = (self.root / stable_hash(identity, n=24)) if self.root is not None and identity else None
        self._identity = identity
        self._bound = "unknown"
        self._reset()

    def _tokenizer(self):
        """The tokenizer, loaded now; the records' folder is looked up again after loading, since loading a hub
        model can fetch newer files than those the folder was named after (records must describe what renders)."""
        tokenizer = self.backbone.tokenizer
        if self.root is not None and not self._checked_after_load:
            self._checked_after_load = True
            _ = self.folder  # the identity before loading, if not asked for yet
            identity = self.identity()
            if identity != self._identity:
                self._use(identity)
        return tokenizer

    # ------------------------------------------------------------------------------------------- the lower bound
    def bound(self) -> BoundFacts | None:
        """The tokenizer's lower bound of token counts (None: it has none), recorded once per folder."""
        if self._bound != "unknown":
            return self._bound
        folder = self.folder
        path = folder / "bound.json" if folder is not None else None
        if path is not None and path.exists():
            try:
                stored = json.loads(path.read_text())["bound"]
                self._bound = BoundFacts(**stored) if stored is not None else None
                return self._bound
            except (OSError, ValueError, KeyError, TypeError):  # a damaged record: measured again below
                pass
        bound = self._real_bound()
        self._bound = (BoundFacts(bound.chars_per_token, bound.normalize is not None, bound.contents_verbatim)
                       if bound is not None else None)
        if self.folder is not None:  # (loading the tokenizer may have moved to another folder)
            write_atomic(self.folder / "bound.json",
                         json.dumps({"bound": vars(self._bound) if self._bound is not None else None}))
        return self._bound

    def _real_bound(self):
        from rewarduq_exp.models.token_counter import token_lower_bound

        return token_lower_bound(self._tokenizer())

    def content_char_limit(self, max_length: int) -> int | None:
        bound = self.bound()
        return bound.content_char_limit(max_length) if bound is not None else None

    # ------------------------------------------------------------------------------------------- lookups
    def text_keys(self, prompts: list, completions: list) -> tuple[list[bytes], dict[int, str]]:
        """The feature-cache key of each conversation's rendered text, and the texts rendered to find them (by
        index: what was not recorded yet)."""
        keys = conversation_keys(prompts, completions)
        rendered = self._complete(keys, prompts, completions, None)
        return [self._text_keys[self._row[k]] if k in self._row else text_key(rendered[i])
                for i, k in enumerate(keys)], rendered

    def lengths(self, prompts: list, completions: list, max_length: int) -> np.ndarray:
        """Token counts of the rendered conversations, :data:`NOT_TOKENISED` for those the lower bound shows longer
        than ``max_length`` (the same numbers as counting the rendered texts with the bound)."""
        keys = conversation_keys(prompts, completions)
        fresh = self._complete(keys, prompts, completions, max_length)
        facts = self._facts(keys)
        for i, row in fresh.items():
            facts[i] = row
        over = self._over(facts, max_length)
        return np.where(over, NOT_TOKENISED, facts[:, TOKENS])

    # ------------------------------------------------------------------------------------------- the records
    def _facts(self, keys: list[bytes | None]) -> np.ndarray:
        rows = np.fromiter(map(self._row.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))
        facts = np.full((len(keys), 3), UNKNOWN, dtype=np.int64)
        known = rows >= 0
        facts[known] = self._lengths[rows[known]]
        return facts

    def _over(self, facts: np.ndarray, max_length: int) -> np.ndarray:
        """What the lower bound drops as too long (as ``TokenLowerBound.too_long`` decides from the texts)."""
        bound = self.bound()
        if bound is None:
            return np.zeros(len(facts), dtype=bool)
        limit = bound.char_limit(max_length)
        over = facts[:, CHARS] > limit
        return over & (facts[:, NORMALISED] > limit) if bound.normalizes else over

    def _incomplete(self, keys: list[bytes | None], max_length: int | None) -> np.ndarray:
        """Indices of the conversations whose facts are not all recorded (for the length filter at ``max_length``,
        or only their text keys when None)."""
        # the bound first: finding it may load the tokenizer, which may move the records to another folder
        bound = self.bound() if max_length is not None else None
        facts = self._facts(keys)
        missing = facts[:, CHARS] == UNKNOWN
        if max_length is not None:
            if bound is not None and bound.normalizes:  # a long text's normalised length decides
                missing |= (facts[:, CHARS] > bound.char_limit(max_length)) & (facts[:, NORMALISED] == UNKNOWN)
            missing |= ~self._over(facts, max_length) & (facts[:, TOKENS] == UNKNOWN)
        return np.flatnonzero(missing)

    def _complete(self, keys, prompts, completions, max_length: int | None) -> dict:
        """Render and measure what is not recorded, and record it; returns ``{index: text}`` (text keys only) or
        ``{index: lengths row}`` (``max_length`` given) of the conversations measured now."""
        if self.folder is not None:
            self._refresh()
        if not len(self._incomplete(keys, max_length)):
            return {}
        self._tokenizer()  # first: loading it may change the folder the records belong in
        folder = self.folder
        if folder is None:  # nothing recorded, nothing to record: every conversation measured, as before
            return self._measure(np.arange(len(keys)), keys, prompts, completions, max_length)
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / "meta.json").exists():
            write_atomic(folder / "meta.json", json.dumps(self._identity, indent=1))
        self._refresh()
        todo = self._incomplete(keys, max_length)
        name = hashlib.sha256(b"".join(keys[i] or b"" for i in todo)).hexdigest()[:24]
        with file_locks.held(folder / f"{name}.lock", "the conversations another process is rendering"):
            self._refresh()  # another job may have recorded them while we waited for the lock
            todo = self._incomplete(keys, max_length)
            if not len(todo):
                return {}
            if not self._logged:  # once per process: a run asks for several splits
                self._logged = True
                log.info("conversation index: rendering %d conversations not recorded yet for this tokenizer (in "
                         "%s), once: cached features stay valid, and runs that find every conversation recorded load "
                         "no tokenizer", len(todo), folder)
            return self._measure(todo, keys, prompts, completions, max_length)

    def _measure(self, todo: np.ndarray, keys, prompts, completions, max_length: int | None) -> dict:
        tokenizer = self._tokenizer()
        texts = render_all(tokenizer, [prompts[i] for i in todo], [completions[i] for i in todo])
        self.stats["rendered"] += len(texts)
        facts = np.full((len(texts), 3), UNKNOWN, dtype=np.int64)
        facts[:, CHARS] = [len(t) for t in texts]
        if max_length is not None:
            bound = self._real_bound()
            over = np.zeros(len(texts), dtype=bool)
            if bound is not None:
                limit = max_length * bound.chars_per_token
                over = facts[:, CHARS] > limit
                if bound.normalize is not None:  # only the candidates, as TokenLowerBound.too_long does
                    for j in np.flatnonzero(over):
                        facts[j, NORMALISED] = len(bound.normalize(texts[j]))
                    over &= facts[:, NORMALISED] > limit
            if not over.all():
                facts[~over, TOKENS] = self._count([t for t, drop in zip(texts, over) if not drop])
        self._record([keys[i] for i in todo], [text_key(t) for t in texts], facts)
        if max_length is None:
            return {int(i): t for i, t in zip(todo, texts)}
        return {int(i): facts[j] for j, i in enumerate(todo)}

    def _count(self, texts: list[str]) -> np.ndarray:
        if self.token_cache is None:
            return token_lengths(self._tokenizer(), texts)
        if self._counter is None:
            from rewarduq_exp.models.token_counter import TokenCounter

            self._counter = TokenCounter(self._tokenizer(), self.backbone.identity(), self.token_cache)
        return self._counter(texts)

    def token_count_stats(self) -> dict:
        """The token-count cache's hits and misses (none when nothing had to be counted)."""
        return dict(self._counter.stats) if self._counter is not None else {"hits": 0, "misses": 0}

    def _record(self, keys: list[bytes | None], text_keys: list[bytes], facts: np.ndarray) -> None:
        """Add measured rows (each conversation once; those without a key are not recorded) and write them as a
        shard named after its content (writing the same rows twice is one file)."""
        first: dict[bytes, int] = {}
        for j, key in enumerate(keys):
            if key is not None:
                first.setdefault(key, j)
        if self.folder is None or not first:
            return
        at = np.fromiter(first.values(), dtype=np.int64, count=len(first))
        conv = np.frombuffer(b"".join(first), dtype=np.uint8).reshape(-1, KEY_BYTES).copy()
        texts = np.frombuffer(b"".join(text_keys[j] for j in at), dtype=np.uint8).reshape(-1, TEXT_KEY_BYTES).copy()
        lengths = np.ascontiguousarray(facts[at])
        name = hashlib.sha256(conv.tobytes() + texts.tobytes() + lengths.tobytes()).hexdigest()[:24]
        path = self.folder / f"facts-{name}.safetensors"
        with atomic_path(path) as tmp:
            save_file({"conversations": conv, "texts": texts, "lengths": lengths}, str(tmp))
        self._merge(conv, texts, lengths)
        self._read.add(path.name)
        self.stats["recorded"] += len(first)

    def _refresh(self) -> None:
        """Read the shards written since the last call (by this or any other process)."""
        for path in unread_shards(self.folder, "facts-", self._read):
            try:
                shard = load_file(str(path))
                conv, texts, lengths = shard["conversations"], shard["texts"], shard["lengths"]
                if not (conv.shape[0] == texts.shape[0] == lengths.shape[0] and lengths.shape[1:] == (3,)):
                    raise ValueError("inconsistent shapes")
            except Exception as err:  # noqa: BLE001 (a damaged record only costs rendering again)
                log.warning("conversation index: %s cannot be read (%s); its conversations will be rendered again "
                            "(delete the file to silence this)", path, type(err).__name__)
                self._read.add(path.name)
                continue
            self._merge(conv, texts, lengths)
            self._read.add(path.name)

    def _merge(self, conv: np.ndarray, texts: np.ndarray, lengths: np.ndarray) -> None:
        """Index rows; a conversation recorded twice keeps every length either record measured (a length is the
        same number whenever it is measured, so the larger of UNKNOWN and it is it)."""
        known = len(self._text_keys)
        row_of = self._row
        # setdefault gives a new key the next row number (len before inserting), an old one its row
        rows = np.fromiter((row_of.setdefault(k, len(row_of)) for k in conv.view(f"V{KEY_BYTES}").ravel().tolist()),
                           dtype=np.int64, count=len(conv))
        new = np.flatnonzero(rows >= known)
        if len(new):
            _, first = np.unique(rows[new], return_index=True)  # in row order: the order they were numbered
            text_keys = texts.view(f"V{TEXT_KEY_BYTES}").ravel().tolist()
            self._text_keys.extend(text_keys[j] for j in new[first])
            self._lengths = np.concatenate([self._lengths, np.full((len(first), 3), UNKNOWN, dtype=np.int64)])
        np.maximum.at(self._lengths, rows, lengths.astype(np.int64, copy=False))
