"""The calibration split ``cal`` of every training dataset (rewarduq_exp/data/calibration_split.py): rows for post-hoc
recalibration that are neither trained on nor evaluated.

For each kind of loader (the synthetic world as pairs and as ratings, a local file, the hub loaders on files in the
hub schema, the VADER sentences): ``cal`` is disjoint from train and from every eval split, by id and by prompt (or
document); it is the same from two loaders and under another run seed; its size is the one configured; ``cal`` is not
an eval split but ``<name>_cal`` names it; a share of 0 means no ``cal`` and the training split of before; a bad share
is one line. The synthetic world's train, eval and ood are bit for bit those of before ``cal`` existed (digests
recorded before it was added)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from omegaconf import OmegaConf

from rewarduq_exp.core.config_dir import CONF_DIR
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.setting_bounds import check_bound
from rewarduq_exp.data.calibration_split import CAL_SPLIT, check_fraction, hold_out
from rewarduq_exp.data.contract import data_kind
from rewarduq_exp.data.hub import opening_turns
from rewarduq_exp.data.local import LocalPreferenceFile
from rewarduq_exp.data.registry import available, build_loader, load_dataset_config, resolve_eval_sets
from rewarduq_exp.data.synthetic import SyntheticRatings, SyntheticWorld
from rewarduq_exp.data.vader_ratings import VaderPairs, VaderRatings


@pytest.fixture(autouse=True)
def private_datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))


# ------------------------------------------------------------------------------------------------ helpers
def _canon(value):
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (float, np.floating)):
        return float(value).hex()   # exact: bit for bit
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, dict):
        return {str(k): _canon(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_canon(v) for v in value]
    return value


def digest(frame: pd.DataFrame) -> str:
    """A hash of a frame's columns, dtypes and every value (floats exactly)."""
    payload = [[c, str(frame[c].dtype), [_canon(v) for v in frame[c]]] for c in frame.columns]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]


def texts(column) -> set[str]:
    return {json.dumps(v, sort_keys=True, default=str) for v in column}


def one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


BAD_FRACTIONS = [1, 1.0, -0.1, 1.5, float("nan"), "half", True, None]


# ------------------------------------------------------------------------------------------------ the helper
def test_hold_out_takes_whole_groups_at_least_one_never_all():
    keys = [f"p{i % 10}" for i in range(50)]
    held = hold_out(keys, 0.3)
    assert len({k for k, h in zip(keys, held) if h}) == 3
    assert not {k for k, h in zip(keys, held) if h} & {k for k, h in zip(keys, held) if not h}
    assert hold_out(keys, 1e-9).sum() == 5 and (~hold_out(keys, 0.99)).sum() == 5   # one group each side at least
    assert hold_out(["a"] * 4, 0.5) is None
    # independent of the row order; another salt is another order
    shuffled = keys[::-1]
    assert {k for k, h in zip(shuffled, hold_out(shuffled, 0.3)) if h} == {k for k, h in zip(keys, held) if h}
    salted = [{k for k, h in zip(keys, hold_out(keys, 0.3, salt=s)) if h} for s in ("a", "b", "c", "d")]
    assert len({frozenset(s) for s in salted}) > 1
    # by rows: groups until their rows reach the share
    sizes = {"big": 40, **{f"s{i}": 2 for i in range(30)}}
    rows = [k for k, n in sizes.items() for _ in range(n)]
    for salt in "abcdefgh":
        held = hold_out(rows, 0.1, by_rows=True, salt=salt)
        groups = set(np.array(rows)[held])
        # small groups up to 10 of the 100 rows, or the big one alone when it comes first
        assert held.sum() <= 10 or groups == {"big"}
        assert not groups & set(np.array(rows)[~held])


@pytest.mark.parametrize("value", BAD_FRACTIONS)
def test_bad_fraction_is_one_line_naming_the_key(value):
    with pytest.raises(UserError) as err:
        check_fraction(value)
    assert one_line(err).startswith("dataset.cal_fraction=") and "must be a number in [0, 1)" in str(err.value)
    assert check_fraction(0) == 0.0 and check_fraction(0.25) == 0.25


