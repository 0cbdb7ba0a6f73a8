"""The cached token counter of the length filter: same counts as the tokenizer, computed once per texts."""

import numpy as np

from rewarduq_exp.data.contract import filter_by_length, make_preference_frame, token_lengths
from rewarduq_exp.models.token_counter import TokenCounter


def test_cached_counts_equal_direct_counts_and_are_reused(tokenizer, tmp_path):
    texts = ["a short text", "a somewhat longer text with more words in it", ""]
    counter = TokenCounter(tokenizer, {"name": "tiny"}, tmp_path)
    first = counter(texts)
    again = TokenCounter(tokenizer, {"name": "tiny"}, tmp_path)(texts)
    np.testing.assert_array_equal(first, token_lengths(tokenizer, texts))
    np.testing.assert_array_equal(again, first)
    assert counter.stats == {"hits": 0, "misses": 1}
    other = TokenCounter(tokenizer, {"name": "other tokenizer"}, tmp_path)
    other(texts)
    assert other.stats == {"hits": 0, "misses": 1}  # another backbone identity is another entry


def test_filter_with_counter_matches_filter_without(tokenizer, tmp_path):
    user = lambda t: [{"role": "user", "content": t}]  # noqa: E731
    bot = lambda t: [{"role": "assistant", "content": t}]  # noqa: E731
    frame = make_preference_frame(range(4), [user("q")] * 4, [bot("yes " * n) for n in (1, 5, 50, 2)],
                                  [bot("no")] * 4)
    plain, report = filter_by_length(frame, tokenizer, 40, "x")
    counter = TokenCounter(tokenizer, {"name": "tiny"}, tmp_path)
    cached, cached_report = filter_by_length(frame, tokenizer, 40, "x", counter)
    assert plain.equals(cached) and report == cached_report and report.dropped == 1
