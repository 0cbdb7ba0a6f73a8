"""Feature extraction and the shared feature cache."""

import os

import child_processes
import pytest
import safetensors.torch
import torch
from omegaconf import OmegaConf

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.contract import render_all
from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.models.backbone import Backbone
from rewarduq_exp.models.features import FeatureEncoder, pool


def probe(layer=-1, pooling="last", batch_size=8):
    return OmegaConf.create({"layer": layer, "pooling": pooling, "batch_size": batch_size})


@pytest.fixture(scope="module")
def frame():
    return SyntheticWorld(n_train=24, n_eval=1, n_ood=1, min_words=2, max_words=12).load("train")


def manual_features(backbone, frame, layer, pooling):
    """One unpadded sequence at a time: the reference the batched, length-sorted extraction must match."""
    model = backbone.load_encoder()
    texts = render_all(backbone.tokenizer, frame["prompt"], frame["chosen"])
    out = []
    for t in texts:
        ids = backbone.tokenizer(t, add_special_tokens=False, return_tensors="pt")["input_ids"]
        o = model(input_ids=ids, output_hidden_states=True)
        h = o.hidden_states[layer][0] if layer != -1 else o.last_hidden_state[0]
        out.append(h[-1] if pooling == "last" else h.mean(0))
    return torch.stack(out)


@pytest.mark.parametrize("layer, pooling", [(-1, "last"), (-1, "mean"), (0, "mean"), (1, "last")])
def test_batched_extraction_matches_one_by_one(tiny_backbone, frame, tmp_path, layer, pooling):
    enc = FeatureEncoder(tiny_backbone, probe(layer, pooling, batch_size=5), tmp_path, max_length=2048,
                         show_progress=False)
    feats = enc.encode(frame["prompt"], frame["chosen"])
    with torch.no_grad():
        expected = manual_features(tiny_backbone, frame, layer, pooling)
    torch.testing.assert_close(feats, expected, rtol=1e-4, atol=1e-5)


def test_last_hidden_layer_index_equals_final_norm_output(tiny_backbone, frame, tmp_path):
    # hidden_states[num_layers] is the final-norm output in transformers 5, so layer=-1 and layer=L agree
    a, b = (FeatureEncoder(tiny_backbone, probe(layer), tmp_path, 2048, show_progress=False).encode(frame["prompt"],
                                                                                                   frame["chosen"])
            for layer in (-1, 1))
    torch.testing.assert_close(a, b)


def test_pool_by_attention_mask():
    h = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    torch.testing.assert_close(pool(h, mask, "last"), torch.stack([h[0, 1], h[1, 3]]))
    torch.testing.assert_close(pool(h, mask, "mean"), torch.stack([h[0, :2].mean(0), h[1].mean(0)]))


def test_second_encoder_does_no_forward_pass(tiny_backbone, frame, tmp_path):
    first = FeatureEncoder(tiny_backbone, probe(), tmp_path, 2048, show_progress=False)
    zc, zr = first.encode_pairs(frame)
    assert first.stats["backbone_forward_passes"] > 0 and first.stats["cache_misses"] == 1
    second = FeatureEncoder(tiny_backbone, probe(), tmp_path, 2048, show_progress=False)
    zc2, zr2 = second.encode_pairs(frame)
    assert second.stats == {"backbone_forward_passes": 0, "cache_hits": 1, "cache_misses": 0}
    assert second._model is None  # the weights were not even loaded
    torch.testing.assert_close(zc, zc2)
    torch.testing.assert_close(zr, zr2)


def test_cache_key_covers_probe_data_and_length(tiny_backbone, frame, tmp_path):
    enc = FeatureEncoder(tiny_backbone, probe(), tmp_path, 2048, show_progress=False)
    enc.encode_pairs(frame)
    for other in (FeatureEncoder(tiny_backbone, probe(pooling="mean"), tmp_path, 2048, show_progress=False),
                  FeatureEncoder(tiny_backbone, probe(), tmp_path, 1024, show_progress=False)):
        other.encode_pairs(frame)
        assert other.stats["cache_misses"] == 1
    changed = frame.copy()
    changed.loc[0, "chosen"] = [[{"role": "assistant", "content": "baba"}]]
    passes = enc.stats["backbone_forward_passes"]
    enc.encode_pairs(changed)
    assert enc.stats["cache_misses"] == 2
    assert enc.stats["backbone_forward_passes"] == passes + 1  # only the changed text is extracted
    folders = sorted((tmp_path / "rows").iterdir())  # one per (backbone, probe): last/2048, mean/2048, last/1024
    assert len(folders) == 3 and all((f / "meta.json").exists() for f in folders)
    assert sorted(len(list(f.glob("shard-*.safetensors"))) for f in folders) == [1, 1, 2]
    assert not [p for p in tmp_path.rglob("*") if p.suffix == ".tmp"]


