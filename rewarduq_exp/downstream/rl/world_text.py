"""The synthetic world's gold and shortcut features of any text a policy writes.

A policy samples free text, not the world's word indices: its gold is read off the words of the text. Words of the
world's vocabulary carry their utilities exactly as :meth:`SyntheticWorld.true_reward` weighs them (so the gold of a
candidate's text equals the world's gold of the same words, tested); a word the world does not know (a fragment an
untrained policy may write) says nothing: utility 0, counted as a word. Once a filler option is on, the filler is left
out of the mean (adding fillers never changes the gold) and a text without any other word has gold 0.
"""

from __future__ import annotations

import numpy as np


class WorldText:
    """``gold(topics, texts)`` and ``features(texts)`` of one synthetic world, vectorised over texts."""

    def __init__(self, world):
        self.world = world
        self.index = {word: i for i, word in enumerate(world.words)}
        self.unknown = world.vocab_size   # one extra column of utility 0
        self.global_utility = np.append(world.global_utility, 0.0)
        self.topic_utility = np.concatenate([world.topic_utility, np.zeros((world.num_topics, 1))], axis=1)

    def tokens(self, texts) -> tuple[np.ndarray, np.ndarray]:
        rows = [[self.index.get(word, self.unknown) for word in text.split()] for text in texts]
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        tokens = np.full((len(rows), max(1, int(lengths.max(initial=0)))), self.unknown, dtype=np.int64)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = r
        return tokens, lengths

    def gold(self, topics, texts) -> np.ndarray:
        """The world's true reward of each text under its prompt's topic (see the module docstring)."""
        world = self.world
        topics = np.asarray(topics, dtype=np.int64)
        tokens, lengths = self.tokens(texts)
        utility = self.global_utility[tokens] + world.prompt_dependence * self.topic_utility[topics[:, None], tokens]
        mask = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
        if world.filler_ignored:
            mask &= tokens != world.filler_word
        counted = mask.sum(1)
        return world.utility_scale * (utility * mask).sum(1) / np.maximum(counted, 1)

    def features(self, texts) -> dict[str, np.ndarray]:
        """The features the gold ignores ("words", "filler"), measured as for the world's own candidates."""
        return self.world.text_features(texts)