def test_n_cal_is_in_the_bounds_table():
    assert check_bound("dataset.n_cal", 0) == 0 and check_bound("dataset.n_cal", None) is None
    with pytest.raises(UserError, match=r"dataset\.n_cal=-1 is invalid: must be an integer >= 0"):
        check_bound("dataset.n_cal", -1)
    with pytest.raises(UserError, match="too large"):
        check_bound("dataset.n_cal", 10**9)


def test_opening_turns_read_in_arrow():
    """The turns before the first assistant turn, from sliced chunks, with a system turn, an empty conversation and
    texts (a reply has none; a prompt is one user turn)."""
    conversations = [
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"},
         {"role": "user", "content": "e"}],
        [{"role": "assistant", "content": "only a reply"}],
        [],
        [{"role": "user", "content": "f"}, {"role": "user", "content": "g"}],
    ]
    array = pa.array(conversations)
    column = pa.chunked_array([array.slice(1, 3), array.slice(0, 1), array.slice(4)])
    assert opening_turns(column, "assistant") == [[["system", "s"], ["user", "c"]], [], [], [["user", "a"]],
                                                  [["user", "f"], ["user", "g"]]]
    assert opening_turns(pa.chunked_array([["x", None]]), "user") == [[["user", "x"]], []]
    assert opening_turns(pa.chunked_array([["x"]]), "assistant") == [[]]


# ------------------------------------------------------------------------------------------------ the synthetic world
# Digests of train/eval/ood recorded before split cal existed (git 'ff8168c'): they must never change.
BEFORE_CAL = {
    "pairs": {"train": "5f13a5fb41283797", "eval": "3de9676562913008", "ood": "9464c13e801df144"},
    "pairs_biased": {"train": "d8d67084e4031f96", "eval": "6124f54a785c1152", "ood": "188a61e4084c469a"},
    "ratings": {"train": "720186ff309767a2", "eval": "2b193fd865c1a677", "ood": "a661e0997d6950de"},
}
WORLDS = {
    "pairs": lambda **kw: SyntheticWorld(n_train=300, n_eval=100, n_ood=100, **kw),
    "pairs_biased": lambda **kw: SyntheticWorld(seed=3, n_train=200, n_eval=50, n_ood=50, length_bias=0.5,
                                                filler_bias=0.7, candidate_filler_share=0.3, **kw),
    "ratings": lambda **kw: SyntheticRatings(n_train=200, n_eval=50, n_ood=50, **kw),
}


@pytest.mark.parametrize("name", list(WORLDS))
@pytest.mark.parametrize("n_cal", [None, 0, 7])
def test_synthetic_train_eval_ood_are_unchanged(name, n_cal):
    world = WORLDS[name](**({} if n_cal is None else {"n_cal": n_cal}))
    assert {split: digest(world.load(split)) for split in ("train", "eval", "ood")} == BEFORE_CAL[name]


@pytest.mark.parametrize("cls, config, n_cal", [(SyntheticWorld, "synthetic", 1000),
                                                (SyntheticRatings, "synthetic_ratings", 500)])
def test_synthetic_cal_is_disjoint_deterministic_and_of_its_size(cls, config, n_cal):
    loader = build_loader(load_dataset_config(config, seed=0))
    assert loader.cal_split == CAL_SPLIT and CAL_SPLIT not in loader.eval_splits
    cal = loader.load("cal")
    assert len(cal) == n_cal == loader.sizes["cal"]
    assert list(cal.columns) == list(loader.load("eval").columns)   # the contract of the other splits
    assert data_kind(cal) == data_kind(loader.load("train")) == ("pairs" if cls is SyntheticWorld else "pointwise")
    assert set(cal["subset"]) == {"cal"}
    completion = "chosen" if cls is SyntheticWorld else "response"
    for split in ("train", "eval", "ood"):
        other = loader.load(split)
        assert not set(cal["id"]) & set(other["id"])
        assert not texts(cal[completion]) & texts(other[completion])   # fresh draws, not copies
    # the same from another loader, and under another run seed (the world has its own seed)
    again = build_loader(load_dataset_config(config, seed=123)).load("cal")
    pd.testing.assert_frame_equal(cal, again)
    assert digest(cls(n_cal=20).load("cal")) == digest(cls(n_cal=20).load("cal"))