def _extract_in_child(cache: str, model_yaml: str, results) -> None:
    """One of two processes that extract the same features into one cache at the same time."""
    try:
        frame = SyntheticWorld(n_train=2000).load("train")  # extraction outlasts the start-up jitter
        bb = Backbone(OmegaConf.load(model_yaml), cache_dir=cache, device="cpu")
        enc = FeatureEncoder(bb, probe(batch_size=16), cache + "/features", 2048, show_progress=False)
        zc, zr = enc.encode_pairs(frame)
        results.put({**enc.stats, "sum": float(zc.sum() + zr.sum())})
    except BaseException as error:  # the parent waits for one result per child
        results.put({"error": repr(error)})


def test_two_processes_extract_one_entry(tmp_path, tiny_backbone):
    from conftest import ROOT, cache_with_tiny_model

    # share the session's tiny model so both processes start extracting at about the same time
    cache = cache_with_tiny_model(tmp_path / "cache", tiny_backbone)
    # forkserver children (tests/child_processes.py): the imports done already, as in a fork, but no CUDA state
    results = child_processes.queue()
    procs = [child_processes.process(_extract_in_child, (str(cache), str(ROOT / "conf/model/tiny-qwen3.yaml"), results))
             for _ in range(2)]
    for p in procs:
        p.start()
    results = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert not [r["error"] for r in results if "error" in r]
    assert sorted(r["cache_misses"] for r in results) == [0, 1]  # exactly one process extracted
    assert min(r["backbone_forward_passes"] for r in results) == 0
    assert results[0]["sum"] == results[1]["sum"]
    shards = list((cache / "features").glob("rows/*/shard-*.safetensors"))
    assert len(shards) == 1
    assert safetensors.torch.load_file(shards[0])["features"].shape[0] == 2 * 2000  # complete: every row
    assert not list((cache / "features").glob("*.tmp"))


def test_bad_probe_settings(tiny_backbone, tmp_path, frame):
    with pytest.raises(UserError, match="probe.pooling"):
        FeatureEncoder(tiny_backbone, probe(pooling="max"), tmp_path, 2048)
    with pytest.raises(UserError, match="probe.batch_size"):
        FeatureEncoder(tiny_backbone, probe(batch_size=0), tmp_path, 2048)
    with pytest.raises(UserError, match="probe.layer=7"):
        FeatureEncoder(tiny_backbone, probe(layer=7), tmp_path, 2048, show_progress=False).encode(
            frame["prompt"], frame["chosen"])


def _killed_while_writing_an_entry(folder: str) -> None:
    """A job (a child process) killed halfway through writing the tensor file of a cache entry (SIGKILL: no handler
    runs, the entry's lock stays held)."""
    import signal

    from rewarduq_exp.models.feature_cache import FeatureCache

    def half_written(tensor, path):
        with open(path, "wb") as fh:
            fh.write(b"PK\x03\x04 (cut short)")
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = half_written
    FeatureCache(folder).get_or_compute("entry", lambda: torch.ones(4, 2), {"what": "test"})


def _killed_while_writing_a_shard(folder: str, texts: list) -> None:
    """A job killed halfway through writing a shard of rows (holding the shard's lock)."""
    import signal

    import rewarduq_exp.models.feature_cache as fc

    def half_written(tensors, path):
        with open(path, "wb") as fh:
            fh.write(b"\x10\x00 (cut short)")
        os.kill(os.getpid(), signal.SIGKILL)

    fc.save_file = half_written
    fc.FeatureCache(folder).lookup({"m": 1}, texts, CountingRows(texts))


def test_an_entry_half_written_by_a_killed_job_is_never_read(tmp_path):
    """A job killed (SIGKILL: no handler runs) while writing a feature-cache entry, holding the entry's lock, leaves
    only a hidden temporary file: the next job neither reads it nor waits on the dead job's lock, and computes the
    entry again."""
    import signal

    from rewarduq_exp.models.feature_cache import FeatureCache

    cache = FeatureCache(tmp_path)
    job = child_processes.process(_killed_while_writing_an_entry, (str(tmp_path),))
    job.start()
    job.join(timeout=60)
    assert job.exitcode == -signal.SIGKILL
    assert cache.get("entry") is None and any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    tensor, hit = cache.get_or_compute("entry", lambda: torch.arange(8.0).view(4, 2), {"what": "test"})
    assert not hit and torch.equal(tensor, torch.arange(8.0).view(4, 2))
    assert torch.equal(FeatureCache(tmp_path).get("entry"), tensor)


