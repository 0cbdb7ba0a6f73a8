"""The synthetic preference world: determinism, the data contract, Bradley-Terry labels, the recorded truth, ood."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pandas as pd
import pytest

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.contract import PREFERENCE_COLUMNS, validate_preferences
from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.data.vocabulary import TOPIC_WORDS, WORDS

SMALL = dict(n_train=300, n_eval=300, n_ood=300)
PROMPT_RE = re.compile(r"^Topic (\w+): write a reply\.$")


def world(**kw) -> SyntheticWorld:
    return SyntheticWorld(**(SMALL | kw))


def recompute_margin(w: SyntheticWorld, frame: pd.DataFrame, *, use_topic: bool = True) -> np.ndarray:
    """True margin re-derived from the texts alone: parse topic and words, look up the world's utilities.

    Independent of ``SyntheticWorld.true_reward`` (no padded arrays, no masks), so it checks that code too.
    """
    word_index = {word: i for i, word in enumerate(w.words)}
    topic_index = {t: i for i, t in enumerate(w.topics)}

    def reward(topic: int, text: str) -> float:
        idx = np.array([word_index[x] for x in text.split(" ")])
        util = w.global_utility[idx]
        if use_topic:
            util = util + w.prompt_dependence * w.topic_utility[topic, idx]
        return w.utility_scale * util.mean()

    out = []
    for prompt, chosen, rejected in zip(frame["prompt"], frame["chosen"], frame["rejected"]):
        topic = topic_index[PROMPT_RE.match(prompt[0]["content"]).group(1)]
        out.append((reward(topic, chosen[0]["content"]) - reward(topic, rejected[0]["content"])) / w.noise_scale)
    return np.array(out)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


# ---------------------------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("split", ["train", "eval", "ood"])
def test_same_seed_same_frame(split):
    """Two worlds with the same seed and sizes produce identical frames (runs and caches rely on it)."""
    pd.testing.assert_frame_equal(world(seed=3).load(split), world(seed=3).load(split))


def test_split_does_not_depend_on_load_order_or_other_sizes():
    """Each split has its own random stream: loading train first, or changing n_train, leaves eval unchanged."""
    a = world(seed=1)
    a.load("train")
    a.load("ood")
    b = world(seed=1, n_train=777)
    pd.testing.assert_frame_equal(a.load("eval"), b.load("eval"))


def test_different_seed_different_world():
    """A different seed gives different hidden utilities and different pairs."""
    a, b = world(seed=0), world(seed=1)
    assert not np.allclose(a.global_utility, b.global_utility)
    assert not np.allclose(a.topic_utility, b.topic_utility)
    fa, fb = a.load("train"), b.load("train")
    same = (fa["chosen"].map(lambda m: m[0]["content"]) == fb["chosen"].map(lambda m: m[0]["content"])).mean()
    assert same < 0.05
    assert not np.allclose(fa["true_margin"], fb["true_margin"])


def test_splits_are_different_pairs():
    """train, eval and ood share no pair and no id (eval must not be a copy of training data)."""
    w = world()
    frames = {s: w.load(s) for s in ("train", "eval", "ood")}
    keys = {
        s: set(zip(f["chosen"].map(lambda m: m[0]["content"]), f["rejected"].map(lambda m: m[0]["content"])))
        for s, f in frames.items()
    }
    assert not keys["train"] & keys["eval"]
    assert not keys["train"] & keys["ood"]
    assert not keys["eval"] & keys["ood"]
    all_ids = pd.concat([f["id"] for f in frames.values()])
    assert all_ids.is_unique


# ---------------------------------------------------------------------------------------------- contract
@pytest.mark.parametrize("split", ["train", "eval", "ood"])
def test_contract_columns_and_types(split):
    """The frame has the contract columns first, string ids, float weights of 1, subset = split, plus the truth."""
    w = world(n_eval=123)
    f = w.load(split)
    assert len(f) == w.sizes[split]
    assert tuple(f.columns[: len(PREFERENCE_COLUMNS)]) == PREFERENCE_COLUMNS
    assert {"true_margin", "true_prob", "rare_share"} <= set(f.columns)
    assert all(isinstance(i, str) for i in f["id"])
    assert f["weight"].dtype == np.float64 and (f["weight"] == 1.0).all()
    assert (f["subset"] == split).all()
    for col in ("true_margin", "true_prob", "rare_share"):
        assert f[col].dtype == np.float64 and np.isfinite(f[col]).all()
    validate_preferences(f, "synthetic")  # must not raise


def test_prompts_are_user_turns_with_a_topic_word():
    """Every prompt is one user message naming one of the world's topics, and several topics occur."""
    w = world(num_topics=5)
    f = w.load("train")
    seen = set()
    for prompt in f["prompt"]:
        assert len(prompt) == 1 and prompt[0]["role"] == "user"
        m = PROMPT_RE.match(prompt[0]["content"])
        assert m is not None, prompt
        assert m.group(1) in w.topics
        seen.add(m.group(1))
    assert seen == set(TOPIC_WORDS[:5])