def test_synthetic_cal_is_drawn_like_eval_without_the_training_shortcut():
    """With a strong length shortcut in the training labels, cal's labels follow the true reward as eval's do, and
    cal's words come from the eval distribution (not the rare-word mixture of ood)."""
    world = SyntheticWorld(n_train=2000, n_eval=2000, n_ood=2000, n_cal=2000, length_bias=3.0)
    train, ev, ood, cal = (world.load(s) for s in ("train", "eval", "ood", "cal"))
    longer = {name: float((f["length_diff"] > 0).mean()) for name, f in (("train", train), ("eval", ev),
                                                                          ("cal", cal))}
    assert longer["train"] > longer["eval"] + 0.2 and abs(longer["cal"] - longer["eval"]) < 0.05
    assert "label_prob" in train and "label_prob" not in cal
    assert (cal["true_margin"] > 0).mean() == pytest.approx((ev["true_margin"] > 0).mean(), abs=0.05)
    assert cal["rare_share"].mean() == pytest.approx(ev["rare_share"].mean(), abs=0.01)
    assert ood["rare_share"].mean() > 0.5 > cal["rare_share"].mean()
    assert world.candidates("cal", 4, 3).gold.shape == (4, 3)   # best-of-n may draw from it too


def test_synthetic_without_cal_and_bad_sizes():
    world = SyntheticWorld(n_train=50, n_eval=10, n_ood=10, n_cal=0)
    assert world.cal_split is None
    with pytest.raises(UserError) as err:
        world.load("cal")
    assert one_line(err) == "dataset 'synthetic' has no calibration split 'cal' (dataset.n_cal=0)"
    with pytest.raises(UserError, match=r"no calibration split 'cal' \(dataset\.n_cal=0\)"):
        SyntheticWorld(n_cal=0, eval_splits=("eval", "cal"))
    for bad in (-1, 2.5, "x", True):
        with pytest.raises(UserError) as err:
            SyntheticWorld(n_cal=bad)
        assert one_line(err).startswith(f"dataset.n_cal={bad if not isinstance(bad, bool) else 'true'} is invalid")


def test_eval_datasets_name_the_cal_split():
    """eval_datasets=[synthetic_cal] evaluates it (resolve_eval_sets), and the plain name does not."""
    train_cfg = load_dataset_config("synthetic", seed=0)
    (cal,) = resolve_eval_sets(["synthetic_cal"], train_cfg, seed=0)
    assert (cal.name, cal.split) == ("synthetic_cal", "cal")
    assert [es.split for es in resolve_eval_sets(None, train_cfg, seed=0)] == ["eval", "ood"]
    assert len(build_loader(cal.config).load(cal.split)) == 1000
    (vader,) = resolve_eval_sets(["vader_ratings_cal"], None, seed=0)
    assert (vader.name, vader.split) == ("vader_ratings_cal", "cal")


