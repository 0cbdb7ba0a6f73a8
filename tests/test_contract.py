"""The preference-data contract: rendering with the chat template, the length filter, validation, message parsing."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.contract import (
    as_messages,
    filter_by_length,
    joined_passes,
    make_preference_frame,
    render,
    render_all,
    render_prompt_heads,
    rendering_pass,
    token_ids,
    token_lengths,
    validate_preferences,
)
from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.data.vocabulary import WORDS


def user(text):
    return [{"role": "user", "content": text}]


def assistant(text):
    return [{"role": "assistant", "content": text}]


def chat_ids(tokenizer, messages) -> list[int]:
    """Token ids of a conversation through the tokenizer's own chat-template tokenization (not via render)."""
    out = tokenizer.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


SHORT = " ".join(WORDS[1:4])
LONG = " ".join(WORDS[1:201])  # ~200 tokens


def length_frame() -> pd.DataFrame:
    """Six pairs: a long completion on the chosen side, the rejected side, both or neither; two subsets."""
    rows = [
        ("p0", SHORT, SHORT, "a"),
        ("p1", LONG, SHORT, "a"),
        ("p2", SHORT, LONG, "b"),
        ("p3", SHORT, SHORT, "b"),
        ("p4", LONG, LONG, "a"),
        ("p5", SHORT, SHORT + " " + WORDS[9], ""),
    ]
    return make_preference_frame(
        ids=[r[0] for r in rows],
        prompts=[user(f"Topic {i}: write a reply.") for i in range(len(rows))],
        chosen=[assistant(r[1]) for r in rows],
        rejected=[assistant(r[2]) for r in rows],
        weight=np.arange(1.0, 7.0),
        subset=[r[3] for r in rows],
    )


# ---------------------------------------------------------------------------------------------- rendering
def test_render_uses_chatml_template_in_order(tokenizer):
    """The rendered text is ChatML: one <|im_start|>role ... <|im_end|> block per message, in conversation order,
    with no generation prompt appended (the completion is scored as given)."""
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Topic kafa: write a reply."}]
    text = render(tokenizer, prompt, assistant("baba zafu"))
    blocks = re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", text, flags=re.S)
    assert blocks == [("system", "Be brief."), ("user", "Topic kafa: write a reply."), ("assistant", "baba zafu")]
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("baba zafu<|im_end|>\n")
    assert text.index("Be brief.") < text.index("Topic kafa") < text.index("baba zafu")


def test_render_all_pairs_prompts_with_completions(tokenizer):
    """render_all renders the i-th prompt with the i-th completion (no misalignment)."""
    texts = render_all(tokenizer, [user("q0"), user("q1")], [assistant("a0"), assistant("a1")])
    assert len(texts) == 2
    for i, text in enumerate(texts):
        assert f"q{i}" in text and f"a{i}" in text
        assert f"q{1 - i}" not in text and f"a{1 - i}" not in text


def test_token_lengths_match_chat_template_tokenization(tokenizer):
    """The lengths the filter uses equal the true token count of the conversation the backbone scores."""
    f = SyntheticWorld(n_train=50, n_eval=1, n_ood=1).load("train")
    for col in ("chosen", "rejected"):
        lengths = token_lengths(tokenizer, render_all(tokenizer, f["prompt"], f[col]))
        expect = [len(chat_ids(tokenizer, list(p) + list(c))) for p, c in zip(f["prompt"], f[col])]
        assert lengths.tolist() == expect
    # and the special tokens of the template are single tokens, not spelled out byte by byte
    ids = chat_ids(tokenizer, user("x") + assistant("y"))
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2
    assert ids.count(tokenizer.eos_token_id) == 2


class CountingTokenizer:
    """The tiny tokenizer, counting the chat-template renders and the tokenizer calls made through it."""

    def __init__(self, tokenizer):
        self.tokenizer, self.renders, self.tokenised = tokenizer, 0, 0

    def apply_chat_template(self, *args, **kwargs):
        self.renders += 1
        return self.tokenizer.apply_chat_template(*args, **kwargs)

    def __call__(self, texts, **kwargs):
        self.tokenised += len(texts)
        return self.tokenizer(texts, **kwargs)


