"""Token counts of rendered conversations for the length filter: exact counts cached on disk, and a lower bound
from the number of characters that rejects what no ``max_length`` can admit without tokenising it.

Counting tokens of a large dataset is the slow part of preparing it (about 4 s per 10K texts of 800 tokens on a
2-core CPU, so about 50 s for UltraFeedback's 124K texts). Every job of a sweep filters the same data with the same
tokenizer, so the counts are cached like features: keyed by the backbone identity and a fingerprint of the exact
rendered texts, written atomically under a lock, computed once by whichever job gets there first.

One huge row costs far more: tokenising a 30 MB text took up to two minutes and 8 GB before it was dropped.
:class:`TokenLowerBound` drops such texts from their length alone (see :func:`token_lower_bound` for why the bound
holds), and tells loaders how many characters of message contents no row can exceed, so that they can drop such
rows before their texts become Python objects.
"""

from __future__ import annotations

import json
import unicodedata
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rewarduq_exp.core.hashing import stable_hash, texts_fingerprint
from rewarduq_exp.data.contract import COUNTED_ROLES, render, token_lengths
from rewarduq_exp.models.feature_cache import FeatureCache


class TokenCounter:
    def __init__(self, tokenizer, identity: dict, cache_dir: str | Path | None = None):
        self.tokenizer = tokenizer
        self.identity = identity
        self.cache = FeatureCache(cache_dir) if cache_dir is not None else None
        self.stats = {"hits": 0, "misses": 0}

    def __call__(self, texts: list[str]) -> np.ndarray:
        if self.cache is None:
            return token_lengths(self.tokenizer, texts)
        meta = {"token_lengths_of": self.identity, "texts": texts_fingerprint(texts), "n": len(texts)}
        counts, hit = self.cache.get_or_compute(
            stable_hash(meta, n=24), lambda: torch.from_numpy(token_lengths(self.tokenizer, texts)), meta)
        self.stats["hits" if hit else "misses"] += 1
        return counts.numpy()


@dataclass(frozen=True)
class TokenLowerBound:
    """A text of more than ``max_length * chars_per_token`` characters has more than ``max_length`` tokens.

    ``normalize``: the tokenizer's normaliser, when it has one; it can shorten a text (NFC composes a letter and its
    accent into one character), so a text is only judged by its normalised length. ``contents_verbatim``: the chat
    template renders every message's content unchanged, so the contents of a conversation are no longer than its
    rendered text (see :func:`content_char_limit`).
    """

    chars_per_token: int
    normalize: Callable[[str], str] | None = None
    contents_verbatim: bool = False

    def too_long(self, texts: list[str], max_length: int) -> np.ndarray:
        """Which ``texts`` certainly have more than ``max_length`` tokens (the others may or may not)."""
        limit = max_length * self.chars_per_token
        over = np.fromiter((len(text) > limit for text in texts), dtype=bool, count=len(texts))
        if self.normalize is not None:  # only the few candidates: normalising is linear, but not free
            for i in np.flatnonzero(over):
                over[i] = len(self.normalize(texts[i])) > limit
        return over

    def content_char_limit(self, max_length: int) -> int | None:
        """The number of characters of message contents (of :data:`~rewarduq_exp.data.contract.COUNTED_ROLES`) above
        which a conversation cannot fit ``max_length`` tokens, or None when the contents do not bound the rendered
        text: the template changes them (Qwen3's drops earlier turns' ``<think>`` blocks, Llama 3's trims
        whitespace) or the tokenizer normalises the text first."""
        if self.normalize is not None or not self.contents_verbatim:
            return None
        return max_length * self.chars_per_token


_BOUNDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> bound, computed once per tokenizer


