"""The synthetic preference world (``dataset=synthetic``): preference data whose ground truth is known.

No public anchor dataset tells us the true reward of a completion; this world does. A completion is a sequence of
words, each with a hidden utility; its true reward is ``utility_scale`` times the mean utility of its words, where a
word's utility is a global part plus ``prompt_dependence`` times a part that depends on the prompt's topic. For each
pair, the label is sampled from the Bradley-Terry model ``P(y1 > y2) = sigmoid((r1 - r2) / noise_scale)``; so some
labels disagree with the true reward, exactly as human labels do. Every pair records its true margin (chosen minus
rejected, in logit units) and true preference probability, so metrics can be checked against the truth.

Splits: ``train`` and ``eval`` draw words from a Zipf distribution over the common words (the rare tail is almost
never seen); ``ood`` builds completions mostly from the rare tail, where a model has seen little data and its
epistemic uncertainty should be larger. ``cal`` (``n_cal`` pairs; ``n_cal=0``: none) is the calibration split
(:mod:`rewarduq_exp.data.calibration_split`): drawn exactly like ``eval``, from a random stream of its own, for
post-hoc recalibration; it is not evaluated by default. Everything is a pure function of the seed and the sizes, and
each split of its own size only: adding ``cal`` left train, eval and ood as they were.

A known spurious feature (default off): with ``length_bias`` > 0 the labels of the *training* pairs add
``length_bias`` log-odds per word that the first completion is longer, while the true reward (a mean over words)
ignores length; eval and ood labels follow the true reward. ``candidate_max_words`` lets best-of-n candidates
(:meth:`candidates`) run far longer than any training completion, so a proxy that learned "longer is better" meets
candidates that exploit the shortcut beyond the range it was trained on. The same with a word: with ``filler_bias``
the training labels add that many log-odds per extra occurrence of the filler (the most frequent word), and
``candidate_filler_share`` stuffs a heavy-tailed share of best-of-n candidates with it, a filler inserted after up to
that share of their words: rare candidates, far beyond any training completion (in filler count and in length), that
a proxy which learned the shortcut ranks first. Once either filler option is on, the true reward ignores the filler
entirely: it is ``utility_scale`` times the mean utility of the *other* words, so adding fillers to a completion leaves
its true reward exactly unchanged (the shortcut is neutral to the gold, neither rewarded nor punished), and a
completion made only of fillers says nothing and has true reward 0. With all four at their defaults the world is
exactly the one without them (same draws, same rewards).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy.special import expit  # overflow-free sigmoid

from rewarduq_exp.core.checks import check_integer
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.host_memory import check_fits_host
from rewarduq_exp.data.calibration_split import CAL_SPLIT, no_cal_split
from rewarduq_exp.data.contract import make_pointwise_frame, make_preference_frame
from rewarduq_exp.data.vocabulary import TOPIC_WORDS, WORDS

SPLITS = ("train", "eval", "ood", CAL_SPLIT)


@dataclass
class Candidates:
    """Completions sampled for best-of-n: ``texts[p][i]`` answers ``prompts[p]`` and has true reward ``gold[p, i]``.
    ``features``: per-candidate values, each (P, N) like ``gold``, of features the true reward may ignore (e.g.
    "words": length in words, "filler": occurrences of the filler word), to ask whether a proxy exploits them."""

    topic: np.ndarray          # (P,)
    prompts: list[list[dict]]  # P conversations
    texts: list[list[str]]     # P lists of N completion texts
    gold: np.ndarray           # (P, N) true rewards
    features: dict[str, np.ndarray] = field(default_factory=dict)


# Exponent of the candidates' filler shares (share = candidate_filler_share * U ** FILLER_TAIL, U uniform).
FILLER_TAIL = 12

# Fixed offsets so that the splits use independent random streams of the same world (a new split takes a new one:
# the others' draws never change).
_SPLIT_STREAM = {"train": 1, "eval": 2, "ood": 3, CAL_SPLIT: 4}
# Completions drawn once per rated world to cut its ratings into five equally likely classes.
RATING_CUT_SAMPLE = 20_000


def completions_memory(n: int, max_words: int) -> float:
    """Bytes that drawing ``n`` completions of up to ``max_words`` words needs at least: 20 B per completion and word
    (its word indices, the random draws behind them, the reward's masks: 23 B measured) and 500 B per completion (its
    text and message: 750-1000 B measured for short ones). Rounded down from the measured peaks, so that a refusal is
    never a false alarm."""
    return float(n) * (20.0 * max_words + 500.0)


class SyntheticWorld:
    """Loader for the synthetic world; ``load(split)`` returns a frame in the preference-data contract."""

    name = "synthetic"

    def __init__(
        self,
        seed: int = 0,
        n_train: int = 8000,
        n_eval: int = 1000,
        n_ood: int = 1000,
        n_cal: int = 1000,
        vocab_size: int = 64,
        rare_fraction: float = 0.25,
        rare_weight: float = 0.01,
        ood_rare_share: float = 0.8,
        zipf_exponent: float = 0.5,
        num_topics: int = 8,
        prompt_dependence: float = 0.2,
        utility_scale: float = 6.0,
        noise_scale: float = 1.0,
        min_words: int = 8,
        max_words: int = 12,
        train_split: str = "train",
        eval_splits: tuple[str, ...] = ("eval", "ood"),
        name: str = "synthetic",
        length_bias: float = 0.0,
        candidate_max_words: int | None = None,
        filler_bias: float = 0.0,
        candidate_filler_share: float = 0.0,
    ):
        self.name = name
        # Whole numbers are checked before any int(): int(2.5) would quietly build a world of 2 pairs.
        for key, value in (("n_train", n_train), ("n_eval", n_eval), ("n_ood", n_ood), ("vocab_size", vocab_size),
                           ("num_topics", num_topics), ("min_words", min_words), ("max_words", max_words),
                           ("candidate_max_words", max_words if candidate_max_words is None else candidate_max_words)):
            check_integer(f"dataset.{key}", value, minimum=1)
        check_integer("dataset.n_cal", n_cal, minimum=0)   # 0: no calibration split
        self.seed = int(seed)
        self.sizes = {"train": int(n_train), "eval": int(n_eval), "ood": int(n_ood), CAL_SPLIT: int(n_cal)}
        self.cal_split = CAL_SPLIT if self.sizes[CAL_SPLIT] else None
        self.vocab_size = int(vocab_size)
        self.rare_fraction = float(rare_fraction)
        self.rare_weight = float(rare_weight)
        self.ood_rare_share = float(ood_rare_share)
        self.zipf_exponent = float(zipf_exponent)
        self.num_topics = int(num_topics)
        self.prompt_dependence = float(prompt_dependence)
        self.utility_scale = float(utility_scale)
        self.noise_scale = float(noise_scale)
        self.min_words, self.max_words = int(min_words), int(max_words)
        self.length_bias = float(length_bias)
        self.filler_bias = float(filler_bias)
        self.candidate_filler_share = float(candidate_filler_share)
        self.candidate_max_words = self.max_words if candidate_max_words is None else int(candidate_max_words)
        self.train_split = train_split
        self.eval_splits = tuple(eval_splits)
        self._validate()

        rng = np.random.default_rng([self.seed, 0])
        self.words = WORDS[: self.vocab_size]
        self.topics = TOPIC_WORDS[: self.num_topics]
        self.global_utility = rng.standard_normal(self.vocab_size)
        self.topic_utility = rng.standard_normal((self.num_topics, self.vocab_size))
        # Which words are rare is itself random (not "the last ones"), so rarity is not tied to token ids.
        order = rng.permutation(self.vocab_size)
        n_rare = int(round(self.rare_fraction * self.vocab_size))
        self.rare_words = np.sort(order[:n_rare])
        common = order[n_rare:]
        # The filler: the most frequent word, ignored by the true reward once either filler option is on (left out of
        # the mean, so it neither adds nor dilutes: see true_reward), while the training labelers may like it
        # (filler_bias). Its utilities are zeroed too, so nothing that reads them gives it a value; no draw depends
        # on this, so the world's other utilities are those of the world without the options.
        self.filler_word = int(common[0])
        self.filler_ignored = bool(self.filler_bias or self.candidate_filler_share)
        if self.filler_ignored:
            self.global_utility[self.filler_word] = 0.0
            self.topic_utility[:, self.filler_word] = 0.0
        freq = np.zeros(self.vocab_size)
        freq[common] = 1.0 / np.arange(1, len(common) + 1) ** self.zipf_exponent
        freq[self.rare_words] = self.rare_weight * freq[common].min()
        self.train_word_probs = freq / freq.sum()
        rare_probs = np.zeros(self.vocab_size)
        rare_probs[self.rare_words] = 1.0 / max(n_rare, 1)
        self.ood_word_probs = self.ood_rare_share * rare_probs + (1 - self.ood_rare_share) * self.train_word_probs

    def _validate(self) -> None:
        checks = [
            (self.vocab_size, 2 <= self.vocab_size <= len(WORDS), f"an integer in [2, {len(WORDS)}]",
             "dataset.vocab_size"),
            (self.num_topics, 1 <= self.num_topics <= len(TOPIC_WORDS), f"an integer in [1, {len(TOPIC_WORDS)}]",
             "dataset.num_topics"),
            (self.noise_scale, self.noise_scale > 0, "a number > 0", "dataset.noise_scale"),
            (self.rare_fraction, 0 < self.rare_fraction < 1, "a number in (0, 1)", "dataset.rare_fraction"),
            (self.ood_rare_share, 0 <= self.ood_rare_share <= 1, "a number in [0, 1]", "dataset.ood_rare_share"),
            (self.min_words, 1 <= self.min_words <= self.max_words, "an integer with 1 <= min_words <= max_words",
             "dataset.min_words"),
            (self.length_bias, np.isfinite(self.length_bias), "a finite number (0: labels follow the true reward)",
             "dataset.length_bias"),
            (self.filler_bias, np.isfinite(self.filler_bias), "a finite number (0: labels follow the true reward)",
             "dataset.filler_bias"),
            (self.candidate_filler_share, 0 <= self.candidate_filler_share <= 1, "a number in [0, 1]",
             "dataset.candidate_filler_share"),
            (self.candidate_max_words, self.candidate_max_words >= self.max_words,
             f"an integer >= max_words ({self.max_words}) or null", "dataset.candidate_max_words"),
        ]
        n_rare = int(round(self.rare_fraction * self.vocab_size))
        checks.append((self.rare_fraction, 1 <= n_rare <= self.vocab_size - 1,
                       f"such that rare_fraction * vocab_size ({self.vocab_size}) rounds to 1..{self.vocab_size - 1} "
                       "rare words (the world needs both rare and common words)", "dataset.rare_fraction"))
        for split, n in self.sizes.items():
            if split != CAL_SPLIT:
                checks.append((n, n >= 1, "an integer >= 1", f"dataset.n_{split}"))
        for value, ok, allowed, key in checks:
            if not ok:
                raise UserError(f"{key}={value} is invalid: must be {allowed}")
        for split in (self.train_split, *self.eval_splits):
            self._check_split(split)

    # ------------------------------------------------------------------ memory
    completions_per_row = 2   # a pair: chosen and rejected

    def memory_needed(self, splits=None) -> float:
        """Bytes that generating ``splits`` (default: every split a training run loads) needs at least
        (:func:`completions_memory` per completion); the rows' texts stay while the run goes on, so splits add up."""
        splits = [self.train_split, *self.eval_splits, *([self.cal_split] if self.cal_split else [])] \
            if splits is None else splits
        rows = sum(self.sizes[s] for s in dict.fromkeys(splits))
        return completions_memory(rows * self.completions_per_row, self.max_words)

    def check_memory(self, splits=None) -> None:
        """One line when the rows of ``splits`` cannot fit this host's available memory (before any is drawn)."""
        rows = sum(self.sizes[s] for s in dict.fromkeys(splits or self.sizes))
        check_fits_host(self.memory_needed(splits), f"dataset.n_train={self.sizes['train']} x dataset.max_words="
                        f"{self.max_words} (the synthetic world's {rows:,} rows of up to {self.max_words} words, "
                        "every split loaded)", "dataset.n_train or dataset.max_words")

    def check_candidates_memory(self, n_prompts: int, n_candidates: int) -> None:
        """The same for a best-of-n pool: ``n_prompts`` x ``n_candidates`` completions of up to
        ``candidate_max_words`` words."""
        check_fits_host(completions_memory(int(n_prompts) * int(n_candidates), self.candidate_max_words),
                        f"{n_prompts:,} prompts x {n_candidates:,} candidates of up to {self.candidate_max_words} "
                        "words", "the prompts or candidates (or dataset.candidate_max_words)")

    def _check_split(self, split: str) -> None:
        if split not in SPLITS:
            raise UserError(f"synthetic split '{split}' does not exist; allowed: {', '.join(SPLITS)}")
        if split == CAL_SPLIT and not self.cal_split:
            raise no_cal_split(self.name, "dataset.n_cal=0")

    # ------------------------------------------------------------------ truth
    def true_reward(self, topic: np.ndarray, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Reward of padded word-index arrays ``tokens`` (n, max_words) under ``topic`` (n,): ``utility_scale`` times
        the mean utility of the first ``lengths`` words. Once a filler option is on, the mean is over the words other
        than the filler (adding fillers leaves the reward unchanged), and a completion of fillers only has reward 0."""
        utility = self.global_utility[tokens] + self.prompt_dependence * self.topic_utility[topic[:, None], tokens]
        mask = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
        if not self.filler_ignored:
            return self.utility_scale * (utility * mask).sum(1) / lengths
        mask &= tokens != self.filler_word
        counted = mask.sum(1)
        return self.utility_scale * (utility * mask).sum(1) / np.maximum(counted, 1)   # no words counted: 0

    # ------------------------------------------------------------------ sampling
    def _completions(self, rng: np.random.Generator, n: int, probs: np.ndarray,
                     max_words: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        max_words = self.max_words if max_words is None else max_words
        lengths = rng.integers(self.min_words, max_words + 1, size=n)
        tokens = rng.choice(self.vocab_size, size=(n, max_words), p=probs)
        return tokens, lengths

    def _fillers(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        mask = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
        return ((tokens == self.filler_word) & mask).sum(1)

    def _insert_fillers(self, tokens: np.ndarray, lengths: np.ndarray,
                        stuff: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A filler inserted after every word marked in ``stuff`` (within its length). Inserted, not replacing a
        word: every word of the candidate stays, so its gold (the mean over its non-filler words) is exactly that of
        the unstuffed candidate, and a stuffed candidate's gold has the same distribution as any other's. Replacing
        words would leave fewer words to average, a noisier gold whose extremes a proxy that likes the filler would
        reach more often. Stuffed candidates are longer (up to twice)."""
        n, width = tokens.shape
        stuff = stuff & (np.arange(width)[None, :] < lengths[:, None])
        start = np.cumsum(1 + stuff, axis=1) - (1 + stuff)         # where each original word lands
        out = np.zeros((n, 2 * width), dtype=tokens.dtype)
        rows = np.repeat(np.arange(n), width).reshape(n, width)
        out[rows, start] = tokens
        out[rows[stuff], start[stuff] + 1] = self.filler_word
        return out, lengths + stuff.sum(1)

    def _text(self, tokens: np.ndarray, length: int) -> str:
        return " ".join(self.words[t] for t in tokens[:length])

    def text_features(self, texts) -> dict[str, np.ndarray]:
        """The features the true reward ignores, read off completion texts (so candidates and training completions
        are measured the same way): "words", the length in words, and "filler", the occurrences of the filler word."""
        series = pd.Series(list(texts), dtype=object)
        filler = re.escape(self.words[self.filler_word])
        return {"words": series.str.count(r"\S+").to_numpy(np.int64),
                "filler": series.str.count(rf"(?<!\S){filler}(?!\S)").to_numpy(np.int64)}

    def training_feature_max(self) -> dict[str, float]:
        """The largest value of each :meth:`text_features` feature over the training split's completions (chosen
        and rejected): the range a proxy was trained on."""
        frame = self.load(self.train_split)
        texts = [messages[-1]["content"] for column in ("chosen", "rejected") for messages in frame[column]]
        return {name: float(values.max()) for name, values in self.text_features(texts).items()}

    def prompt(self, topic: int) -> list[dict]:
        return [{"role": "user", "content": f"Topic {self.topics[topic]}: write a reply."}]

    def candidates(self, split: str, n_prompts: int, n_candidates: int, seed: int = 0) -> Candidates:
        """``n_candidates`` completions for each of ``n_prompts`` prompts, drawn from the world's generator for
        ``split`` (the training word distribution for train/eval/cal, the rare-word mixture for ood), with their true
        (gold) rewards: the raw material of best-of-n sampling. Topics are spread evenly over the prompts."""
        self._check_split(split)
        self.check_candidates_memory(n_prompts, n_candidates)
        rng = np.random.default_rng([self.seed, _SPLIT_STREAM[split], 2, int(seed)])
        probs = self.ood_word_probs if split == "ood" else self.train_word_probs
        topic = (np.arange(n_prompts) + rng.integers(self.num_topics)) % self.num_topics
        tokens, lengths = self._completions(rng, n_prompts * n_candidates, probs, self.candidate_max_words)
        if self.candidate_filler_share:
            # Heavy-tailed shares: most candidates hold the filler about as often as training completions do, and
            # the stuffed ones are rare (5.6 % above half the largest share), so only a large n meets them.
            share = self.candidate_filler_share * rng.random(len(tokens)) ** FILLER_TAIL
            stuff = rng.random(tokens.shape) < share[:, None]
            tokens, lengths = self._insert_fillers(tokens, lengths, stuff)
        gold = self.true_reward(np.repeat(topic, n_candidates), tokens, lengths)
        texts = [self._text(tokens[i], lengths[i]) for i in range(len(tokens))]
        features = {name: values.reshape(n_prompts, n_candidates) for name, values in self.text_features(texts).items()}
        return Candidates(topic=topic, prompts=[self.prompt(t) for t in topic],
                          texts=[texts[i * n_candidates:(i + 1) * n_candidates] for i in range(n_prompts)],
                          gold=gold.reshape(n_prompts, n_candidates), features=features)

    def load(self, split: str) -> pd.DataFrame:
        self._check_split(split)
        self.check_memory([split])
        n = self.sizes[split]
        rng = np.random.default_rng([self.seed, _SPLIT_STREAM[split]])
        probs = self.ood_word_probs if split == "ood" else self.train_word_probs
        topic = rng.integers(0, self.num_topics, size=n)
        tok_a, len_a = self._completions(rng, n, probs)
        tok_b, len_b = self._completions(rng, n, probs)
        margin_ab = (self.true_reward(topic, tok_a, len_a) - self.true_reward(topic, tok_b, len_b)) / self.noise_scale
        # The labelers of the training pairs may favour length, which the true reward ignores (length_bias log-odds
        # per word of difference): a shortcut a proxy can learn. Eval, ood and cal labels always follow the true reward.
        label_margin = margin_ab + (self.length_bias * (len_a - len_b) if split == "train" else 0.0)
        if self.filler_bias and split == "train":
            label_margin = label_margin + self.filler_bias * (self._fillers(tok_a, len_a) - self._fillers(tok_b, len_b))
        a_wins = rng.random(n) < expit(label_margin)  # Bradley-Terry label

        prompts, chosen, rejected = [], [], []
        for i in range(n):
            text_a, text_b = self._text(tok_a[i], len_a[i]), self._text(tok_b[i], len_b[i])
            winner, loser = (text_a, text_b) if a_wins[i] else (text_b, text_a)
            prompts.append(self.prompt(topic[i]))
            chosen.append([{"role": "assistant", "content": winner}])
            rejected.append([{"role": "assistant", "content": loser}])
        true_margin = np.where(a_wins, margin_ab, -margin_ab)
        frame = make_preference_frame(
            ids=[f"synthetic-{self.seed}-{split}-{i}" for i in range(n)],
            prompts=prompts,
            chosen=chosen,
            rejected=rejected,
            subset=[split] * n,
        )
        frame["true_margin"] = true_margin
        frame["true_prob"] = expit(true_margin)
        if self.length_bias and split == "train":   # what the labels were drawn from (true_* stay the gold)
            frame["label_prob"] = expit(np.where(a_wins, label_margin, -label_margin))
        frame["length_diff"] = np.where(a_wins, len_a - len_b, len_b - len_a)   # chosen minus rejected, in words
        if self.filler_bias or self.candidate_filler_share:   # chosen minus rejected occurrences of the filler
            fill_a, fill_b = self._fillers(tok_a, len_a), self._fillers(tok_b, len_b)
            frame["filler_diff"] = np.where(a_wins, fill_a - fill_b, fill_b - fill_a)
        # Share of words from the rare tail: lets tests and users check the ood split really is out of distribution.
        positions = np.arange(self.max_words)[None, :]
        rare_a = (np.isin(tok_a, self.rare_words) & (positions < len_a[:, None])).sum(1)
        rare_b = (np.isin(tok_b, self.rare_words) & (positions < len_b[:, None])).sum(1)
        frame["rare_share"] = (rare_a + rare_b) / (len_a + len_b)
        return frame


class SyntheticRatings(SyntheticWorld):
    """The synthetic world as pointwise data (BoRP's regression target): one completion per prompt, rated 1-5.

    The rating is the completion's true reward plus Gaussian noise (``rating_noise`` times the reward's standard
    deviation), cut into five equally likely classes by the quintiles of the noisy reward of a large seeded sample of
    the training distribution, so a rating is an ordinal reading of the same hidden utilities the preference labels
    come from. Columns: the pointwise contract (``prompt``, ``response``, ``score`` = ``rating``) plus
    ``true_reward``.
    """

    kind = "pointwise"
    completions_per_row = 1

    def __init__(self, *args, rating_noise: float = 0.3, **kwargs):
        super().__init__(*args, **kwargs)
        if not float(rating_noise) >= 0:
            raise UserError(f"dataset.rating_noise={rating_noise} is invalid: must be a number >= 0")
        self.rating_noise = float(rating_noise)
        check_fits_host(completions_memory(RATING_CUT_SAMPLE, self.max_words),
                        f"dataset.max_words={self.max_words} (the {RATING_CUT_SAMPLE:,} completions the rating "
                        "classes are cut from)", "dataset.max_words")
        rng = np.random.default_rng([self.seed, 7777])
        topic = rng.integers(0, self.num_topics, size=RATING_CUT_SAMPLE)
        tokens, lengths = self._completions(rng, RATING_CUT_SAMPLE, self.train_word_probs)
        reward = self.true_reward(topic, tokens, lengths)
        self.reward_std = float(reward.std())
        noisy = reward + rng.normal(scale=self.rating_noise * self.reward_std, size=reward.shape)
        self.cuts = np.quantile(noisy, [0.2, 0.4, 0.6, 0.8])

    def load(self, split: str) -> pd.DataFrame:
        self._check_split(split)
        self.check_memory([split])
        n = self.sizes[split]
        rng = np.random.default_rng([self.seed, _SPLIT_STREAM[split], 1])
        probs = self.ood_word_probs if split == "ood" else self.train_word_probs
        topic = rng.integers(0, self.num_topics, size=n)
        tokens, lengths = self._completions(rng, n, probs)
        reward = self.true_reward(topic, tokens, lengths)
        noisy = reward + rng.normal(scale=self.rating_noise * self.reward_std, size=n)
        rating = 1.0 + np.searchsorted(self.cuts, noisy)
        prompts = [self.prompt(t) for t in topic]
        responses = [[{"role": "assistant", "content": self._text(tokens[i], lengths[i])}] for i in range(n)]
        return make_pointwise_frame([f"synthetic-ratings-{self.seed}-{split}-{i}" for i in range(n)], prompts,
                                    responses, {"rating": rating, "true_reward": reward}, target="rating",
                                    subset=[split] * n)
