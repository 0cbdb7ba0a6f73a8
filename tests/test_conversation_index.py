"""The conversation index: what each conversation renders to, recorded so that a cached run loads no tokenizer.

Its answers must be the numbers rendering and counting give (the length filter's lengths, NOT_TOKENISED included, and
the feature-cache keys), whatever was recorded before and under whichever max_length, and a changed tokenizer must
never read another's records."""

import os
import shutil

import numpy as np
import torch
from omegaconf import OmegaConf

from rewarduq_exp.data.contract import NOT_TOKENISED, filter_by_length, make_preference_frame, render_all, token_lengths
from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.models.backbone import Backbone
from rewarduq_exp.models.conversation_index import ConversationIndex, conversation_keys
from rewarduq_exp.models.feature_cache import text_key
from rewarduq_exp.models.features import FeatureEncoder
from rewarduq_exp.models.token_counter import token_lower_bound


def user(text):
    return [{"role": "user", "content": text}]


def bot(text):
    return [{"role": "assistant", "content": text}]


class FolderBackbone:
    """A backbone whose tokenizer is saved in ``folder``: ``loads`` counts how often it was asked for."""

    def __init__(self, folder, tokenizer):
        self.folder, self._tokenizer, self.loads = folder, tokenizer, 0

    @property
    def tokenizer(self):
        self.loads += 1
        return self._tokenizer

    def tokenizer_folder(self):
        return self.folder

    def identity(self):
        return {"name": "stand-in", "folder": str(self.folder)}


def fresh_backbone(tiny_backbone, cache_dir) -> Backbone:
    """A new Backbone on the session's tiny model: its tokenizer not loaded yet."""
    return Backbone(tiny_backbone.cfg, cache_dir=cache_dir, device="cpu")


def varied_frame(tokenizer, max_length: int):
    """Pairs around max_length: short ones, one at the character bound, one just over it, repeated ones."""
    limit = max_length * token_lower_bound(tokenizer).chars_per_token
    scaffold = len(render_all(tokenizer, [user("q")], [bot("")])[0])
    replies = [bot("yes " * n) for n in (1, 5, 50, 2)]
    replies += [bot("x" * (limit - scaffold)), bot("x" * (limit + 1 - scaffold))]
    n = len(replies)
    return make_preference_frame([f"r{i}" for i in range(n + 1)], [user("q")] * (n + 1), replies + [replies[0]],
                                 [bot("no")] * (n + 1), subset=["a"] * (n + 1))


def test_lengths_and_keys_equal_rendering_under_any_max_length(tiny_backbone, tokenizer, tmp_path):
    """Recorded under one max_length, asked under others (a text first over the bound has no count yet), read back
    by a new index that never loads the tokenizer: always what rendering and counting give."""
    bound = token_lower_bound(tokenizer)
    frame = varied_frame(tokenizer, 30)
    index = ConversationIndex(fresh_backbone(tiny_backbone, tiny_backbone.cache_dir), tmp_path)
    for max_length in (30, 200, 20, 30):
        expected, expected_report = filter_by_length(frame, tokenizer, max_length, "x", None, bound)
        kept, report = filter_by_length(frame, None, max_length, "x",
                                        lengths=lambda p, c, m=max_length: index.lengths(p, c, m))
        assert kept.equals(expected) and report == expected_report
    assert index.stats["rendered"] > 0
    prompts, completions = list(frame["prompt"]) * 2, list(frame["chosen"]) + list(frame["rejected"])
    texts = render_all(tokenizer, prompts, completions)
    reader = ConversationIndex(fresh_backbone(tiny_backbone, tiny_backbone.cache_dir), tmp_path)
    for max_length in (30, 200, 20):
        over = bound.too_long(texts, max_length)
        direct = np.where(over, NOT_TOKENISED, token_lengths(tokenizer, texts))
        np.testing.assert_array_equal(reader.lengths(prompts, completions, max_length), direct)
    keys, rendered = reader.text_keys(prompts, completions)
    assert keys == [text_key(t) for t in texts] and not rendered
    assert reader.stats["rendered"] == 0 and "tokenizer" not in vars(reader.backbone)  # never loaded
    assert reader.content_char_limit(30) == bound.content_char_limit(30)


