"""Users' own preference files (dataset=local) and dataset names (registry): formats, layouts, mappings, errors."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.contract import PREFERENCE_COLUMNS
from rewarduq_exp.data.local import LocalPreferenceFile
from rewarduq_exp.data.registry import available, build_loader, load_dataset_config, resolve_eval_sets, with_options


@pytest.fixture(autouse=True)
def private_datasets_cache(tmp_path, monkeypatch):
    """datasets.load_dataset writes an Arrow cache: keep it inside the test's temp folder."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def msg(role, content):
    return {"role": role, "content": content}


def contents(messages):
    return [(m["role"], m["content"]) for m in messages]


STRING_ROWS = [
    {"prompt": "What is 2+2?", "chosen": "Four.", "rejected": "Five."},
    {"prompt": "Name a colour.", "chosen": "Blue, of course", "rejected": "Seven"},
]


def check_contract(frame):
    assert tuple(frame.columns) == PREFERENCE_COLUMNS
    assert frame["weight"].dtype == np.float64
    assert all(isinstance(x, str) for x in frame["id"]) and all(isinstance(x, str) for x in frame["subset"])


# ---------------------------------------------------------------------------------------------- formats
def test_jsonl_plain_strings_with_defaults(tmp_path):
    """Plain-string rows become user/assistant messages; id, weight and subset get their defaults."""
    f = LocalPreferenceFile(str(write_jsonl(tmp_path / "pairs.jsonl", STRING_ROWS))).load("train")
    check_contract(f)
    assert f["id"].tolist() == ["train-0", "train-1"]
    assert f["weight"].tolist() == [1.0, 1.0]
    assert f["subset"].tolist() == ["", ""]
    assert contents(f.loc[0, "prompt"]) == [("user", "What is 2+2?")]
    assert contents(f.loc[1, "chosen"]) == [("assistant", "Blue, of course")]
    assert contents(f.loc[1, "rejected"]) == [("assistant", "Seven")]


def test_jsonl_implicit_prompt_layout_is_not_duplicated(tmp_path):
    """chosen/rejected that repeat the prompt's turns are reduced to the reply; explicit rows are left alone."""
    prompt = [msg("system", "Be kind."), msg("user", "Hi?")]
    rows = [
        {"prompt": prompt, "chosen": prompt + [msg("assistant", "Hello!")],
         "rejected": prompt + [msg("assistant", "Go away.")]},
        {"prompt": prompt, "chosen": [msg("assistant", "Hey.")], "rejected": [msg("assistant", "No.")]},
        # a multi-turn continuation after the repeated prompt is kept whole
        {"prompt": prompt, "chosen": prompt + [msg("assistant", "A"), msg("user", "B?"), msg("assistant", "C")],
         "rejected": prompt + [msg("assistant", "D")]},
    ]
    f = LocalPreferenceFile(str(write_jsonl(tmp_path / "chat.jsonl", rows))).load("train")
    check_contract(f)
    assert contents(f.loc[0, "prompt"]) == [("system", "Be kind."), ("user", "Hi?")]
    assert contents(f.loc[0, "chosen"]) == [("assistant", "Hello!")]
    assert contents(f.loc[0, "rejected"]) == [("assistant", "Go away.")]
    assert contents(f.loc[1, "chosen"]) == [("assistant", "Hey.")]
    assert contents(f.loc[2, "chosen"]) == [("assistant", "A"), ("user", "B?"), ("assistant", "C")]
    assert contents(f.loc[2, "rejected"]) == [("assistant", "D")]


def test_implicit_layout_with_string_prompt(tmp_path):
    """A plain-string prompt also matches a chosen list that starts with that user turn."""
    rows = [{"prompt": "Hi?", "chosen": [msg("user", "Hi?"), msg("assistant", "Yes")],
             "rejected": [msg("user", "Hi?"), msg("assistant", "No")]}]
    f = LocalPreferenceFile(str(write_jsonl(tmp_path / "x.jsonl", rows))).load("train")
    assert contents(f.loc[0, "chosen"]) == [("assistant", "Yes")]
    assert contents(f.loc[0, "rejected"]) == [("assistant", "No")]