class CountingRows:
    """compute_rows of a lookup: a row per text (its length and first character code), counting the texts computed."""

    def __init__(self, texts):
        self.texts, self.computed = texts, 0

    def __call__(self, rows):
        self.computed += len(rows)
        return torch.tensor([[len(self.texts[i]), ord(self.texts[i][0])] for i in rows], dtype=torch.float32)


def expected_rows(texts):
    return torch.tensor([[len(t), ord(t[0])] for t in texts], dtype=torch.float32)


def test_rows_are_cached_per_text_any_order_subset_or_grouping(tmp_path):
    """Texts extracted once cost nothing again, whatever the order, subset, repetition or split into requests;
    a request with some new texts computes only those."""
    from rewarduq_exp.models.feature_cache import FeatureCache

    meta = {"backbone": "b", "probe": {"layer": -1}}
    texts = [f"text {i} " + "x" * i for i in range(40)]
    cache = FeatureCache(tmp_path)
    first = CountingRows(texts)
    rows, hit = cache.lookup(meta, texts, first)
    assert not hit and first.computed == 40 and torch.equal(rows, expected_rows(texts))
    for request in (texts[::-1], texts[5:17], [texts[3]] * 3 + texts[:2], texts[20:] + texts[:20]):
        again = CountingRows(request)
        rows, hit = FeatureCache(tmp_path).lookup(meta, request, again)  # a new process: reads the shards
        assert hit and again.computed == 0 and torch.equal(rows, expected_rows(request))
    mixed = texts[:10] + ["new a", "new b", "new a"]
    partial = CountingRows(mixed)
    rows, hit = cache.lookup(meta, mixed, partial)
    assert not hit and partial.computed == 2 and torch.equal(rows, expected_rows(mixed))
    other_probe = CountingRows(texts[:3])
    cache.lookup({**meta, "probe": {"layer": 0}}, texts[:3], other_probe)
    assert other_probe.computed == 3  # another probe reads the texts again
    rows, hit = cache.lookup(meta, [], CountingRows([]))
    assert hit and len(rows) == 0


def test_a_shard_half_written_by_a_killed_job_is_never_read(tmp_path):
    """SIGKILL while writing a shard (holding its lock): the next lookup neither reads the half file nor waits on the
    dead job's lock, and computes the rows again."""
    import signal

    import rewarduq_exp.models.feature_cache as fc

    texts = ["a", "bb", "ccc"]
    job = child_processes.process(_killed_while_writing_a_shard, (str(tmp_path), texts))
    job.start()
    job.join(timeout=60)
    assert job.exitcode == -signal.SIGKILL
    assert not list(tmp_path.glob("rows/*/shard-*")) and list(tmp_path.glob("rows/*/.shard-*.tmp"))
    again = CountingRows(texts)
    rows, hit = fc.FeatureCache(tmp_path).lookup({"m": 1}, texts, again)
    assert not hit and again.computed == 3 and torch.equal(rows, expected_rows(texts))


def test_unread_shards_lists_only_new_shards_of_the_prefix_in_name_order(tmp_path):
    from rewarduq_exp.models.feature_cache import unread_shards

    assert unread_shards(tmp_path / "missing", "shard-", set()) == []
    for name in ("shard-c.safetensors", "shard-a.safetensors", "shard-b.safetensors", "facts-a.safetensors",
                 ".shard-d.safetensors.tmp", "shard-e.json"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in unread_shards(tmp_path, "shard-", set())] == [
        "shard-a.safetensors", "shard-b.safetensors", "shard-c.safetensors"]
    assert unread_shards(tmp_path, "shard-", {"shard-a.safetensors", "shard-c.safetensors"}) == [
        tmp_path / "shard-b.safetensors"]
    assert unread_shards(tmp_path, "facts-", set()) == [tmp_path / "facts-a.safetensors"]


def test_an_in_memory_copy_shares_the_backbone_gives_the_same_features_and_writes_nothing(tiny_backbone, frame,
                                                                                         tmp_path):
    disk = FeatureEncoder(tiny_backbone, probe(), tmp_path / "cache", 2048, show_progress=False)
    memory = disk.in_memory(2**20)
    assert memory._model is disk._model is not None          # one backbone in memory, not two
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    feats = memory.encode(frame["prompt"], frame["chosen"])
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert memory.stats["cache_misses"] == 1 and disk.stats["backbone_forward_passes"] == 0
    again = memory.encode(frame["prompt"][::-1], frame["chosen"][::-1])
    assert memory.stats["cache_hits"] == 1 and torch.equal(again, feats.flip(0))
    torch.testing.assert_close(feats, disk.encode(frame["prompt"], frame["chosen"]), rtol=1e-5, atol=1e-6)
