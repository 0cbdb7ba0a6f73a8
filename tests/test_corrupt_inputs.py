"""Corrupt inputs and user mistakes, through ``train.py`` / ``evaluate.py`` as a user runs them: exit status 2, one
``error:`` line on stderr naming the file or key, no traceback, no results. And the length filter's character
bound, which drops a row no ``max_length`` can admit before it is tokenised (or even loaded)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess

import numpy as np
import pyarrow as pa
import pytest
from conftest import ROOT
from entry_points import run_entry_point

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.contract import content_chars, filter_by_length, make_preference_frame, render
from rewarduq_exp.data.local import LocalPreferenceFile
from rewarduq_exp.models import token_counter
from rewarduq_exp.models.token_counter import token_lower_bound

ROWS = [{"prompt": f"Question {i}?", "chosen": f"A fine answer {i}.", "rejected": f"No {i}."} for i in range(12)]


def jsonl(rows) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Good pairs, and the same pairs with bytes that are not UTF-8 in row 2 (plain and gzip-compressed)."""
    folder = tmp_path_factory.mktemp("files")
    good = jsonl(ROWS)
    bad = good.replace(b"A fine answer 1.", b"A fine answer \xff\xfe 1.")
    (folder / "good.jsonl").write_bytes(good)
    (folder / "bad.jsonl").write_bytes(bad)
    (folder / "bad.jsonl.gz").write_bytes(gzip.compress(bad))
    (folder / "a_file").write_text("not a folder")
    return folder


def run(script: str, tmp_path, cache, args):
    args = [f"paths.output_root={tmp_path / 'outputs'}", f"paths.cache_dir={cache}", "progress=false",
            "metric.diagrams=false", *args]
    return run_entry_point(ROOT / script, args, tmp_path)


def assert_one_error_line(proc, tmp_path) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not list(tmp_path.glob("outputs/**/metrics.json")) and not list(tmp_path.glob("outputs/**/*.parquet"))
    return lines[0]


# ------------------------------------------------------------------------------------------------ invalid UTF-8
@pytest.mark.parametrize("name", ["bad.jsonl", "bad.jsonl.gz"])
def test_invalid_utf8_names_the_file_column_and_row(tmp_path, shared_cache, files, name):
    proc = run("train.py", tmp_path, shared_cache, ["dataset=local", f"dataset.path={files / name}",
                                                    f"dataset.eval_path={files / 'good.jsonl'}"])
    line = assert_one_error_line(proc, tmp_path)
    assert line.startswith(f"error: dataset.path={files / name}: column 'chosen' holds text that is not valid "
                           "UTF-8 (line 2); data files must be UTF-8"), line


def test_invalid_utf8_inside_message_lists_is_found_in_its_row(tmp_path):
    """Nested columns validate as a whole; the row is found through the flattened strings."""
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": f"ok {i}"}],
             "rejected": [{"role": "assistant", "content": "no"}]} for i in range(5)]
    path = tmp_path / "chat.jsonl"
    path.write_bytes(jsonl(rows).replace(b"ok 3", b"ok \xc3\x28 3"))
    with pytest.raises(UserError, match=r"^dataset\.path=.*chat\.jsonl: column 'chosen' .* not valid UTF-8 \(line 4\)"):
        LocalPreferenceFile(str(path)).load("train")


def test_invalid_utf8_in_a_hub_datasets_local_file(tmp_path, files):
    from rewarduq_exp.data.registry import build_loader, load_dataset_config

    cfg = load_dataset_config("reward_bench", 0)
    cfg.data_files = str(files / "bad.jsonl")
    loader = build_loader(cfg)
    with pytest.raises(UserError, match=r"data file .*bad\.jsonl: column 'chosen' .* not valid UTF-8 \(line 2\)"):
        loader.load(loader.eval_splits[0])