def test_every_training_dataset_has_a_cal_split_and_eval_only_ones_none(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    seen = set()
    for name in available("dataset"):
        raw = OmegaConf.load(CONF_DIR / "dataset" / f"{name}.yaml")
        if "train_split" not in raw:
            continue   # label ranking: cross-validation folds, no train split
        cfg = load_dataset_config(name, seed=0)
        if name == "local":
            cfg.path = str(path)
        loader = build_loader(cfg)
        assert CAL_SPLIT not in loader.eval_splits, name
        if loader.train_split:
            assert loader.cal_split == CAL_SPLIT, name
            assert "cal_fraction" in cfg or "n_cal" in cfg, name   # configurable from the YAML
            seen.add(name)
        else:
            assert loader.cal_split is None, name
            with pytest.raises(UserError, match="no calibration split 'cal' \\(an evaluation-only dataset\\)"):
                loader.load("cal")
    assert {"synthetic", "synthetic_ratings", "local", "ultrafeedback", "hh_rlhf", "helpsteer2", "vader_ratings",
            "vader_pairs"} <= seen


# ------------------------------------------------------------------------------------------------ local files
LOCAL_ROWS = [{"prompt": f"question {i % 40}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(120)]
BEFORE_CAL_LOCAL = {"held": "e980ac5af246b50a", "eval_path": "e4b6b9ce9c6b276e"}   # train before cal existed


@pytest.fixture
def local_file(tmp_path):
    return write_jsonl(tmp_path / "pairs.jsonl", LOCAL_ROWS)


def test_local_cal_is_a_share_of_the_training_prompts(local_file, tmp_path):
    loader = LocalPreferenceFile(str(local_file), eval_fraction=0.2, cal_fraction=0.1)
    assert loader.cal_split == CAL_SPLIT and loader.eval_splits == ("eval",)
    train, ev, cal = (loader.load(s) for s in ("train", "eval", "cal"))
    assert (ev["prompt"].map(str).nunique(), cal["prompt"].map(str).nunique()) == (8, 3)   # of 40, then of 32
    assert len(train) + len(ev) + len(cal) == 120 and list(cal.columns) == list(train.columns)
    for a, b in ((train, ev), (train, cal), (ev, cal)):
        assert not set(a["id"]) & set(b["id"]) and not texts(a["prompt"]) & texts(b["prompt"])
    # eval is the one of before; train and cal together are the train split of before
    before = LocalPreferenceFile(str(local_file), eval_fraction=0.2)
    assert before.cal_split is None and digest(before.load("train")) == BEFORE_CAL_LOCAL["held"]
    pd.testing.assert_frame_equal(ev, before.load("eval"))
    assert set(before.load("train")["id"]) == set(train["id"]) | set(cal["id"])
    # deterministic, whatever the row order; the run seed plays no part (the config's seed is not read)
    shuffled = write_jsonl(tmp_path / "shuffled.jsonl", LOCAL_ROWS[::-1])
    again = LocalPreferenceFile(str(shuffled), eval_fraction=0.2, cal_fraction=0.1).load("cal")
    assert set(again["chosen"].map(str)) == set(cal["chosen"].map(str))
    assert loader.load("cal").equals(cal)
    cfgs = [load_dataset_config("local", seed=s) for s in (0, 99)]
    for cfg in cfgs:
        cfg.path, cfg.eval_fraction = str(local_file), 0.2
    assert cfgs[0].cal_fraction == 0.1
    pd.testing.assert_frame_equal(build_loader(cfgs[0]).load("cal"), build_loader(cfgs[1]).load("cal"))
    pd.testing.assert_frame_equal(build_loader(cfgs[0]).load("cal"), cal)
    assert cal.attrs["dropped_too_long"] == []


def test_local_cal_with_an_eval_file_comes_from_the_training_file(local_file, tmp_path):
    eval_file = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"other {i}", "chosen": "x", "rejected": "y"}
                                                      for i in range(5)])
    loader = LocalPreferenceFile(str(local_file), eval_path=str(eval_file), cal_fraction=0.25)
    train, cal, ev = loader.load("train"), loader.load("cal"), loader.load("eval")
    assert cal["prompt"].map(str).nunique() == 10 and len(train) + len(cal) == 120 and len(ev) == 5
    assert not texts(train["prompt"]) & texts(cal["prompt"])
    without = LocalPreferenceFile(str(local_file), eval_path=str(eval_file), cal_fraction=0)
    assert digest(without.load("train")) == BEFORE_CAL_LOCAL["eval_path"]
    with pytest.raises(UserError) as err:
        without.load("cal")
    assert one_line(err) == "dataset 'local' has no calibration split 'cal' (dataset.cal_fraction=0)"
    with pytest.raises(UserError, match=r"has splits train, eval and cal, not 'test'"):
        loader.load("test")


def test_local_cal_that_cannot_be_held_out_is_one_line(tmp_path):
    one_prompt = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "same", "chosen": f"a{i}", "rejected": "b"}
                                                      for i in range(4)])
    with pytest.raises(UserError) as err:
        LocalPreferenceFile(str(one_prompt), cal_fraction=0.1).load("train")
    assert "every training row has the same prompt" in one_line(err) and "dataset.cal_fraction=0" in str(err.value)
    two = write_jsonl(tmp_path / "two.jsonl", [{"prompt": f"q{i}", "chosen": "a", "rejected": "b"} for i in range(2)])
    with pytest.raises(UserError) as err:
        LocalPreferenceFile(str(two), cal_fraction=0.1).load("cal")
    assert "dataset.cal_fraction=0.1 leaves 1 training row(s) of 2, fewer than 2" in one_line(err)


