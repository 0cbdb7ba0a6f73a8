"""The hub loaders, run on local fixtures in the exact hub schema (tests/hub_fixtures.py) through the real code."""

from __future__ import annotations

import numpy as np
import pytest
from hub_fixtures import HH_SUBSETS, write_all

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.contract import PREFERENCE_COLUMNS, render
from rewarduq_exp.data.registry import build_loader, load_dataset_config


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory):
    return write_all(tmp_path_factory.mktemp("hub"))


@pytest.fixture(autouse=True)
def private_datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))


def loader(name, hub_root, seed=0, **overrides):
    cfg = load_dataset_config(name, seed=seed, paths={"datasets_dir": str(hub_root)})
    for key, value in overrides.items():
        cfg[key] = value
    return build_loader(cfg)


def roles(messages):
    return [m["role"] for m in messages]


def test_ultrafeedback_implicit_prompt_becomes_user_turn(hub_root):
    train = loader("ultrafeedback", hub_root, cal_fraction=0).load("train")   # the whole train split
    test = loader("ultrafeedback", hub_root).load("test")
    assert list(train.columns) == list(PREFERENCE_COLUMNS)
    assert (len(train), len(test)) == (40, 12)
    # by default 0.1 of the train split's 40 prompts are held out as split cal (tests/test_calibration_split.py)
    assert (len(loader("ultrafeedback", hub_root).load("train")), len(loader("ultrafeedback", hub_root).load("cal"))) \
        == (36, 4)
    for _, row in train.iterrows():
        assert roles(row.prompt) == ["user"]
        assert roles(row.chosen) == ["assistant"] and roles(row.rejected) == ["assistant"]
    assert train.id.iloc[3] == "train-3" and test.id.iloc[0] == "test-0"
    assert train.prompt.iloc[0][0]["content"] == "Tell me something about rivers (0)."


def test_num_samples_fixed_seed_independent_of_run_seed(hub_root):
    a = loader("ultrafeedback", hub_root, num_samples=10).load("train")
    b = loader("ultrafeedback", hub_root, seed=123, num_samples=10).load("train")
    frac = loader("ultrafeedback", hub_root, num_samples=0.25).load("train")
    other = loader("ultrafeedback", hub_root, num_samples=10, sample_seed=1).load("train")
    assert len(a) == 10 and list(a.id) == list(b.id)  # the run seed does not change the data
    assert len(frac) == 9   # a quarter of the 36 train rows left once split cal (4 of 40) is held out
    assert list(other.id) != list(a.id)
    assert len(loader("ultrafeedback", hub_root, num_samples=10).load("test")) == 12  # eval split untouched
    assert len(loader("ultrafeedback", hub_root, eval_num_samples=5).load("test")) == 5


@pytest.mark.parametrize("value", [0, -3, 1.5, 0.0, "half"])
def test_num_samples_rejects_bad_values(hub_root, value):
    with pytest.raises(UserError, match="num_samples"):
        loader("ultrafeedback", hub_root, num_samples=value)


def test_skywork_source_becomes_subset(hub_root):
    frame = loader("skywork_pref", hub_root, cal_fraction=0).load("train")
    assert len(frame) == 12
    assert len(loader("skywork_pref", hub_root).load("train")) == 11   # one of the 12 prompts held out as split cal
    assert set(frame.subset) == {"magpie_ultra", "wildguard", "offsetbias"}
    assert all(roles(p) == ["user"] for p in frame.prompt)


def test_tulu_user_turn_is_not_duplicated(hub_root, tokenizer):
    frame = loader("tulu3_pref", hub_root, cal_fraction=0).load("train")   # the whole train split
    assert len(frame) == 11
    single = frame[frame.id == "tulu-0"].iloc[0]
    assert single.prompt == [{"role": "user", "content": "Tell me something about rivers (0)."}]
    text = render(tokenizer, single.prompt, single.chosen)
    assert text.count("Tell me something about rivers (0).") == 1
    multi = frame[frame.id == "tulu-multi"].iloc[0]
    assert roles(multi.prompt) == ["user", "assistant", "user"]
    assert [m["content"] for m in multi.prompt].count("Hi!") == 1
    assert multi.chosen == [{"role": "assistant", "content": "Blue."}]
    assert multi.rejected == [{"role": "assistant", "content": "Seven."}]


def test_reward_bench_strings_ids_and_subsets(hub_root):
    lb = loader("reward_bench", hub_root)
    assert lb.train_split is None and lb.eval_splits == ("filtered",)
    frame = lb.load("filtered")
    assert len(frame) == 16 and len(lb.load("raw")) == 24
    assert frame.id.iloc[0] == "1000"  # int64 on the hub, str in the contract
    assert "math-prm" in set(frame.subset) and "hep-go" in set(frame.subset)
    row = frame.iloc[0]
    assert roles(row.prompt) == ["user"] and roles(row.chosen) == ["assistant"]
    assert row.chosen[0]["content"].startswith("Here is a careful")
    assert (frame.weight == 1.0).all()  # category weighting happens in the metrics, from the subsets


def test_reward_bench2_kwise_shape_and_ties_kept(hub_root):
    frame = loader("reward_bench2", hub_root).load("test")
    assert list(frame.columns[:5]) == ["id", "prompt", "completions", "best", "num_correct"]
    assert len(frame) == 12 and (frame.best == 0).all()
    # Ties is kept (the official score includes it), with its number of correct answers from the hub
    ties = frame[frame.subset == "Ties"].set_index("id")
    assert ties.num_correct.to_dict() == {"ref:0": 1, "tied:0": 3}
    assert [len(c) for c in ties.completions] == [4, 5]
    frame = frame[frame.subset != "Ties"]
    assert all(len(c) == 4 for c in frame.completions) and (frame.num_correct == 1).all()
    row = frame.iloc[0]
    assert row.completions[0] == [{"role": "assistant", "content": row.completions[0][0]["content"]}]
    assert row.completions[0][0]["content"].startswith("Here is a careful")
    assert row.completions[3] == [{"role": "assistant", "content": "No idea."}]
    assert "Ties" not in set(loader("reward_bench2", hub_root, exclude_subsets=["Ties"]).load("test").subset)