@pytest.mark.parametrize("split", ["train", "ood"])
def test_completions_are_assistant_turns_of_world_words(split):
    """Completions are single assistant turns made only of the first vocab_size words, min..max words long."""
    w = world(vocab_size=40, min_words=3, max_words=6)
    f = w.load(split)
    allowed = set(WORDS[:40])
    lengths = []
    for col in ("chosen", "rejected"):
        for msgs in f[col]:
            assert len(msgs) == 1 and msgs[0]["role"] == "assistant"
            words = msgs[0]["content"].split(" ")
            assert set(words) <= allowed
            lengths.append(len(words))
    assert min(lengths) == 3 and max(lengths) == 6  # both ends of the range are reached in 600 completions


# ---------------------------------------------------------------------------------------------- labels
def test_labels_follow_bradley_terry():
    """P(label agrees with the true reward) = sigmoid(|margin|): overall and within bins of the true probability.

    The agreement indicator of pair i is Bernoulli(q_i) with q_i = max(p_i, 1 - p_i); its mean must match the mean
    of q within a few standard errors, in total and in each quintile of q (this checks the link, not just a mean).
    """
    f = world(n_eval=20000).load("eval")
    p = f["true_prob"].to_numpy()
    agree = (f["true_margin"].to_numpy() > 0).astype(float)
    q = np.maximum(p, 1 - p)
    se = np.sqrt((q * (1 - q)).sum()) / len(q)
    assert abs(agree.mean() - q.mean()) < 4 * se
    assert 0.6 < q.mean() < 0.95  # the default world is neither trivial nor pure noise
    edges = np.quantile(q, [0, 0.2, 0.4, 0.6, 0.8, 1.0])
    bins = np.clip(np.searchsorted(edges, q, side="right") - 1, 0, 4)
    for b in range(5):
        sel = bins == b
        qb = q[sel]
        se_b = np.sqrt((qb * (1 - qb)).sum()) / sel.sum()
        assert abs(agree[sel].mean() - qb.mean()) < 4.5 * se_b, b


def test_tiny_noise_labels_agree_with_truth():
    """With a small BT temperature almost every label agrees with the true reward."""
    f = world(n_eval=5000, noise_scale=0.05).load("eval")
    assert (f["true_margin"] > 0).mean() > 0.99


def test_huge_noise_labels_are_coin_flips():
    """With a huge BT temperature labels carry no information: agreement is 0.5 within a few standard errors."""
    f = world(n_eval=20000, noise_scale=1000.0).load("eval")
    agree = (f["true_margin"] > 0).mean()
    assert abs(agree - 0.5) < 4 * 0.5 / np.sqrt(20000)
    assert np.allclose(f["true_prob"], 0.5, atol=0.01)