@pytest.mark.parametrize("value", BAD_FRACTIONS)
def test_local_bad_cal_fraction(local_file, value):
    with pytest.raises(UserError) as err:
        LocalPreferenceFile(str(local_file), cal_fraction=value)
    assert one_line(err).startswith("dataset.cal_fraction=")


def test_a_cal_frame_passes_the_runners_loading(local_file, tokenizer):
    """runner.data_loading.load_split (length filter with max_chars, degenerate-data checks) takes split cal."""
    from rewarduq_exp.runner.data_loading import load_split

    loader = LocalPreferenceFile(str(local_file), eval_fraction=0.2, cal_fraction=0.1)
    frame, report = load_split(loader, "cal", "local_cal", tokenizer, 256)
    assert len(frame) == len(loader.load("cal")) == report.after
    frame, _ = load_split(SyntheticRatings(n_cal=30), "cal", "synthetic_ratings_cal", tokenizer, 256)
    assert len(frame) == 30


# ------------------------------------------------------------------------------------------------ hub loaders
def msg(role, content):
    return {"content": content, "role": role}


def ultrafeedback_rows(n, prompts, offset=0):
    rows = [{"chosen": [msg("user", p := f"Tell me about topic {offset + i % prompts}."),
                        msg("assistant", f"A careful answer {i}.")],
             "rejected": [msg("user", p), msg("assistant", f"No idea {i}.")], "score_chosen": 8.0,
             "score_rejected": 4.5} for i in range(n)]
    # two multi-turn pairs that open with the same user turn as single-turn ones: grouped with them
    p = f"Tell me about topic {offset}."
    for k in range(2):
        rows.append({"chosen": [msg("user", p), msg("assistant", "Sure."), msg("user", f"More {k}?"),
                                msg("assistant", f"Yes {k}.")],
                     "rejected": [msg("user", p), msg("assistant", "Sure."), msg("user", f"More {k}?"),
                                  msg("assistant", f"No {k}.")], "score_chosen": 8.0, "score_rejected": 4.5})
    return rows


def hh_rows(n, prompts, offset=0):
    rows = []
    for i in range(n):
        p = f"Question {offset + i % prompts}?"
        shared = f"\n\nHuman: {p}\n\nAssistant: Sure.\n\nHuman: Go on." if i % 3 == 0 else f"\n\nHuman: {p}"
        rows.append({"chosen": f"{shared}\n\nAssistant: good {i}", "rejected": f"{shared}\n\nAssistant: bad {i}"})
    return rows


def helpsteer_rows(n, prompts, offset=0):
    return [{"prompt": f"Prompt {offset + i % prompts}", "response": f"Response {i}", "helpfulness": i % 5,
             "correctness": (i + 1) % 5, "coherence": 4, "complexity": 2, "verbosity": (i + 2) % 5}
            for i in range(n)]


# name -> (train rows, test rows, eval split, prompts in train (groups), train digest before cal existed)
HUB = {
    "ultrafeedback": (lambda: ultrafeedback_rows(60, 30), lambda: ultrafeedback_rows(10, 5, offset=100), "test", 30,
                      "c5890394502f4ea2"),
    "hh_rlhf": (lambda: hh_rows(40, 20), lambda: hh_rows(8, 4, offset=100), "test", 20, "f5726a0f75a3a55b"),
    "helpsteer2": (lambda: helpsteer_rows(30, 15), lambda: helpsteer_rows(6, 3, offset=100), "validation", 15,
                   "0fcaefebd3ca3930"),
}


def hub_loader(name, files, seed=0, **overrides):
    cfg = load_dataset_config(name, seed=seed)
    cfg.data_files, cfg.mirror_dir = files, None
    for key, value in overrides.items():
        cfg[key] = value
    return build_loader(cfg)


@pytest.fixture
def hub_files(tmp_path):
    out = {}
    for name, (train, test, eval_split, _, _) in HUB.items():
        out[name] = {"train": str(write_jsonl(tmp_path / f"{name}-train.jsonl", train())),
                     eval_split: str(write_jsonl(tmp_path / f"{name}-{eval_split}.jsonl", test()))}
    return out


def prompts_of(frame):
    return texts(frame["prompt"])