def token_lower_bound(tokenizer) -> TokenLowerBound | None:
    """The character bound of ``tokenizer``'s token counts, or None where it is not known to hold.

    Why it holds: tokenising a text cuts its normalised form into pieces, one per token, and every piece is at most
    as many characters long as the token's raw string in the vocabulary. In byte-level BPE (GPT-2, Llama 3, Qwen,
    the tiny test model) each character of a raw token stands for one byte, and a piece of n bytes has at most n
    characters (a UTF-8 character takes 1-4 bytes); with SentencePiece-style BPE a raw token is its piece with
    spaces shown as "▁", or "<0xNN>" for one byte; an added token (``<|im_start|>``) is matched as its own string.
    So a text of c characters takes at least c / (longest raw token) tokens. For the tiny model this was checked
    token by token: no token of its 1106 decodes to more characters than its raw string (the longest,
    ``<|endoftext|>``, has 13). The bound fails where a token can stand for more than its string: WordPiece and
    Unigram vocabularies ([UNK] for a whole word), BPE fusing unknown characters into one [UNK], pre-tokenizers
    that delete text (whitespace splitting), added tokens that swallow the whitespace around them; those get None,
    and every text is tokenised as before.
    """
    if tokenizer in _BOUNDS:
        return _BOUNDS[tokenizer]
    backend = getattr(tokenizer, "backend_tokenizer", None)  # slow (Python) tokenizers: no bound
    bound = None
    if backend is not None:
        state = json.loads(backend.to_str())
        if _tokens_cover_at_most_their_string(state):
            bound = TokenLowerBound(chars_per_token=max(map(len, tokenizer.get_vocab())),
                                    normalize=_normaliser(state.get("normalizer"), backend),
                                    contents_verbatim=_renders_contents_verbatim(tokenizer))
    _BOUNDS[tokenizer] = bound
    return bound


def _tokens_cover_at_most_their_string(state: dict) -> bool:
    """The conditions of :func:`token_lower_bound`, read from the tokenizer's own description (``tokenizer.json``)."""
    model = state.get("model") or {}
    if model.get("type") != "BPE":
        return False
    if model.get("unk_token") and model.get("fuse_unk") and not model.get("byte_fallback"):
        return False
    if any(token.get("lstrip") or token.get("rstrip") for token in state.get("added_tokens") or ()):
        return False

    def keeps_text(pre) -> bool:
        if pre is None:
            return True
        if pre.get("type") == "Sequence":
            return all(map(keeps_text, pre.get("pretokenizers") or ()))
        if pre.get("type") in ("Split", "Punctuation"):
            return pre.get("behavior") != "Removed"
        return pre.get("type") in ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts")

    return keeps_text(state.get("pre_tokenizer"))


def _normaliser(spec: dict | None, backend) -> Callable[[str], str] | None:
    if spec is None:
        return None
    if spec.get("type") in ("NFC", "NFD", "NFKC", "NFKD"):  # Qwen's NFC: Python's is the same form, and far lighter
        return lambda text: unicodedata.normalize(spec["type"], text)  # (tokenizers' keeps 16 bytes per byte)
    return backend.normalizer.normalize_str


def _renders_contents_verbatim(tokenizer) -> bool:
    """Whether the chat template renders each message's content unchanged, tried on the changes real templates make:
    stripping whitespace and newlines, dropping the ``<think>`` block of an assistant turn. A template that fails on
    the probe (one without a system role) counts as changing them."""
    # Whitespace and newlines around every content, a reasoning block in both assistant turns; one core per turn.
    probes = {"system": "  system text {} \n\n", "user": "\n\n user text {}  ",
              "assistant": "<think>\nreasoning {}\n</think>\n\n answer {} \n"}
    turns = [{"role": role, "content": probes[role].format(i, i)}
             for i, role in enumerate((*COUNTED_ROLES, "user", "assistant"))]
    try:
        text = render(tokenizer, turns[:-1], turns[-1:])
    except Exception:
        return False
    position = 0
    for turn in turns:  # each one whole, in order
        position = text.find(turn["content"], position)
        if position < 0:
            return False
        position += len(turn["content"])
    return True
