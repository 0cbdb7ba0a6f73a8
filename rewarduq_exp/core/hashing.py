"""Stable hashes: run identities (config hashes) and every cache key (features, token counts) come from here."""

from __future__ import annotations

import hashlib
import json


def stable_hash(obj, n: int = 16) -> str:
    """Hash of a JSON-able object, independent of dict order (run identities and cache keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def texts_fingerprint(texts: list[str]) -> str:
    """Hash of a list of texts, order included (a text boundary can not be confused with a character)."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]