# ------------------------------------------------------------------------------------------------ settings
@pytest.mark.parametrize("value", ["abc", "1.5", "true", "-1", "4294967296"])
def test_seed_must_be_a_whole_number(tmp_path, shared_cache, value):
    proc = run("train.py", tmp_path, shared_cache, [f"seed={value}"])
    assert assert_one_error_line(proc, tmp_path) == (f"error: seed={value} is invalid: must be an integer in "
                                                     "[0, 4294967295]")


def test_cache_dir_that_cannot_be_created(tmp_path, shared_cache, files):
    """A folder under a regular file cannot be created, by root either."""
    cache = files / "a_file" / "cache"
    line = assert_one_error_line(run("train.py", tmp_path, cache, []), tmp_path)
    assert line == (f"error: paths.cache_dir={cache} is not a writable folder (Not a directory); point it at a "
                    "writable folder: paths.cache_dir=<folder>")
    line = assert_one_error_line(run("evaluate.py", tmp_path, cache, [f"run={tmp_path / 'no_run'}"]), tmp_path)
    assert line.startswith(f"error: paths.cache_dir={cache} is not a writable folder")


def _read_only_folder(folder) -> tuple[bool, str]:
    """Make ``folder`` read-only for this process: permissions (not for root), else the immutable attribute."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return True, ""
    if shutil.which("chattr") is None:
        return False, "running as root without chattr: no folder is read-only to root"
    done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
    return done.returncode == 0, f"running as root and chattr +i failed: {done.stderr.strip()}"


def test_read_only_cache_dir(tmp_path, shared_cache):
    cache = tmp_path / "read_only"
    cache.mkdir()
    ok, why = _read_only_folder(cache)
    try:
        if not ok:
            pytest.skip(why)
        line = assert_one_error_line(run("train.py", tmp_path, cache, []), tmp_path)
        assert line.startswith(f"error: paths.cache_dir={cache} is not a writable folder (")
        assert line.endswith("point it at a writable folder: paths.cache_dir=<folder>")
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(cache)], capture_output=True)
        cache.chmod(0o755)


# ------------------------------------------------------------------------------------------------ character bound
def test_tiny_tokenizer_bound_holds(tokenizer):
    """Byte-level BPE: no text has fewer tokens than characters / the longest raw token (13: <|endoftext|>)."""
    bound = token_lower_bound(tokenizer)
    assert bound.chars_per_token == max(map(len, tokenizer.get_vocab())) == 13
    assert bound.normalize is None and bound.contents_verbatim
    for token in tokenizer.get_vocab():  # every token decodes to at most its raw string's characters
        assert len(tokenizer.convert_tokens_to_string([token])) <= len(token)
    texts = ["<|im_start|>" * 40, "<|endoftext|><|im_end|>" * 9, "aaaa " * 300, "Grüße, 世界! 🎉🎉 " * 50,
             bytes(range(32, 256)).decode("latin-1") * 3, "word " * 1000]
    lengths = tokenizer(texts, add_special_tokens=False)["input_ids"]
    for text, ids in zip(texts, lengths):
        assert len(ids) >= len(text) / bound.chars_per_token, text[:30]


def test_template_that_changes_contents_gives_no_limit_before_loading(tiny_backbone):
    """Llama 3 trims contents, Qwen3 drops earlier <think> blocks: their contents do not bound the rendered text."""
    from transformers import AutoTokenizer

    trimming = AutoTokenizer.from_pretrained(tiny_backbone.source)
    trimming.chat_template = trimming.chat_template.replace("message['content']", "message['content'] | trim")
    bound = token_lower_bound(trimming)
    assert not bound.contents_verbatim and bound.content_char_limit(100) is None
    assert bound.chars_per_token == 13  # the bound on rendered texts still holds


def test_a_row_just_over_the_bound_is_dropped_without_tokenising(tokenizer):
    bound = token_lower_bound(tokenizer)
    max_length = 40
    limit = max_length * bound.chars_per_token
    prompt = [{"role": "user", "content": "Say a lot."}]
    scaffold = len(render(tokenizer, prompt, [{"role": "assistant", "content": ""}]))

    def reply(chars: int) -> list[dict]:  # a reply whose rendered conversation has exactly `chars` characters
        return [{"role": "assistant", "content": "x" * (chars - scaffold)}]

    frame = make_preference_frame(["fits", "at_limit", "over"], [prompt] * 3,
                                  [[{"role": "assistant", "content": "Fine."}], reply(limit), reply(limit + 1)],
                                  [[{"role": "assistant", "content": "No."}]] * 3, subset=["a", "a", "b"])
    seen = []

    def count(texts):
        seen.extend(texts)
        assert all(len(text) <= limit for text in texts), "the tokenizer saw a text the bound rules out"
        return np.array([len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]])

    kept, report = filter_by_length(frame, tokenizer, max_length, "toy", count, bound)
    assert "fits" in kept["id"].tolist() and "over" not in kept["id"].tolist()
    assert max(map(len, seen)) == limit  # the row at the limit was counted: the bound drops only what cannot fit
    assert report.not_tokenised == 1 and report.dropped_by_subset["b"] == 1
    assert "too long in characters to tokenise" in report.line()


def test_content_chars_counts_contents_only():
    strings = pa.chunked_array([["abc", None], ["héllo"]])
    assert content_chars(strings).tolist() == [3, 0, 5]
    messages = pa.array([
        [{"role": "system", "content": "12"}, {"role": "user", "content": "345"}, {"role": "tool", "content": "9999"}],
        None,
        [{"role": "assistant", "content": "6"}],
    ])
    assert content_chars(messages).tolist() == [5, 0, 1]  # tool turns count 0: templates render them their own way
    parts = pa.array([[{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]}]])
    assert content_chars(parts).tolist() == [3]


def test_loader_drops_over_long_rows_before_loading(tmp_path):
    rows = ROWS[:3] + [{"prompt": "p", "chosen": "y" * 5000, "rejected": "n", "subset": "big"}]
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(jsonl(rows))
    frame = LocalPreferenceFile(str(path)).load("train", max_chars=1000)
    assert len(frame) == 3 and frame.attrs["dropped_too_long"] == ["big"]
    with pytest.raises(UserError, match=r"empty after the length filter: all 4 rows .* more than 10 characters"):
        LocalPreferenceFile(str(path)).load("train", max_chars=10)


def test_huge_row_is_dropped_before_tokenising_and_counted(tmp_path, shared_cache, files, monkeypatch):
    """A 4 MB row (tokenising it would take seconds and about a gigabyte) is dropped unseen by the tokenizer."""
    huge = {"prompt": "Tell me everything.", "chosen": "lorem ipsum " * 350_000, "rejected": "No."}
    (tmp_path / "huge.jsonl").write_bytes(jsonl([huge, *ROWS]))
    counted = token_counter.token_lengths

    def small_texts_only(tok, texts):
        assert max(map(len, texts)) < 100_000, "the huge row reached the tokenizer"
        return counted(tok, texts)

    monkeypatch.setattr(token_counter, "token_lengths", small_texts_only)
    folder = tmp_path / "outputs" / "runs" / "huge"
    proc = run("train.py", tmp_path, shared_cache, ["dataset=local", f"dataset.path={tmp_path / 'huge.jsonl'}",
                                                    f"dataset.eval_path={files / 'good.jsonl'}",
                                                    f"hydra.run.dir={folder}"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    train, evaluated, cal = json.loads((folder / "data_summary.json").read_text())   # cal: the recalibration's
    # 13 rows: the huge one dropped before loading, 1 of the other 12 prompts held out as split cal
    assert (train["before"], train["after"], train["dropped"], train["not_tokenised"]) == (12, 11, 1, 1)
    assert evaluated["dropped"] == 0 and (cal["dataset"], cal["after"]) == ("local_cal", 1)