def test_normalised_lengths_decide_as_the_bound_does(tokenizer, tmp_path):
    """A normalising tokenizer (NFKC here): a text over the bound in characters may fit once normalised, and the
    normalised length is recorded only for such texts, as TokenLowerBound.too_long measures it."""
    from tokenizers import normalizers
    from transformers import AutoTokenizer

    folder = tmp_path / "nfkc"
    tokenizer.save_pretrained(folder)
    nfkc = AutoTokenizer.from_pretrained(folder)
    nfkc.backend_tokenizer.normalizer = normalizers.NFKC()
    nfkc.save_pretrained(folder)
    nfkc = AutoTokenizer.from_pretrained(folder)
    bound = token_lower_bound(nfkc)
    assert bound.normalize is not None
    max_length = 20
    limit = max_length * bound.chars_per_token
    scaffold = len(render_all(nfkc, [user("q")], [bot("")])[0])
    # "e" + combining acute: two characters, one once normalised; "ﬁ": one character, two once normalised
    replies = [bot("e\u0301" * ((limit - scaffold) // 2 + 3)), bot("\ufb01" * (limit - scaffold + 1)),
               bot("a" * (limit - scaffold + 1)), bot("short")]
    frame = make_preference_frame(range(4), [user("q")] * 4, replies, [bot("no")] * 4)
    texts = render_all(nfkc, [user("q")] * 4, replies)
    assert min(map(len, texts[:3])) > limit and bound.too_long(texts, max_length).tolist() == [False, True, True, False]
    for max_length in (20, 80, 20):
        expected, expected_report = filter_by_length(frame, nfkc, max_length, "x", None, bound)
        index = ConversationIndex(FolderBackbone(folder, nfkc), tmp_path / "index")
        kept, report = filter_by_length(frame, None, max_length, "x",
                                        lengths=lambda p, c, m=max_length: index.lengths(p, c, m))
        assert kept.equals(expected) and report == expected_report
    assert report.not_tokenised >= 1
    assert index.backbone.loads == 0  # the third pass: all recorded, bound included


def test_conversations_that_repr_cannot_key_are_rendered_every_time(tiny_backbone, tokenizer, tmp_path):
    prompts = [user("q"), [{"role": "user", "content": np.str_("q")}], (user("q")[0],)]
    completions = [bot("a"), bot("a"), bot("a")]
    keys = conversation_keys(prompts, completions)
    assert keys[0] is not None and keys[1] is None and keys[2] == keys[0]  # a tuple of the same messages is the same
    index = ConversationIndex(fresh_backbone(tiny_backbone, tiny_backbone.cache_dir), tmp_path)
    for _ in range(2):
        found, rendered = index.text_keys(prompts, completions)
        assert found == [text_key(t) for t in render_all(tokenizer, prompts, completions)]
    assert 1 in rendered and 0 not in rendered  # the second time only the unkeyable one is rendered
    # keys follow the order of a message's keys (a template may iterate them) and never equate different values
    assert len(set(conversation_keys([user("1"), [{"content": "1", "role": "user"}], [{"role": "user", "content": 1}]],
                                     [bot("a")] * 3))) == 3


def test_a_changed_tokenizer_reads_no_records_of_another(tiny_backbone, tokenizer, tmp_path):
    """Another chat template (same vocabulary): another folder of records, and its own texts' keys."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_backbone.source, folder)
    prompts, completions = [user("q")] * 2, [bot("a"), bot("b")]
    first = ConversationIndex(Backbone(OmegaConf.merge(tiny_backbone.cfg, {"builder": None, "path": str(folder)}),
                                       device="cpu"), tmp_path / "index")
    keys, _ = first.text_keys(prompts, completions)
    template = folder / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|im_start|>", "<|im_start|> "))
    second = ConversationIndex(Backbone(OmegaConf.merge(tiny_backbone.cfg, {"builder": None, "path": str(folder)}),
                                        device="cpu"), tmp_path / "index")
    changed, rendered = second.text_keys(prompts, completions)
    assert second.folder != first.folder and len(rendered) == 2
    assert changed == [text_key(t) for t in render_all(second.backbone.tokenizer, prompts, completions)] != keys


def test_a_template_that_reads_the_clock_is_never_recorded(tiny_backbone, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_backbone.source, folder)
    template = folder / "chat_template.jinja"
    template.write_text("{{ strftime_now('%d %b %Y') }}" + template.read_text())
    index = ConversationIndex(Backbone(OmegaConf.merge(tiny_backbone.cfg, {"builder": None, "path": str(folder)}),
                                       device="cpu"), tmp_path / "index")
    for _ in range(2):
        index.text_keys([user("q")], [bot("a")])
    assert index.folder is None and index.stats["rendered"] == 2 and not (tmp_path / "index").exists()


def test_a_damaged_record_is_rendered_again(tiny_backbone, tokenizer, tmp_path, caplog):
    prompts, completions = [user("q")] * 3, [bot("a"), bot("b"), bot("c")]
    index = ConversationIndex(fresh_backbone(tiny_backbone, tiny_backbone.cache_dir), tmp_path)
    index.text_keys(prompts, completions)
    (shard,) = index.folder.glob("facts-*.safetensors")
    shard.write_bytes(b"not a safetensors file")
    again = ConversationIndex(fresh_backbone(tiny_backbone, tiny_backbone.cache_dir), tmp_path)
    with caplog.at_level("WARNING", logger="rewarduq_exp"):
        keys, rendered = again.text_keys(prompts, completions)
    assert len(rendered) == 3 and keys == [text_key(t) for t in render_all(tokenizer, prompts, completions)]
    assert [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()] == [
        f"conversation index: {shard} cannot be read (SafetensorError); its conversations will be rendered again "
        "(delete the file to silence this)"]


def test_features_cached_before_the_index_existed_are_found_without_recomputing(tiny_backbone, tmp_path):
    """A feature cache written before this index (no conversations/ folder): the first run renders once to record
    the keys and computes nothing; the next one loads neither tokenizer nor weights. The same rows either way."""
    frame = SyntheticWorld(n_train=30, n_eval=1, n_ood=1).load("train")
    probe = OmegaConf.create({"layer": -1, "pooling": "last", "batch_size": 8})
    first = FeatureEncoder(tiny_backbone, probe, tmp_path, 2048, show_progress=False)
    zc, zr = first.encode_pairs(frame)
    shutil.rmtree(tmp_path / "conversations")  # the cache as it was before
    for _ in range(2):
        encoder = FeatureEncoder(fresh_backbone(tiny_backbone, tiny_backbone.cache_dir), probe, tmp_path, 2048,
                                 show_progress=False)
        zc2, zr2 = encoder.encode_pairs(frame)
        assert encoder.stats["backbone_forward_passes"] == 0 and encoder.stats["cache_hits"] == 1
        assert torch.equal(zc, zc2) and torch.equal(zr, zr2)
    assert encoder.conversations.stats["rendered"] == 0 and "tokenizer" not in vars(encoder.backbone)


def test_records_are_written_with_the_umask(tiny_backbone, tmp_path):
    umask = os.umask(0o027)
    try:
        index = ConversationIndex(fresh_backbone(tiny_backbone, tiny_backbone.cache_dir), tmp_path)
        index.lengths([user("q")], [bot("a")], 64)
    finally:
        os.umask(umask)
    files = [p for p in index.folder.iterdir() if not p.name.endswith(".lock")]
    assert {p.name.split("-")[0] for p in files} >= {"facts", "bound.json", "meta.json"}
    assert all(p.stat().st_mode & 0o777 == 0o640 for p in files)
    assert not [p for p in tmp_path.rglob("*") if p.suffix == ".tmp"]


def test_a_second_process_finds_what_the_first_recorded(tiny_backbone, tmp_path):
    """Records are read from disk (another process's, as in a sweep), not only from this process's memory."""
    max_length = 64
    frame = varied_frame(tiny_backbone.tokenizer, max_length)
    prompts, completions = list(frame["prompt"]), list(frame["chosen"])
    ConversationIndex(fresh_backbone(tiny_backbone, tiny_backbone.cache_dir), tmp_path).lengths(
        prompts, completions, max_length)
    reader = ConversationIndex(fresh_backbone(tiny_backbone, tiny_backbone.cache_dir), tmp_path)
    reader.lengths(prompts, completions, max_length)
    assert reader.stats == {"rendered": 0, "recorded": 0}
