"""Human gold for the downstream tasks (rewarduq_exp/downstream/vader_gold.py): best-of-n candidates are held-out
VADER sentences with their crowd mean rating as gold, seeded, per corpus; world_of dispatches VADER runs to it and
refuses other datasets; downstream.py runs end to end on a tiny-model VADER run. The data is the local archive in
the sdist's exact layout (tests/test_vader_ratings.py), never downloaded."""

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT
from omegaconf import OmegaConf
from test_cli import run
from test_vader_ratings import larger_sdist, train_run

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data import vader_ratings
from rewarduq_exp.data.vader_ratings import PROMPTS, VaderPairs, VaderRatings, pair_prompt
from rewarduq_exp.downstream.vader_gold import VaderGold
from rewarduq_exp.downstream.world_runs import world_of


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    return larger_sdist(tmp_path_factory.mktemp("vader") / vader_ratings.SDIST)


def gold_world(sdist, cls=VaderPairs, **kwargs):
    return VaderGold(cls(path=str(sdist), cache_dir="unused", eval_fraction=0.4, **kwargs))


@pytest.mark.parametrize("split", ["eval", "ood"])
def test_candidates_are_held_out_sentences_of_the_prompts_corpus_with_their_mean_rating(sdist, split):
    world = gold_world(sdist)
    table = world.data.table()
    rows = table[table.split == split]
    n = int(rows.groupby("corpus").size().min())
    cand = world.candidates(split, 7, n, seed=3)
    assert cand.gold.shape == cand.features["words"].shape == (7, n) and len(cand.texts) == 7
    corpora = list(dict.fromkeys(c for c in world.data.corpora + world.data.ood_corpora if c in set(rows.corpus)))
    by_text = table.set_index("text")
    for p in range(7):
        corpus = corpora[p % len(corpora)]  # prompts spread evenly over the split's corpora
        assert cand.prompts[p] == pair_prompt(corpus) and list(vader_ratings.CORPORA)[cand.topic[p]] == corpus
        texts = cand.texts[p]
        assert len(set(texts)) == n  # without replacement
        drawn = by_text.loc[texts]
        assert (drawn.split == split).all() and (drawn.corpus == corpus).all()  # never a train sentence
        np.testing.assert_allclose(cand.gold[p], drawn.mean_rating.to_numpy())
        assert cand.features["words"][p].tolist() == [len(t.split()) for t in texts]


def test_the_draw_is_seeded_and_a_ratings_run_meets_the_same_sentences_with_its_own_prompt(sdist):
    world = gold_world(sdist)
    a, b, c = (world.candidates("eval", 4, 3, seed=s) for s in (0, 0, 1))
    assert a.texts == b.texts and np.array_equal(a.gold, b.gold)
    assert a.texts != c.texts
    ratings = gold_world(sdist, VaderRatings).candidates("eval", 4, 3, seed=0)
    assert ratings.texts == a.texts  # the same draw whatever the run's loader
    assert ratings.prompts[0] == [{"role": "user", "content": PROMPTS["tweets"]}]  # what BoRP was trained with
    longest = max(len(m[-1]["content"].split()) for col in ("chosen", "rejected") for m in world.load("train")[col])
    assert world.training_feature_max() == {"words": float(longest)}


def test_train_and_too_many_candidates_are_refused_in_one_line(sdist):
    world = gold_world(sdist)
    with pytest.raises(UserError) as err:
        world.candidates("train", 3, 2)
    assert "task.splits may name eval or ood, not 'train'" in str(err.value) and "\n" not in str(err.value)
    rows = world.data.table().query("split == 'eval'")
    smallest = int(rows.groupby("corpus").size().min())
    with pytest.raises(UserError) as err:
        world.candidates("eval", 3, smallest + 1)
    assert f"largest allowed: task.n_max={smallest}" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError, match="task.prompts=0 is invalid"):
        world.candidates("eval", 0, 2)