def test_parquet_with_messages_and_optional_columns(tmp_path):
    """Parquet list-of-struct message columns load; id, weight and subset are taken from the file."""
    table = pd.DataFrame({
        "id": ["a1", "b2"],
        "prompt": [[msg("user", "Q1")], [msg("user", "Q2")]],
        "chosen": [[msg("assistant", "good 1")], [msg("assistant", "good 2")]],
        "rejected": [[msg("assistant", "bad 1")], [msg("assistant", "bad 2")]],
        "weight": [0.25, 3.0],
        "subset": ["math", "chat"],
    })
    table.to_parquet(tmp_path / "pairs.parquet")
    f = LocalPreferenceFile(str(tmp_path / "pairs.parquet")).load("train")
    check_contract(f)
    assert f["id"].tolist() == ["a1", "b2"]
    assert f["weight"].tolist() == [0.25, 3.0]
    assert f["subset"].tolist() == ["math", "chat"]
    assert contents(f.loc[1, "prompt"]) == [("user", "Q2")]
    assert contents(f.loc[1, "rejected"]) == [("assistant", "bad 2")]
    assert isinstance(f.loc[0, "chosen"], list)


def test_csv_with_integer_ids(tmp_path):
    """CSV strings load; numeric ids become strings; a weight column is read as float."""
    pd.DataFrame({
        "id": [10, 11],
        "prompt": ["Say hi, politely", "Say bye"],
        "chosen": ["Hi there", "Bye now"],
        "rejected": ["hi", "go"],
        "weight": [2, 1],
    }).to_csv(tmp_path / "pairs.csv", index=False)
    f = LocalPreferenceFile(str(tmp_path / "pairs.csv")).load("train")
    check_contract(f)
    assert f["id"].tolist() == ["10", "11"]
    assert f["weight"].tolist() == [2.0, 1.0]
    assert f["subset"].tolist() == ["", ""]
    assert contents(f.loc[0, "prompt"]) == [("user", "Say hi, politely")]
    assert contents(f.loc[1, "chosen"]) == [("assistant", "Bye now")]


def test_json_array_file(tmp_path):
    """A .json file holding an array of objects is read like JSONL."""
    (tmp_path / "pairs.json").write_text(json.dumps(STRING_ROWS))
    f = LocalPreferenceFile(str(tmp_path / "pairs.json")).load("train")
    assert contents(f.loc[1, "rejected"]) == [("assistant", "Seven")]


def test_custom_column_mapping(tmp_path):
    """dataset.columns.* maps the user's column names onto the contract, optional columns included."""
    rows = [{"uid": "q-1", "question": "Why?", "good": "Because.", "bad": "Dunno.", "w": 0.5, "src": "faq"}]
    path = write_jsonl(tmp_path / "custom.jsonl", rows)
    cols = {"prompt": "question", "chosen": "good", "rejected": "bad", "id": "uid", "weight": "w", "subset": "src"}
    f = LocalPreferenceFile(str(path), columns=cols).load("train")
    check_contract(f)
    assert f.loc[0, "id"] == "q-1" and f.loc[0, "weight"] == 0.5 and f.loc[0, "subset"] == "faq"
    assert contents(f.loc[0, "prompt"]) == [("user", "Why?")]
    assert contents(f.loc[0, "chosen"]) == [("assistant", "Because.")]
    assert contents(f.loc[0, "rejected"]) == [("assistant", "Dunno.")]


def test_local_config_through_hydra(tmp_path):
    """conf/dataset/local.yaml with path/eval_path/column overrides builds a loader that reads both splits."""
    write_jsonl(tmp_path / "train.jsonl", [{"q": "a", "chosen": "b", "rejected": "c"}])
    write_jsonl(tmp_path / "eval.jsonl", [{"q": "d", "chosen": "e", "rejected": "f"}] * 3)
    cfg = load_dataset_config("local", seed=0)
    cfg.path = str(tmp_path / "train.jsonl")
    cfg.eval_path = str(tmp_path / "eval.jsonl")
    cfg.columns.prompt = "q"
    cfg.cal_fraction = 0    # one training row: no prompt to spare for the calibration split
    loader = build_loader(cfg)
    assert (loader.name, loader.train_split, loader.eval_splits) == ("local", "train", ("eval",))
    train, ev = loader.load("train"), loader.load("eval")
    assert contents(train.loc[0, "prompt"]) == [("user", "a")]
    assert ev["id"].tolist() == ["eval-0", "eval-1", "eval-2"]
    assert contents(ev.loc[2, "chosen"]) == [("assistant", "e")]