def test_a_rendering_pass_renders_and_tokenises_each_conversation_once(tokenizer):
    """Within a pass the length check, the features and the prompt heads read one rendering and one tokenisation
    per conversation; what they read equals what rendering anew gives; outside a pass nothing is remembered."""
    counting = CountingTokenizer(tokenizer)
    prompts = [user(f"q{i % 2}") for i in range(6)]              # 2 distinct prompts, 6 distinct message lists
    completions = [assistant(f"a{i}") for i in range(6)]
    fresh = render_all(tokenizer, prompts, completions)
    with rendering_pass() as remembered:
        for _ in range(3):
            assert render_all(counting, prompts, completions) == fresh
            assert token_ids(counting, fresh) == tokenizer(fresh, add_special_tokens=False)["input_ids"]
        heads = render_prompt_heads(counting, prompts)
    assert (counting.renders, counting.tokenised) == (6 + 2, 6)   # 6 conversations, 2 distinct prompt heads
    assert heads == [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    # equal messages in another list are another conversation (found by identity), rendered again, the same text
    with rendering_pass(joined_passes([remembered])):
        again = render_all(counting, prompts, completions) + render_all(counting, [user("q0")], [assistant("a0")])
    assert again == fresh + fresh[:1] and counting.renders == 6 + 2 + 1
    render_all(counting, prompts, completions)                    # outside a pass: rendered anew
    assert counting.renders == 6 + 2 + 1 + 6


# ---------------------------------------------------------------------------------------------- length filter
def pair_lengths(tokenizer, frame) -> np.ndarray:
    """max(prompt+chosen, prompt+rejected) token length per pair, computed independently of the filter."""
    return np.array([
        max(len(chat_ids(tokenizer, list(p) + list(c))), len(chat_ids(tokenizer, list(p) + list(r))))
        for p, c, r in zip(frame["prompt"], frame["chosen"], frame["rejected"])
    ])


def test_filter_drops_exactly_the_long_pairs(tokenizer):
    """Pairs with a long chosen OR rejected side are dropped; the rest are kept unchanged and in order."""
    frame = length_frame()
    lengths = pair_lengths(tokenizer, frame)
    assert lengths[[0, 3, 5]].max() < 64 < lengths[[1, 2, 4]].min()  # the fixture does what it claims
    kept, report = filter_by_length(frame, tokenizer, max_length=64, dataset="toy")
    assert kept["id"].tolist() == ["p0", "p3", "p5"]
    pd.testing.assert_frame_equal(kept, frame.iloc[[0, 3, 5]].reset_index(drop=True))
    assert (report.dataset, report.before, report.after, report.dropped, report.max_length) == ("toy", 6, 3, 3, 64)
    assert report.dropped_by_subset == {"a": 2, "b": 1}
    assert report.length_percentiles["100"] == lengths.max()
    assert "3/6 pairs kept" in report.line() and "3 dropped" in report.line()
    assert "dropped per subset: a=2, b=1" in report.line()


def test_kwise_row_is_dropped_when_any_completion_is_too_long(tokenizer):
    from rewarduq_exp.data.contract import make_kwise_frame

    bot = lambda t: [{"role": "assistant", "content": t}]  # noqa: E731
    user = [{"role": "user", "content": "pick one"}]
    completions = [[bot("a"), bot("b"), bot("c")], [bot("a"), bot("word " * 80), bot("c")], [bot("x"), bot("y")]]
    frame = make_kwise_frame(["k0", "k1", "k2"], [user] * 3, completions, best=[0, 2, 1], subset=["s", "t", "s"])
    kept, report = filter_by_length(frame, tokenizer, max_length=64, dataset="kw")
    assert kept["id"].tolist() == ["k0", "k2"] and kept["best"].tolist() == [0, 1]
    assert report.dropped_by_subset == {"t": 1}
    assert "2/3 prompts kept" in report.line()


def test_filter_never_truncates(tokenizer):
    """Kept pairs still hold their full completions: the filter removes rows, it never shortens text."""
    frame = length_frame()
    kept, _ = filter_by_length(frame, tokenizer, max_length=10_000, dataset="toy")
    pd.testing.assert_frame_equal(kept, frame)
    assert LONG in kept.loc[1, "chosen"][0]["content"]


def test_filter_boundary_is_inclusive(tokenizer):
    """A pair exactly max_length tokens long is kept; one token less and it is dropped."""
    frame = length_frame()
    lengths = pair_lengths(tokenizer, frame)
    longest = int(lengths.max())
    kept, report = filter_by_length(frame, tokenizer, max_length=longest, dataset="toy")
    assert report.after == 6 and len(kept) == 6
    kept, report = filter_by_length(frame, tokenizer, max_length=longest - 1, dataset="toy")
    assert kept["id"].tolist() == frame["id"][lengths < longest].tolist()
    # p5's rejected side is one word longer than its chosen side: the filter looks at the longer one
    p5 = int(lengths[5])
    kept, _ = filter_by_length(frame, tokenizer, max_length=p5 - 1, dataset="toy")
    assert "p5" not in kept["id"].tolist() and "p0" in kept["id"].tolist()


def test_filter_with_non_default_index(tokenizer):
    """A frame whose index is not 0..n-1 (e.g. after an earlier selection) is filtered by position correctly."""
    frame = length_frame()
    frame.index = [50, 40, 30, 20, 10, 0]
    kept, report = filter_by_length(frame, tokenizer, max_length=64, dataset="toy")
    assert kept["id"].tolist() == ["p0", "p3", "p5"]
    assert list(kept.index) == [0, 1, 2]
    assert report.dropped_by_subset == {"a": 2, "b": 1}


def test_filter_that_drops_everything_raises(tokenizer):
    """If nothing survives the filter the user hears which dataset and which max_length, not an empty run."""
    with pytest.raises(UserError, match=r"dataset 'toy'.*max_length=5\b"):
        filter_by_length(length_frame(), tokenizer, max_length=5, dataset="toy")


# ---------------------------------------------------------------------------------------------- validation
def test_validate_missing_columns_lists_found_columns():
    """A frame without weight/subset names what is missing and what was found."""
    frame = length_frame().drop(columns=["weight", "subset"])
    with pytest.raises(UserError) as err:
        validate_preferences(frame, "mydata")
    msg = str(err.value)
    assert msg.startswith("mydata:")
    assert "missing column(s) weight, subset" in msg
    assert "found: id, prompt, chosen, rejected" in msg


@pytest.mark.parametrize("bad", [-0.5, np.nan, np.inf])
def test_validate_rejects_bad_weights(bad):
    """Weights must be finite and >= 0."""
    frame = length_frame()
    frame.loc[2, "weight"] = bad
    with pytest.raises(UserError, match="weight"):
        validate_preferences(frame, "mydata")


def test_validate_rejects_empty_and_accepts_valid():
    """An empty frame is an error; a valid one (zero weights allowed) passes through unchanged."""
    frame = length_frame()
    with pytest.raises(UserError, match="no preference pairs"):
        validate_preferences(frame.iloc[:0], "mydata")
    frame.loc[0, "weight"] = 0.0
    assert validate_preferences(frame, "mydata") is frame


# ---------------------------------------------------------------------------------------------- as_messages
def test_as_messages_string_becomes_one_message():
    """A plain string becomes one message with the default role."""
    assert as_messages("hello", "user", source="s", column="c") == [{"role": "user", "content": "hello"}]
    assert as_messages("bye", "assistant", source="s", column="c") == [{"role": "assistant", "content": "bye"}]


def test_as_messages_dicts_lists_and_arrays():
    """One dict, a list of dicts and a numpy array of dicts (what Parquet gives) all normalise to a list;
    extra keys are dropped and contents become strings."""
    msg = {"role": "assistant", "content": "hi", "name": "bot"}
    assert as_messages(msg, "user", source="s", column="c") == [{"role": "assistant", "content": "hi"}]
    convo = [{"role": "system", "content": "sys"}, {"role": "user", "content": 42}]
    expect = [{"role": "system", "content": "sys"}, {"role": "user", "content": "42"}]
    assert as_messages(convo, "user", source="s", column="c") == expect
    assert as_messages(np.array(convo, dtype=object), "user", source="s", column="c") == expect


@pytest.mark.parametrize(
    "value",
    [
        [{"role": "bot", "content": "x"}],
        [{"role": "user"}],
        [{"content": "x"}],
    ],
)
def test_as_messages_bad_message_raises(value):
    """A message with an unknown role or missing keys is a UserError naming source, column and allowed roles."""
    with pytest.raises(UserError, match=r"^src: column 'chosen'.*roles allowed: system, user, assistant, tool"):
        as_messages(value, "assistant", source="src", column="chosen")


@pytest.mark.parametrize("value, kind", [(3.5, "float"), (None, "NoneType"), (["a", "b"], "list")])
def test_as_messages_wrong_type_raises(value, kind):
    """Anything but a string / message / list of messages is rejected with its type named."""
    with pytest.raises(UserError, match=rf"column 'prompt' must hold a string.*got {kind}"):
        as_messages(value, "user", source="src", column="prompt")