# ---------------------------------------------------------------------------------------------- the truth
@pytest.mark.parametrize("kw", [dict(), dict(noise_scale=2.5, prompt_dependence=0.7, utility_scale=3.0)])
@pytest.mark.parametrize("split", ["train", "ood"])
def test_true_margin_recomputed_from_texts(split, kw):
    """true_margin = (r(chosen) - r(rejected)) / noise_scale with r re-derived from the words; true_prob = sigmoid."""
    w = world(**kw)
    f = w.load(split)
    np.testing.assert_allclose(f["true_margin"], recompute_margin(w, f), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(f["true_prob"], sigmoid(f["true_margin"].to_numpy()), rtol=1e-12)


def test_ood_is_out_of_distribution():
    """ood completions are mostly rare words; train/eval almost never use them. rare_share is recomputed too."""
    w = world()
    rare = {w.words[i] for i in w.rare_words}
    assert len(rare) == round(0.25 * 64)
    shares = {}
    for split in ("train", "eval", "ood"):
        f = w.load(split)
        words_c = f["chosen"].map(lambda m: m[0]["content"].split(" "))
        words_r = f["rejected"].map(lambda m: m[0]["content"].split(" "))
        expect = [(sum(x in rare for x in c) + sum(x in rare for x in r)) / (len(c) + len(r))
                  for c, r in zip(words_c, words_r)]
        np.testing.assert_allclose(f["rare_share"], expect)
        shares[split] = f["rare_share"].mean()
    assert shares["ood"] > 0.6
    assert shares["train"] < 0.05 and shares["eval"] < 0.05


def test_prompt_dependence_zero_makes_reward_topic_free():
    """prompt_dependence=0: a completion's reward is the same under every topic (in the world and in the data)."""
    w = world(prompt_dependence=0.0)
    tokens = np.tile(np.arange(w.max_words) % w.vocab_size, (w.num_topics, 1))
    lengths = np.full(w.num_topics, w.max_words)
    r = w.true_reward(np.arange(w.num_topics), tokens, lengths)
    assert np.allclose(r, r[0])
    f = w.load("train")
    np.testing.assert_allclose(f["true_margin"], recompute_margin(w, f, use_topic=False), atol=1e-10)


def test_prompt_dependence_positive_makes_reward_topic_dependent():
    """prompt_dependence>0: the same completion scores differently under different topics."""
    w = world(prompt_dependence=0.5)
    tokens = np.tile(np.arange(w.max_words) % w.vocab_size, (w.num_topics, 1))
    lengths = np.full(w.num_topics, w.max_words)
    r = w.true_reward(np.arange(w.num_topics), tokens, lengths)
    assert np.ptp(r) > 0.1
    f = w.load("train")
    topic_free = recompute_margin(w, f, use_topic=False)
    assert np.abs(f["true_margin"].to_numpy() - topic_free).mean() > 0.05


# ---------------------------------------------------------------------------------------------- bad config
@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(n_train=0), "dataset.n_train"),
        (dict(n_eval=-1), "dataset.n_eval"),
        (dict(n_ood=0), "dataset.n_ood"),
        (dict(vocab_size=1), "dataset.vocab_size"),
        (dict(vocab_size=len(WORDS) + 1), "dataset.vocab_size"),
        (dict(num_topics=0), "dataset.num_topics"),
        (dict(noise_scale=0), "dataset.noise_scale"),
        (dict(rare_fraction=1.0), "dataset.rare_fraction"),
        (dict(ood_rare_share=1.5), "dataset.ood_rare_share"),
        (dict(min_words=5, max_words=4), "dataset.min_words"),
        (dict(n_eval=2.5), "dataset.n_eval=2.5 is invalid: must be an integer"),   # not quietly 2 pairs
        (dict(max_words="12"), "dataset.max_words"),
    ],
)
def test_bad_config_raises_user_error_naming_key(kw, key):
    """Invalid settings fail at construction with a UserError that names the offending key."""
    with pytest.raises(UserError, match=re.escape(key)):
        world(**kw)


def test_unknown_split_raises_user_error():
    """load() of a split the world does not have names it and lists the allowed ones."""
    with pytest.raises(UserError, match=r"'test'.*train, eval, ood"):
        world().load("test")
    with pytest.raises(UserError, match="'valid'"):
        world(eval_splits=("eval", "valid"))