def write_jsonl_gz(path, rows):
    import gzip

    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def test_jsonl_gz_in_hh_rlhf_schema_reads_transcripts(tmp_path):
    """A .jsonl.gz file in the exact Anthropic/hh-rlhf schema loads; shared turns become the prompt."""
    rows = [
        {"chosen": "\n\nHuman: What is 2+2?\n\nAssistant: Four.",
         "rejected": "\n\nHuman: What is 2+2?\n\nAssistant: Five."},
        {"chosen": "\n\nHuman: Hi!\n\nAssistant: Hello.\n\nHuman: A colour?\n\nAssistant: Blue.",
         "rejected": "\n\nHuman: Hi!\n\nAssistant: Hello.\n\nHuman: A colour?\n\nAssistant: Seven."},
        {"chosen": "no transcript markers here", "rejected": "\n\nHuman: hi\n\nAssistant: x"},  # dropped, counted
    ]
    cfg = load_dataset_config("local", seed=0)
    cfg.path = str(write_jsonl_gz(tmp_path / "train.jsonl.gz", rows))
    cfg.eval_fraction = 0   # the whole file as split train: no prompt held out
    cfg.cal_fraction = 0
    f = build_loader(cfg).load("train")
    check_contract(f)
    assert f["id"].tolist() == ["train-0", "train-1"] and f.attrs["dropped_unsplittable"] == 1
    assert contents(f.loc[0, "prompt"]) == [("user", "What is 2+2?")]
    assert contents(f.loc[0, "chosen"]) == [("assistant", "Four.")]
    assert contents(f.loc[0, "rejected"]) == [("assistant", "Five.")]
    assert contents(f.loc[1, "prompt"]) == [("user", "Hi!"), ("assistant", "Hello."), ("user", "A colour?")]
    assert contents(f.loc[1, "chosen"]) == [("assistant", "Blue.")]
    assert contents(f.loc[1, "rejected"]) == [("assistant", "Seven.")]


def test_compressed_plain_pairs(tmp_path):
    """Any readable type may be compressed: a .jsonl.gz of plain-string pairs reads like its .jsonl."""
    f = LocalPreferenceFile(str(write_jsonl_gz(tmp_path / "pairs.jsonl.gz", STRING_ROWS))).load("train")
    assert contents(f.loc[1, "chosen"]) == [("assistant", "Blue, of course")]


def test_plain_strings_without_prompt_column_say_what_is_needed(tmp_path):
    """Plain-string replies with no prompt column and no transcripts: one line naming both ways to fix it."""
    path = write_jsonl(tmp_path / "x.jsonl", [{"chosen": "Four.", "rejected": "Five."}])
    with pytest.raises(UserError, match=r"x\.jsonl.*no 'prompt' column.*dataset\.columns\.prompt.*Human:"):
        LocalPreferenceFile(str(path)).load("train")


# ---------------------------------------------------------------------------------------------- errors
def test_missing_column_names_it_and_lists_found(tmp_path):
    """A file without 'chosen' says so, lists what it found, and tells how to map it."""
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "good": "c", "rejected": "r"}])
    with pytest.raises(UserError) as err:
        LocalPreferenceFile(str(path)).load("train")
    msg_ = str(err.value)
    assert "missing column 'chosen'" in msg_
    assert "found: prompt, good, rejected" in msg_
    assert "dataset.columns.chosen" in msg_


def test_missing_mapped_column_names_the_mapped_name(tmp_path):
    """With a custom mapping the error names the user's column (the one that is absent)."""
    path = write_jsonl(tmp_path / "x.jsonl", STRING_ROWS)
    with pytest.raises(UserError, match=r"missing column 'question' \(for prompt\)"):
        LocalPreferenceFile(str(path), columns={"prompt": "question"}).load("train")


def test_unknown_extension(tmp_path):
    """A .txt file is refused with the allowed types."""
    path = tmp_path / "pairs.txt"
    path.write_text("x")
    with pytest.raises(UserError, match=r"dataset\.path=.*unsupported file type '\.txt'.*\.jsonl.*\.parquet.*\.csv"):
        LocalPreferenceFile(str(path)).load("train")
    (tmp_path / "pairs.txt.gz").write_bytes(b"")
    with pytest.raises(UserError, match=r"unsupported file type '\.txt\.gz'.*optionally compressed"):
        LocalPreferenceFile(str(tmp_path / "pairs.txt.gz")).load("train")