def test_world_of_dispatches_vader_runs_and_finds_their_cached_sdist_offline(tmp_path, sdist):
    # A run launched from `tmp_path` with the relative paths.cache_dir "cache": the sdist is there, download is off,
    # so reading it proves the world found the cache from the run folder (no fetch), wherever the command runs.
    (tmp_path / "cache" / "downloads").mkdir(parents=True)
    (tmp_path / "cache" / "downloads" / vader_ratings.SDIST).write_bytes(sdist.read_bytes())
    run_dir = tmp_path / "outputs" / "runs" / "r"
    (run_dir / ".hydra").mkdir(parents=True)
    for name, cls in (("vader_pairs", VaderPairs), ("vader_ratings", VaderRatings)):
        dataset = OmegaConf.load(ROOT / "conf" / "dataset" / f"{name}.yaml")
        config = OmegaConf.create({"paths": {"cache_dir": "cache"}, "dataset": dataset})
        config.dataset.download = False
        world = world_of(config, run_dir / ".hydra" / "config.yaml")
        assert isinstance(world, VaderGold) and type(world.data) is cls
        assert len(world.candidates("ood", 2, 3).texts) == 2
    other = OmegaConf.create({"dataset": OmegaConf.load(ROOT / "conf" / "dataset" / "synthetic_ratings.yaml")})
    with pytest.raises(UserError) as err:
        world_of(other)
    assert ("need runs trained on dataset=synthetic (its true reward) or dataset=vader_pairs / vader_ratings"
            in str(err.value)) and "'synthetic_ratings'" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.e2e
def test_downstream_on_a_vader_run_end_to_end(tmp_path, shared_cache, sdist):
    folder, _ = train_run(tmp_path, shared_cache, ["method=ens_mlp", "dataset=vader_pairs", f"dataset.path={sdist}",
                                                   "dataset.min_gap=0.5", "dataset.eval_fraction=0.4"])

    def downstream(*args, check=True):
        return run("downstream.py", ["progress=false", f"run={folder}", *args], tmp_path, shared_cache, check=check)

    downstream("task=best_of_n", "task.prompts=3", "task.n_max=4", f"hydra.run.dir={tmp_path / 'bon'}")
    curves, summary = pd.read_csv(tmp_path / "bon" / "curves.csv"), pd.read_csv(tmp_path / "bon" / "summary.csv")
    assert set(curves.split) == {"eval", "ood"} and sorted(set(curves.n)) == [1, 2, 4]
    assert curves.gold.between(-4, 4).all()  # the crowd's scale
    assert summary["truth/ece"].isna().all() and summary["win_rate"].notna().all()  # no hidden truth: NaN
    # scored through the run's recalibration (fitted on its cal split of whole documents) where it has one
    assert summary.recalibrated.all() == (folder / "calibration.json").exists()
    if summary.recalibrated.all():
        assert (summary.conservative_cal_vs_raw_lo <= summary.conservative_cal_vs_raw + 1e-12).all()
        assert (summary.conservative_cal_vs_raw <= summary.conservative_cal_vs_raw_hi + 1e-12).all()
    rules = set(pd.read_csv(tmp_path / "bon" / "selection.csv").rule)
    assert rules == {"raw", "recalibrated", "raw-filter-recalibrated-rank"}
    downstream("task=active_learning", "task.pool=12", "task.initial=6", "task.batch=3", "task.rounds=1",
               "task.repeats=2", "task.strategies=[random,uncertainty]", "task.method.num_epochs=2",
               f"hydra.run.dir={tmp_path / 'al'}")
    al = pd.read_csv(tmp_path / "al" / "curves.csv")
    assert sorted(set(al.labels)) == [6, 9] and al.win_rate.between(0, 1).all() and al["truth/ece"].isna().all()
    assert pd.read_csv(tmp_path / "al" / "summary.csv").ece_final.notna().all()
    assert (tmp_path / "al" / "active_learning.png").stat().st_size > 10_000
    for args, message in ((["task=best_of_n", "task.splits=[train]"], "task.splits may name eval or ood"),
                          (["task=active_learning", "task.pool=5000", "task.initial=6"],
                           "task.pool=5000 exceeds the")):
        proc = downstream(*args, f"hydra.run.dir={tmp_path / 'bad'}", check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr[-2000:]


def test_the_pool_is_checked_against_the_worlds_size_before_anything_is_read(tmp_path):
    """Fourth hardening round, item 10: ``task.pool`` beyond a VADER run's ``dataset.n_train`` was refused only after
    the corpus was read (downloaded, where not cached): now from the run's config, before any file is touched (the
    world's ``dataset.path`` here does not exist, so a read would fail with another message)."""
    from types import SimpleNamespace

    from rewarduq_exp.data.registry import load_dataset_config
    from rewarduq_exp.downstream.active_learning import check_pool

    dataset = load_dataset_config("vader_pairs", seed=0)
    dataset.path, dataset.n_train = str(tmp_path / "missing.tar.gz"), 40
    run = SimpleNamespace(config=OmegaConf.create({"dataset": dataset}), path=tmp_path / "run", label="ens_mlp")
    with pytest.raises(UserError, match=r"^task.pool=1000000 exceeds the 40 training pairs of ens_mlp "):
        check_pool(run, OmegaConf.create({"pool": 1000000}))
    assert isinstance(check_pool(run, OmegaConf.create({"pool": 40})), VaderGold)
