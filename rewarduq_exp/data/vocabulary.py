"""The fixed word list of the synthetic preference world (shared with the tiny tokenizer).

Words are pronounceable two-syllable strings built by a fixed rule (no RNG), so the tokenizer corpus and the
world agree on every machine and every library version.
"""

_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]  # 70 syllables


def _words(n: int, stride: int, syllables: int) -> list[str]:
    pool = len(_SYLLABLES) ** syllables
    out, seen, i = [], set(), 0
    while len(out) < n:
        k, parts = (i * stride) % pool, []
        for _ in range(syllables):
            k, r = divmod(k, len(_SYLLABLES))
            parts.append(_SYLLABLES[r])
        word = "".join(parts)
        if word not in seen:
            seen.add(word)
            out.append(word)
        i += 1
    return out


WORDS: list[str] = _words(256, stride=19, syllables=2)
"""Completion tokens; the world uses the first ``vocab_size`` of them."""

TOPIC_WORDS: list[str] = _words(16, stride=7919, syllables=3)
"""Prompt topics; the reward of a word may depend on the topic of the prompt."""