def test_missing_file(tmp_path):
    """A path that does not exist names the setting and says the file is missing."""
    with pytest.raises(UserError, match=r"dataset\.path=.*nope\.jsonl: file not found"):
        LocalPreferenceFile(str(tmp_path / "nope.jsonl")).load("train")
    with pytest.raises(UserError, match=r"dataset\.eval_path=.*gone\.csv: file not found"):
        LocalPreferenceFile(str(tmp_path / "nope.jsonl"), eval_path=str(tmp_path / "gone.csv")).load("eval")


def test_eval_split_without_eval_path_or_held_out_share(tmp_path):
    """With eval_fraction=0 and no eval_path there is no eval split: the error points at both settings."""
    path = write_jsonl(tmp_path / "x.jsonl", STRING_ROWS)
    with pytest.raises(UserError, match=r"split 'eval'.*dataset\.eval_path.*dataset\.eval_fraction"):
        LocalPreferenceFile(str(path), eval_fraction=0).load("eval")


def test_without_eval_path_a_share_of_the_prompts_is_held_out(tmp_path):
    """dataset=local dataset.path=<file> alone: the eval split is the rows of about eval_fraction of the prompts,
    the train split the others; no prompt is in both, every row is in one, and the sides do not depend on the order
    of the rows."""
    rows = [{"prompt": f"question {i % 50}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(400)]
    path = write_jsonl(tmp_path / "x.jsonl", rows)
    loader = LocalPreferenceFile(str(path), eval_fraction=0.2)
    train, held = loader.load("train"), loader.load("eval")
    assert len(train) + len(held) == 400
    assert not set(train["prompt"].map(str)) & set(held["prompt"].map(str))
    assert held["prompt"].map(str).nunique() == 10          # 0.2 of the 50 prompts
    check_contract(held)
    shuffled = write_jsonl(tmp_path / "y.jsonl", rows[::-1])
    again = LocalPreferenceFile(str(shuffled), eval_fraction=0.2).load("eval")
    assert set(again["chosen"].map(str)) == set(held["chosen"].map(str))


def test_a_held_out_share_keeps_a_prompt_on_each_side(tmp_path):
    """A tiny share still holds out one prompt and never all of them; one prompt alone cannot be split."""
    path = write_jsonl(tmp_path / "x.jsonl", STRING_ROWS)
    loader = LocalPreferenceFile(str(path), eval_fraction=1e-9)
    assert len(loader.load("eval")) == len(loader.load("train")) == 1
    assert len(LocalPreferenceFile(str(path), eval_fraction=0.99).load("train")) == 1
    single = write_jsonl(tmp_path / "one.jsonl", [STRING_ROWS[0]] * 3)
    with pytest.raises(UserError, match=r"share one prompt.*dataset\.eval_path"):
        LocalPreferenceFile(str(single), eval_fraction=0.1).load("eval")
    with pytest.raises(UserError, match=r"dataset\.eval_fraction=1 is invalid"):
        LocalPreferenceFile(str(path), eval_fraction=1)


def test_unknown_split(tmp_path):
    """Only train and eval exist."""
    path = write_jsonl(tmp_path / "x.jsonl", STRING_ROWS)
    with pytest.raises(UserError, match=r"not 'test'"):
        LocalPreferenceFile(str(path)).load("test")


def test_malformed_file_is_a_user_error(tmp_path):
    """A file that is not valid JSON is reported as the user's input (a UserError), not a library traceback."""
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{not json\n')
    with pytest.raises(UserError, match=r"could not be read as json"):
        LocalPreferenceFile(str(path)).load("train")


def test_bad_values_in_file(tmp_path):
    """A message with an unknown role or a negative weight in the file is a UserError naming the file."""
    rows = [{"prompt": [msg("human", "hi")], "chosen": "a", "rejected": "b"}]
    with pytest.raises(UserError, match=r"bad_role\.jsonl.*column 'prompt'"):
        LocalPreferenceFile(str(write_jsonl(tmp_path / "bad_role.jsonl", rows))).load("train")
    rows = [dict(STRING_ROWS[0], weight=-1.0)]
    with pytest.raises(UserError, match=r"neg\.jsonl.*'weight'"):
        LocalPreferenceFile(str(write_jsonl(tmp_path / "neg.jsonl", rows))).load("train")


def test_malformed_file_message_says_what_is_wrong(tmp_path):
    """The one-line error for a broken file should carry the parser's explanation, and the line (from 1)."""
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{not json\n')
    with pytest.raises(UserError) as err:
        LocalPreferenceFile(str(path)).load("train")
    assert "not valid JSON at line 2: Expecting property name" in str(err.value)


def write_empty(path):
    """An empty data file of the kind its name says (a CSV with only its header, a Parquet file with the schema)."""
    if path.name == "header_only.csv":
        path.write_text("prompt,chosen,rejected\n")
    elif path.suffix == ".parquet":
        pd.DataFrame({c: pd.Series([], dtype=str) for c in ("prompt", "chosen", "rejected")}).to_parquet(path)
    elif path.name.endswith(".gz"):
        write_jsonl_gz(path, [])
    else:
        path.write_text("\n" if path.suffix == ".jsonl" else "")
    return path


EMPTY_FILES = {"empty.jsonl": "the file is empty", "empty.csv": "the file is empty",
               "header_only.csv": "only a header line", "empty.parquet": "", "empty.jsonl.gz": "the file is empty"}


@pytest.mark.parametrize("name", EMPTY_FILES)
def test_empty_file_says_it_has_no_rows(tmp_path, name):
    """Empty files, a header-only CSV and an empty Parquet file are refused in one line naming the file."""
    path = write_empty(tmp_path / name)
    with pytest.raises(UserError, match=rf"^dataset\.path={re.escape(str(path))}: file has no rows"
                                        rf"{re.escape(f' ({EMPTY_FILES[name]})' if EMPTY_FILES[name] else '')}$"):
        LocalPreferenceFile(str(path)).load("train")


@pytest.mark.parametrize("name", EMPTY_FILES)
def test_empty_data_files_of_a_hub_dataset_say_they_have_no_rows(tmp_path, name):
    """The same files given to a hub dataset as dataset.data_files get the same clear error."""
    path = write_empty(tmp_path / name)
    for dataset in ("ultrafeedback", "hh_rlhf"):
        cfg = load_dataset_config(dataset, seed=0)
        cfg.data_files = str(path)
        with pytest.raises(UserError, match=rf"^dataset '{dataset}': data file {re.escape(str(path))} has no rows"):
            build_loader(cfg).load("train")


def test_csv_with_numeric_looking_answers(tmp_path):
    """A CSV of arithmetic preferences (answers are numbers) is ordinary text data and should load."""
    pd.DataFrame({"prompt": ["2+2?", "3+3?"], "chosen": ["4", "6"], "rejected": ["5", "7"]}).to_csv(
        tmp_path / "math.csv", index=False)
    f = LocalPreferenceFile(str(tmp_path / "math.csv")).load("train")
    assert contents(f.loc[0, "chosen"]) == [("assistant", "4")]


# ---------------------------------------------------------------------------------------------- registry
def test_resolve_eval_sets_default_is_training_eval_splits():
    """No eval_datasets: the training dataset's own eval splits, named <name>_<split>, with the run's config."""
    train_cfg = load_dataset_config("synthetic", seed=0)
    train_cfg.n_ood = 17  # a command-line override must reach the eval sets
    sets = resolve_eval_sets(None, train_cfg, seed=0)
    assert [(s.name, s.split) for s in sets] == [("synthetic_eval", "eval"), ("synthetic_ood", "ood")]
    assert all(s.config.n_ood == 17 for s in sets)


def test_resolve_eval_sets_named_split():
    """'synthetic_ood' is one eval set, split ood, whose config builds a working loader."""
    sets = resolve_eval_sets("synthetic_ood", None, seed=0)
    assert len(sets) == 1
    (s,) = sets
    assert (s.name, s.split, s.config.name) == ("synthetic_ood", "ood", "synthetic")
    s.config.n_ood = 25
    frame = build_loader(s.config).load(s.split)
    assert len(frame) == 25 and (frame["subset"] == "ood").all()


def test_resolve_eval_sets_uses_run_config_for_training_dataset():
    """An explicitly named split of the training dataset comes from the run's (overridden) world, not the yaml."""
    train_cfg = load_dataset_config("synthetic", seed=0)
    train_cfg.seed = 99
    (s,) = resolve_eval_sets(["synthetic_eval"], train_cfg, seed=0)
    assert s.config.seed == 99
    (t,) = resolve_eval_sets(["synthetic_eval"], None, seed=0)
    assert t.config.seed == 0


def test_resolve_eval_sets_plain_name_expands_to_its_eval_splits():
    """A bare dataset name means all of its eval splits."""
    sets = resolve_eval_sets(["synthetic"], None, seed=0)
    assert [s.name for s in sets] == ["synthetic_eval", "synthetic_ood"]


@pytest.mark.parametrize("name", ["no-such-data", "no-such-data_eval", "no_such_data_train"])
def test_resolve_eval_sets_unknown_name(name):
    """An unknown name is a UserError that repeats it and lists the dataset names that exist."""
    allowed = available("dataset")
    assert {"local", "synthetic"} <= set(allowed)
    with pytest.raises(UserError, match=rf"unknown eval dataset '{re.escape(name)}'.*{re.escape(', '.join(allowed))}"):
        resolve_eval_sets([name], None, seed=0)


def test_resolve_eval_sets_without_anything():
    """No eval names and no training dataset: nothing to evaluate is an error, not an empty list."""
    with pytest.raises(UserError, match="no dataset to evaluate"):
        resolve_eval_sets(None, None, seed=0)


def test_build_loader_surfaces_user_errors():
    """Hydra's wrapped exceptions are unwrapped: a bad value or an unknown key is a one-line UserError."""
    cfg = load_dataset_config("synthetic", seed=0)
    cfg.n_train = 0
    with pytest.raises(UserError, match=r"dataset\.n_train=0"):
        build_loader(cfg)
    cfg = load_dataset_config("synthetic", seed=0)
    cfg.n_trian = 5
    with pytest.raises(UserError, match=r"dataset\.n_trian is not a setting of SyntheticWorld; allowed: .*n_train"):
        build_loader(cfg)


def test_with_options_sets_keys_of_each_eval_set_and_leaves_the_run_config(tmp_path):
    """evaluate.py's dataset.<key>=... options: set in a copy of every evaluated config, nested keys included."""
    write_jsonl(tmp_path / "eval.jsonl", [{"q": "a", "chosen": "b", "rejected": "c"}])
    train_cfg = load_dataset_config("local", seed=0)
    train_cfg.path = str(tmp_path / "eval.jsonl")
    (es,) = with_options(resolve_eval_sets(["local_eval"], train_cfg, seed=0),
                         {"eval_path": str(tmp_path / "eval.jsonl"), "columns": {"prompt": "q"}})
    assert es.config.columns.prompt == "q" and es.config.columns.chosen == "chosen"
    assert train_cfg.eval_path is None and train_cfg.columns.prompt == "prompt"
    assert contents(build_loader(es.config).load("eval").loc[0, "prompt"]) == [("user", "a")]
    sets = with_options(resolve_eval_sets(["synthetic"], None, seed=0), {"n_ood": 7})
    assert [s.config.n_ood for s in sets] == [7, 7]


@pytest.mark.parametrize("names, options, message", [
    (["hh_rlhf_test"], {"subset": ["harmless-base"]},
     r"^dataset\.subset is not a setting of dataset 'hh_rlhf'; allowed: dataset\.hub_id, .*dataset\.subsets, "),
    (["local_eval"], {"columns": {"promt": "q"}},
     r"^dataset\.columns\.promt is not a setting of dataset 'local'; allowed: dataset\.columns\.prompt, "),
    (["local_eval"], {"columns": "q"}, r"^dataset\.columns is a group of settings.*dataset\.columns\.prompt="),
    (["synthetic_ood", "hh_rlhf_test"], {"subsets": ["harmless-base"]},
     r"^dataset\.subsets is not a setting of dataset 'synthetic'"),
])
def test_with_options_unknown_key_names_the_allowed_keys(names, options, message):
    with pytest.raises(UserError, match=message):
        with_options(resolve_eval_sets(names, None, seed=0), options)


def test_build_loader_without_a_required_file_says_which_key():
    """dataset=local named without its file (e.g. by evaluate.py): one line naming dataset.path."""
    with pytest.raises(UserError, match=r"dataset 'local' needs dataset\.path: pass dataset\.path=<value>"):
        build_loader(load_dataset_config("local", seed=0))


def test_synthetic_yaml_matches_code_defaults():
    """conf/dataset/synthetic.yaml and SyntheticWorld()'s defaults describe the same world."""
    from rewarduq_exp.data.synthetic import SyntheticWorld

    from_yaml = build_loader(load_dataset_config("synthetic", seed=0))
    default = SyntheticWorld()
    assert vars(from_yaml).keys() == vars(default).keys()
    for key, value in vars(default).items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(getattr(from_yaml, key), value)
        else:
            assert getattr(from_yaml, key) == value, key