@pytest.mark.parametrize("name", list(HUB))
def test_hub_cal_is_a_share_of_the_train_prompts(hub_files, name):
    _, _, eval_split, n_prompts, before = HUB[name]
    loader = hub_loader(name, hub_files[name])
    assert loader.cal_split == CAL_SPLIT and CAL_SPLIT not in loader.eval_splits and loader.cal_fraction == 0.1
    train, cal, ev = loader.load("train"), loader.load("cal"), loader.load(eval_split)
    assert list(cal.columns) == list(train.columns) and data_kind(cal) == data_kind(train)
    whole = hub_loader(name, hub_files[name], cal_fraction=0)
    assert whole.cal_split is None and digest(whole.load("train")) == before
    full = whole.load("train")
    assert len(train) + len(cal) == len(full) and set(train["id"]) | set(cal["id"]) == set(full["id"])
    assert set(cal["id"]) <= set(full["id"])   # cal ids are the training rows' ids
    for a, b in ((train, cal), (train, ev), (cal, ev)):
        assert not set(a["id"]) & set(b["id"])
    assert not prompts_of(train) & prompts_of(cal) and not prompts_of(cal) & prompts_of(ev)
    # round(0.1 x the prompts' groups) of them: the opening turn groups a prompt with its continuations
    openings = {p[0]["content"] for p in cal["prompt"]}
    assert len(openings) == round(0.1 * n_prompts)
    assert not openings & {p[0]["content"] for p in train["prompt"]}
    # the same from another loader and under another run seed; another sample_seed holds out other prompts
    pd.testing.assert_frame_equal(hub_loader(name, hub_files[name], seed=7).load("cal"), cal)
    others = [set(hub_loader(name, hub_files[name], sample_seed=s).load("cal")["id"]) for s in (1, 2, 3)]
    assert any(o != set(cal["id"]) for o in others)
    with pytest.raises(UserError) as err:
        whole.load("cal")
    assert one_line(err) == f"dataset '{name}' has no calibration split 'cal' (dataset.cal_fraction=0)"


def test_hub_num_samples_draw_from_the_rows_left_and_cal_does_not_move(hub_files):
    files = hub_files["ultrafeedback"]
    loader = hub_loader("ultrafeedback", files)
    cal = loader.load("cal")
    small = hub_loader("ultrafeedback", files, num_samples=10)
    train = small.load("train")
    assert len(train) == 10 and not set(train["id"]) & set(cal["id"])
    pd.testing.assert_frame_equal(small.load("cal"), cal)   # num_samples is the training rows' count only
    assert len(hub_loader("ultrafeedback", files, eval_num_samples=2).load("cal")) == 2
    assert set(hub_loader("ultrafeedback", files, eval_num_samples=2).load("cal")["id"]) <= set(cal["id"])


def test_hub_eval_only_datasets_and_bad_fractions(hub_files):
    for name in ("reward_bench", "reward_bench2"):
        loader = build_loader(load_dataset_config(name, seed=0))
        assert loader.cal_split is None
    for value in BAD_FRACTIONS:
        with pytest.raises(UserError) as err:
            hub_loader("ultrafeedback", hub_files["ultrafeedback"], cal_fraction=value)
        assert one_line(err).startswith("dataset.cal_fraction=")
    with pytest.raises(UserError, match=r"no split 'validation'; allowed: train, test, cal"):
        hub_loader("ultrafeedback", hub_files["ultrafeedback"]).load("validation")


# ------------------------------------------------------------------------------------------------ VADER sentences
def vader_corpora():
    """(id, ground-truth mean, text, raw ratings) per corpus: tweets and movie snippets one document per sentence,
    Amazon and NYT several sentences per document (<document>_<sentence>)."""
    def rows(prefix, ids):
        out = []
        for k, ident in enumerate(ids):
            base = ((k + len(prefix)) * 7) % 9 - 4
            ratings = [max(-4, min(4, base + d)) for d in (0, 1, -1, 0)]
            out.append((ident, f"{np.mean(ratings):.2f}", f"{prefix} sentence {ident} number {k}", ratings))
        return out

    return {"tweets": rows("tweet", [str(i) for i in range(1, 41)]),
            "movieReviewSnippets": rows("movie", [str(i) for i in range(1, 41)]),
            "amazonReviewSnippets": rows("amazon", [f"{d}_{s}" for d in range(1, 16) for s in range(1, 4)]),
            "nytEditorialSnippets": rows("nyt", [f"{d}_{s}" for d in range(1, 6) for s in range(1, 3)])}