# ---------------------------------------------------------------------------------------------- regressions
@pytest.mark.parametrize("vocab_size, rare_fraction", [(4, 0.1), (64, 0.005), (2, 0.9)])
def test_rare_fraction_that_rounds_to_no_rare_or_no_common_word(vocab_size, rare_fraction):
    """Either the combination is rejected up front as a UserError, or every split loads."""
    try:
        w = SyntheticWorld(**SMALL, vocab_size=vocab_size, rare_fraction=rare_fraction)
    except UserError:
        return
    for split in ("train", "eval", "ood"):
        assert len(w.load(split)) == 300


def test_small_noise_scale_emits_no_overflow_warning():
    """A legal small noise_scale should not spray numpy overflow warnings at the user."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        world(noise_scale=1e-3).load("train")


# ---------------------------------------------------------------------------------------------- spurious length
def test_length_bias_makes_longer_completions_win_training_pairs_only():
    """With length_bias the chosen side of a training pair is longer far more often than by chance, while the gold
    (true_margin) still ignores length and eval labels follow the true reward; at 0 the world is today's."""
    plain = world(n_train=3000, n_eval=3000)
    biased = world(n_train=3000, n_eval=3000, length_bias=1.0)
    train, ev = biased.load("train"), biased.load("eval")
    longer = (train["length_diff"] > 0).mean() / (train["length_diff"] != 0).mean()
    assert longer > 0.65, longer   # 0.71 measured at length_bias=1 (the true margins are large too)
    plain_train = plain.load("train")
    plain_longer = (plain_train["length_diff"] > 0).mean() / (plain_train["length_diff"] != 0).mean()
    assert 0.4 < plain_longer < 0.6, plain_longer
    assert 0.4 < (ev["length_diff"] > 0).mean() / (ev["length_diff"] != 0).mean() < 0.6
    assert "label_prob" in train and "label_prob" not in ev
    # the gold is the same world: length_bias changes who is chosen, never a completion's true reward
    assert np.corrcoef(train["length_diff"], train["true_margin"])[0, 1] < 0.2
    pd.testing.assert_frame_equal(plain.load("eval"), ev)


def test_candidates_span_lengths_beyond_the_training_range():
    w = world(candidate_max_words=40)
    lengths = np.array([len(t.split()) for texts in w.candidates("eval", 20, 16).texts for t in texts])
    assert lengths.min() >= w.min_words and lengths.max() > 3 * w.max_words
    default = world().candidates("eval", 5, 4)
    assert max(len(t.split()) for texts in default.texts for t in texts) <= 12
    with pytest.raises(UserError, match=r"dataset\.candidate_max_words=5 is invalid"):
        world(candidate_max_words=5)


def test_filler_bias_makes_the_filler_win_training_pairs_and_candidates_stuff_it_rarely():
    """The filler word: worth nothing to the true reward once the option is on, favoured by the training labels
    (chosen holds it more often than rejected), and stuffed into a rare, heavy-tailed share of the best-of-n
    candidates, far beyond the counts any training completion has."""
    w = world(n_train=3000, filler_bias=1.0, candidate_filler_share=1.0)
    assert w.global_utility[w.filler_word] == 0 and not w.topic_utility[:, w.filler_word].any()
    train = w.load("train")
    assert (train["filler_diff"] > 0).mean() > 1.5 * (train["filler_diff"] < 0).mean()   # 0.43 vs 0.21 measured
    assert "filler_diff" not in world(n_train=50).load("train")
    filler = w.words[w.filler_word]
    train_counts = [c[0]["content"].split().count(filler) for c in train["chosen"]]
    counts = np.array([t.split().count(filler) for texts in w.candidates("eval", 64, 64).texts for t in texts])
    assert counts.max() >= 2 * max(train_counts)
    assert (counts >= 6).mean() < 0.1          # stuffed candidates are rare: a large n is needed to meet them
    with pytest.raises(UserError, match=r"dataset\.candidate_filler_share=1\.5 is invalid"):
        world(candidate_filler_share=1.5)