def test_helpsteer2_scores_and_multiturn_prompt(hub_root):
    lb = loader("helpsteer2", hub_root, cal_fraction=0)   # the whole train split
    assert lb.kind == "pointwise"
    frame = lb.load("train")
    assert len(frame) == 9 and len(lb.load("validation")) == 4
    assert list(frame.helpfulness[:5]) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert (frame.score == frame.verbosity + 1).all()  # BoRP's default target, on its 1-5 scale
    assert (loader("helpsteer2", hub_root, target="helpfulness", score_offset=0, cal_fraction=0).load("train").score
            == frame.helpfulness).all()
    multi = frame.iloc[-1]
    assert multi.prompt == [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
                            {"role": "user", "content": "And times 3?"}]
    assert multi.response == [{"role": "assistant", "content": "12."}]
    with pytest.raises(UserError, match="target"):
        loader("helpsteer2", hub_root, target="fun")


def test_hh_rlhf_transcripts_split_into_prompt_and_replies(hub_root, caplog):
    frame = loader("hh_rlhf", hub_root, cal_fraction=0).load("train")   # the whole train split
    assert set(frame.subset) == set(HH_SUBSETS)
    assert len(frame) == 24  # 4 subsets x 6; the malformed transcript is dropped and counted
    assert frame.attrs["dropped_unsplittable"] == 1
    single = frame[frame.id == "harmless-base/train-0"].iloc[0]
    assert single.prompt == [{"role": "user", "content": "Tell me something about rivers (0)."}]
    assert single.chosen[0]["content"].startswith("Here is a careful") and roles(single.rejected) == ["assistant"]
    multi = frame[frame.id == "harmless-base/train-1"].iloc[0]
    assert roles(multi.prompt) == ["user", "assistant", "user"]
    assert multi.prompt[1]["content"] == "Sure." and multi.prompt[2]["content"] == "Go on."
    assert roles(multi.chosen) == ["assistant"]
    test = loader("hh_rlhf", hub_root, subsets=["helpful-base"]).load("test")
    assert len(test) == 3 and set(test.subset) == {"helpful-base"}
    with pytest.raises(UserError, match="subsets"):
        loader("hh_rlhf", hub_root, subsets=["red-team-attempts"])


def test_path_override_snapshot_and_save_to_disk(hub_root, tmp_path):
    snapshot = hub_root / "trl-lib/ultrafeedback_binarized"
    via_path = loader("ultrafeedback", hub_root, path=str(snapshot), mirror_dir=None).load("test")
    assert len(via_path) == 12
    import datasets

    saved = tmp_path / "saved"
    datasets.DatasetDict({"test": datasets.load_dataset(str(snapshot), split="test")}).save_to_disk(str(saved))
    via_disk = loader("ultrafeedback", hub_root, path=str(saved), mirror_dir=None).load("test")
    assert via_disk.equals(via_path)


def test_data_files_override(hub_root):
    file = hub_root / "allenai/reward-bench/data/filtered-00000-of-00001.parquet"
    frame = loader("reward_bench", hub_root, data_files=str(file), mirror_dir=None).load("filtered")
    assert len(frame) == 16
    with pytest.raises(UserError, match="no entry for split 'filtered'"):
        loader("reward_bench", hub_root, data_files={"raw": str(file)}, mirror_dir=None).load("filtered")


def test_missing_column_names_dataset_column_and_found(hub_root, tmp_path):
    import datasets

    bad = tmp_path / "bad.parquet"
    datasets.Dataset.from_dict({"chosen": ["a"], "answer": ["b"]}).to_parquet(str(bad))
    with pytest.raises(UserError) as err:
        loader("skywork_pref", hub_root, data_files=str(bad)).load("train")
    assert str(err.value) == ("dataset 'skywork_pref' (Skywork/Skywork-Reward-Preference-80K-v0.2, split train) "
                              "lacks column(s) rejected, source; found: chosen, answer")


def test_unreachable_hub_gives_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lb = build_loader(load_dataset_config("ultrafeedback", seed=0, paths={"datasets_dir": str(tmp_path)}))
    with pytest.raises(UserError) as err:
        lb.load("train")
    message = str(err.value)
    assert "\n" not in message
    assert "could not fetch trl-lib/ultrafeedback_binarized" in message and "dataset.path=DIR" in message


def test_bad_local_path_and_unknown_split(hub_root, tmp_path):
    with pytest.raises(UserError, match="is not a folder"):
        loader("ultrafeedback", hub_root, path=str(tmp_path / "nope")).load("train")
    with pytest.raises(UserError, match="no split 'validation'; allowed: train, test"):
        loader("ultrafeedback", hub_root).load("validation")


def test_every_hub_config_names_a_loader_with_a_fixture():
    from hub_fixtures import WRITERS

    from rewarduq_exp.data.registry import available

    hub_configs = {n for n in available("dataset") if "hub_id" in load_dataset_config(n, seed=0)}
    assert hub_configs == set(WRITERS)
    ids = {n: str(load_dataset_config(n, seed=0).hub_id) for n in hub_configs}
    assert ids["reward_bench"] == "allenai/reward-bench" and ids["tulu3_pref"].endswith("tulu-3-8b-preference-mixture")
    assert np.all([load_dataset_config(n, seed=0).mirror_dir is None for n in hub_configs])