# digests of the splits before cal existed (the fixture above, default settings)
BEFORE_CAL_VADER = {
    "VaderRatings": {"train": "acb7c0ccb5d627bc", "eval": "b55899b35fc44a19", "ood": "4a47e394d07630ab"},
    "VaderPairs": {"train": "b9c1cf495c6bcfcb", "eval": "071197187cec3613", "ood": "cb743e6170d110e4"},
}


@pytest.fixture
def vader_sdist(tmp_path):
    from test_vader_ratings import write_sdist

    from rewarduq_exp.data import vader_ratings

    return write_sdist(tmp_path / vader_ratings.SDIST, vader_corpora())


@pytest.mark.parametrize("cls", [VaderRatings, VaderPairs])
def test_vader_cal_holds_out_whole_documents(vader_sdist, cls):
    loader = cls(path=str(vader_sdist), cache_dir="unused")
    assert loader.cal_split == CAL_SPLIT and CAL_SPLIT not in loader.eval_splits
    frames = {s: loader.load(s) for s in ("train", "eval", "ood", "cal")}
    assert list(frames["cal"].columns) == list(frames["train"].columns)
    # eval and ood are those of before; train without cal is the train of before
    for split in ("eval", "ood"):
        assert digest(frames[split]) == BEFORE_CAL_VADER[cls.__name__][split]
    without = cls(path=str(vader_sdist), cache_dir="unused", cal_fraction=0)
    assert without.cal_split is None and digest(without.load("train")) == BEFORE_CAL_VADER[cls.__name__]["train"]
    # no document on two sides, no id twice
    documents = {s: set(loader.split_rows(s)["cv_group"]) for s in ("train", "eval", "ood", "cal")}
    for s in ("train", "eval", "ood"):
        assert not documents["cal"] & documents[s]
        assert not set(frames["cal"]["id"]) & set(frames[s]["id"])
    assert set(without.split_rows("train")["cv_group"]) == documents["train"] | documents["cal"]
    # about cal_fraction of the rows outside eval, whole documents, at least one
    rows = loader.split_rows("cal")
    outside_eval = len(without.split_rows("train"))
    assert 1 <= len(documents["cal"]) and len(rows) <= max(0.1 * outside_eval, rows["cv_group"].value_counts().max())
    # the same from another loader, and under another run seed (the data's own seed is fixed in the config)
    pd.testing.assert_frame_equal(cls(path=str(vader_sdist), cache_dir="unused").load("cal"), frames["cal"])
    name = "vader_ratings" if cls is VaderRatings else "vader_pairs"
    built = []
    for seed in (0, 5):
        cfg = load_dataset_config(name, seed=seed)
        cfg.path = str(vader_sdist)
        built.append(build_loader(cfg))
    assert (built[0].cal_fraction, built[0].sizes["cal"]) == (0.1, 500)
    pd.testing.assert_frame_equal(built[0].load("cal"), built[1].load("cal"))
    pd.testing.assert_frame_equal(built[0].load("cal"), frames["cal"])
    # n_cal takes the first rows
    few = cls(path=str(vader_sdist), cache_dir="unused", n_cal=2).load("cal")
    assert few["id"].tolist() == frames["cal"]["id"].tolist()[:2]


def test_vader_bad_settings_are_one_line(vader_sdist):
    for value in BAD_FRACTIONS:
        with pytest.raises(UserError) as err:
            VaderRatings(path=str(vader_sdist), cache_dir="unused", cal_fraction=value)
        assert one_line(err).startswith("dataset.cal_fraction=")
    with pytest.raises(UserError) as err:
        VaderRatings(path=str(vader_sdist), cache_dir="unused", n_cal=0)
    assert "dataset.n_cal=0 is invalid" in one_line(err) and "dataset.cal_fraction=0" in str(err.value)
    with pytest.raises(UserError) as err:
        VaderRatings(path=str(vader_sdist), cache_dir="unused", cal_fraction=0).load("cal")
    assert one_line(err) == "dataset 'vader_ratings' has no calibration split 'cal' (dataset.cal_fraction=0)"
