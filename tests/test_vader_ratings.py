"""dataset=vader_ratings: human sentiment ratings of real sentences (the VADER paper's data, shipped in the sdist of
vaderSentiment==3.3.2 on PyPI). Read from a small archive written here in the sdist's exact layout and file formats
(tab-separated, CRLF, a byte-order mark on the Amazon ratings file, HTML entities in tweets); never downloaded."""

import io
import json
import os
import stat
import tarfile

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT
from entry_points import run_entry_point
from strict_files import assert_strict_json_files

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data import vader_ratings
from rewarduq_exp.data.vader_ratings import VaderPairs, VaderRatings

# (id, ground-truth mean, text, raw ratings) per corpus. Tweet 2's ground-truth mean (1.0) disagrees with its
# ratings, as 199 real tweets do; NYT and Amazon ids are <document>_<sentence>.
CORPORA = {
    "tweets": [("1", "2.5", "I love love love this &amp; you", [2, 3, 3, 2]),
               ("2", "1.0", "Yay. Another good phone interview.", [2, 2, 2, 3]),
               ("3", "-3", "STUPID rain!!", [-3, -4, -2, -3])],
    "movieReviewSnippets": [("1", "2.2", "The Rock is destined to be a star.", [2, 3, 1, 3]),
                            ("2", "-0.6", "Effective but too tepid biopic", [0, -1, -1, 0]),
                            ("3", "-0.6", "Effective but too tepid biopic", [0, -1, -1, 0])],   # a repeat
    "amazonReviewSnippets": [("1_1", "-0.9", "troubleshooting no picture.", [0, -1, -2, 0]),
                             ("1_2", "-0.25", "repost with a better title.", [0, 0, -1, 0]),
                             ("2_1", "3.5", "Best player I ever owned!", [4, 3, 4, 3])],
    "nytEditorialSnippets": [("1_1", "0.5", "The city plans the First Santa Claus Ulympics.", [0, 1, 1, 0]),
                             ("1_2", "1.5", "Toys will be given to homeless kids.", [1, 2, 2, 1])],
}


def _tar(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def ratings_files(corpora=CORPORA) -> dict[str, bytes]:
    files = {}
    for prefix, rows in corpora.items():
        truth = "\r\n".join(f"{i}\t{m}\t{t}" for i, m, t, _ in rows)
        ratings = "\r\n".join(f"{i}\t{np.mean(r)}\t{np.std(r):.5f}\t{r}" for i, _, _, r in rows)
        bom = "\ufeff" if prefix == "amazonReviewSnippets" else ""
        files[f"{prefix}_GroundTruth.txt"] = truth.encode()
        files[f"{prefix}_anonDataRatings.txt"] = (bom + ratings).encode()
    return files


def write_sdist(path, corpora=CORPORA):
    inner = _tar({f"hutto_ICWSM_2014/{name}": data for name, data in ratings_files(corpora).items()})
    path.write_bytes(_tar({"vaderSentiment-3.3.2/setup.py": b"", "vaderSentiment-3.3.2/additional_resources/"
                           "hutto_ICWSM_2014.tar.gz": inner}))
    return path


@pytest.fixture
def sdist(tmp_path):
    return write_sdist(tmp_path / vader_ratings.SDIST)


def loader(path, **kwargs):
    return VaderRatings(path=str(path), cache_dir="unused", **kwargs)


def test_scores_are_the_raw_ratings_mean_on_the_1_to_5_scale(sdist):
    data = loader(sdist, eval_fraction=0.4)
    rows = pd.concat([data.load("train"), data.load("eval"), data.load("cal")]).set_index("id")
    # the mean of the raw ratings wins over the ground-truth file's: tweet 2 is 2.25, not 1.0
    assert rows.loc["vader-tweets-2", "mean_rating"] == 2.25
    assert rows.loc["vader-tweets-2", "score"] == pytest.approx(3 + 2.25 / 2)
    assert rows.loc["vader-tweets-3", "score"] == pytest.approx(3 - 3 / 2)
    assert rows.loc["vader-tweets-3", "rater_std"] == pytest.approx(np.std([-3, -4, -2, -3]))
    assert rows.loc["vader-tweets-1", "n_raters"] == 4
    assert rows.loc["vader-tweets-1", "response"][0]["content"] == "I love love love this & you"  # unescaped
    assert rows.loc["vader-tweets-1", "prompt"] == [{"role": "user", "content": "Write a tweet."}]
    assert rows.loc["vader-amazon_reviews-1_1", "score"] == pytest.approx(3 - 0.75 / 2)  # id read past the BOM
    # the repeated movie snippet is kept once; train, eval and cal share no document; ood is the NYT corpus
    assert len(rows) == 8 and rows.index.is_unique
    train, evals, cal = data.load("train"), data.load("eval"), data.load("cal")
    assert not set(train["cv_group"]) & set(evals["cv_group"])
    assert not set(cal["cv_group"]) & (set(train["cv_group"]) | set(evals["cv_group"]))
    assert (rows.loc[["vader-amazon_reviews-1_1", "vader-amazon_reviews-1_2"], "cv_group"] == "amazon_reviews-1").all()
    ood = data.load("ood")
    assert list(ood["subset"].unique()) == ["nyt_editorials"] and len(ood) == 2
    assert rows["score"].between(1, 5).all()


def test_the_sdist_its_inner_archive_and_a_folder_read_the_same(tmp_path, sdist):
    folder = tmp_path / "extracted"
    folder.mkdir()
    for name, data in ratings_files().items():
        (folder / name).write_bytes(data)
    inner = tmp_path / vader_ratings.INNER_ARCHIVE
    inner.write_bytes(_tar(ratings_files()))
    frames = [loader(p).load("train") for p in (sdist, inner, folder)]
    for frame in frames[1:]:
        pd.testing.assert_frame_equal(frame, frames[0])


def test_sizes_take_a_fixed_random_order_and_splits_do_not_move(sdist):
    full = loader(sdist, eval_fraction=0.3)
    small = loader(sdist, eval_fraction=0.3, n_train=2, n_eval=1)
    assert list(small.load("train")["id"]) == list(full.load("train")["id"])[:2]
    assert list(small.load("eval")["id"]) == list(full.load("eval")["id"])[:1]
    # corpora are configurable: the ood split can be the tweets
    swapped = loader(sdist, corpora=["movie_reviews", "nyt_editorials"], ood_corpora="tweets")
    assert set(swapped.load("ood")["subset"]) == {"tweets"}


@pytest.mark.parametrize("kwargs, message", [
    ({"corpora": ["tweets", "reddit"]}, "dataset.corpora=['tweets', 'reddit'] is invalid: name one or more of tweets"),
    ({"ood_corpora": []}, "dataset.ood_corpora=[] is invalid"),
    ({"corpora": ["tweets"], "ood_corpora": ["tweets"]}, "dataset.corpora and dataset.ood_corpora share tweets"),
    ({"eval_fraction": 1.0}, "dataset.eval_fraction=1.0 is invalid: must be strictly between 0 and 1"),
    ({"n_train": 0}, "dataset.n_train=0 is invalid: must be a positive integer"),
])
def test_bad_settings_are_one_line(sdist, kwargs, message):
    with pytest.raises(UserError) as err:
        loader(sdist, **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_sources_are_one_line(tmp_path, sdist):
    cases = [(tmp_path / "missing.tar.gz", "dataset.path=")]
    not_tar = tmp_path / "notes.tar.gz"
    not_tar.write_text("hello")
    cases.append((not_tar, "is not a readable tar archive"))
    partial = tmp_path / "partial.tar.gz"
    partial.write_bytes(_tar({k: v for k, v in ratings_files().items() if not k.startswith("nyt")}))
    cases.append((partial, "has no nytEditorialSnippets_GroundTruth.txt"))
    broken = tmp_path / "broken"
    broken.mkdir()
    for name, data in ratings_files().items():
        (broken / name).write_bytes(data.replace(b"\t", b" ") if name.startswith("tweets_anon") else data)
    cases.append((broken, "tweets_anonDataRatings.txt line 1 has 1 tab-separated fields, expected 4"))
    for path, message in cases:
        with pytest.raises(UserError) as err:
            loader(path).load("train")
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(UserError, match="split 'test' does not exist; allowed: train, eval, ood"):
        loader(sdist).load("test")


def test_download_goes_through_pip_once_and_is_checked(tmp_path, sdist, monkeypatch):
    cache = tmp_path / "cache"
    with pytest.raises(UserError, match="dataset.download=false; fetch it with pip download --no-deps"):
        VaderRatings(cache_dir=str(cache), download=False).load("train")

    calls = []

    def fake_pip(cmd, **kwargs):  # what pip download does: the sdist into the -d folder
        calls.append(cmd)
        target = cmd[cmd.index("-d") + 1]
        # the fixture's very bytes (writing the archive again would stamp another second into its gzip header, and
        # its hash would differ from the fixture's whenever a second boundary fell in between)
        (type(sdist)(target) / vader_ratings.SDIST).write_bytes(sdist.read_bytes())
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(vader_ratings.subprocess, "run", fake_pip)
    # the fixture is not the published file: refused by its hash, nothing left in the cache
    with pytest.raises(UserError, match="has SHA-256 .* not the published"):
        VaderRatings(cache_dir=str(cache)).load("train")
    assert not (cache / "downloads" / vader_ratings.SDIST).exists()
    assert calls[0][1:4] == ["-m", "pip", "download"] and vader_ratings.REQUIREMENT in calls[0]

    import hashlib
    monkeypatch.setattr(vader_ratings, "SDIST_SHA256", hashlib.sha256(sdist.read_bytes()).hexdigest())
    old = os.umask(0o002)
    try:
        frame = VaderRatings(cache_dir=str(cache)).load("train")
        VaderRatings(cache_dir=str(cache)).load("eval")  # the second loader finds the file
    finally:
        os.umask(old)
    assert len(frame) > 0 and len(calls) == 2
    mode = stat.S_IMODE((cache / "downloads" / vader_ratings.SDIST).stat().st_mode)
    assert mode == 0o664  # the umask's permissions, for shared caches

    def failing_pip(cmd, **kwargs):
        return type("Done", (), {"returncode": 1, "stderr": "ERROR: No matching distribution found"})()

    monkeypatch.setattr(vader_ratings.subprocess, "run", failing_pip)
    with pytest.raises(UserError) as err:
        VaderRatings(cache_dir=str(tmp_path / "other")).load("train")
    assert "No matching distribution found" in str(err.value) and "dataset.path=" in str(err.value)


def test_pairs_prefer_the_sentence_the_raters_found_more_positive(sdist):
    # no calibration split: every sentence outside eval is in train
    pairs = VaderPairs(path=str(sdist), cache_dir="unused", eval_fraction=0.01, cal_fraction=0, min_gap=0.0)
    train = pairs.load("train")
    ratings = VaderRatings(path=str(sdist), cache_dir="unused", eval_fraction=0.01, cal_fraction=0).load("train")
    mean = {r[0]["content"]: m for r, m in zip(ratings["response"], ratings["mean_rating"])}
    corpus = {r[0]["content"]: c for r, c in zip(ratings["response"], ratings["subset"])}
    for _, row in train.iterrows():
        chosen, rejected = row["chosen"][0]["content"], row["rejected"][0]["content"]
        assert mean[chosen] > mean[rejected] and row["true_gap"] == pytest.approx(mean[chosen] - mean[rejected])
        assert corpus[chosen] == corpus[rejected] == row["subset"]  # pairs never mix corpora
        assert row["prompt"][0]["content"].endswith("with a positive feeling.")
    # each corpus's sentences are used once: 3 tweets -> 1 pair, 2 movie snippets -> 1, 3 Amazon -> 1
    assert len(train) == 3 and set(train["subset"]) == {"tweets", "movie_reviews", "amazon_reviews"}
    assert list(train.columns[:6]) == ["id", "prompt", "chosen", "rejected", "weight", "subset"]
    # a large min_gap leaves nothing: one line
    with pytest.raises(UserError, match="split 'ood' has no pair with a rating gap >= dataset.min_gap=9"):
        VaderPairs(path=str(sdist), cache_dir="unused", min_gap=9).load("ood")
    with pytest.raises(UserError, match="dataset.min_gap=-1 is invalid"):
        VaderPairs(path=str(sdist), cache_dir="unused", min_gap=-1)


def larger_sdist(path):
    """36 sentences per corpus (12 documents of 3), varied ratings."""
    return write_sdist(path, {
        prefix: [(f"{d}_{s}", "0", f"{prefix} document {d} sentence {s} " + ("good " if (d + s) % 2 else "bad ") * d,
                  [(d + s) % 2 * 2 - 1, (d + s) % 3 - 1, d % 2]) for d in range(1, 13) for s in range(1, 4)]
        for prefix in vader_ratings.CORPORA.values()})


def train_run(tmp_path, cache, args):
    folder = tmp_path / "run"
    args = [f"paths.output_root={tmp_path / 'outputs'}", f"paths.cache_dir={cache}", "progress=false", *args,
            f"hydra.run.dir={folder}"]
    proc = run_entry_point(ROOT / "train.py", args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return folder, proc


@pytest.mark.e2e
def test_ens_mlp_on_vader_pairs_through_train_py(tmp_path, shared_cache):
    sdist = larger_sdist(tmp_path / vader_ratings.SDIST)
    folder, proc = train_run(tmp_path, shared_cache, ["method=ens_mlp", "dataset=vader_pairs", f"dataset.path={sdist}",
                                                  "dataset.min_gap=0.5"])
    metrics = json.loads((folder / "metrics.json").read_text())
    assert set(metrics) == {"vader_pairs_eval", "vader_pairs_ood"}
    assert all(0 <= block["win_rate"] <= 1 and block["n_pairs"] > 0 for block in metrics.values())
    assert "truth/bayes_win_rate" not in metrics["vader_pairs_eval"]  # human data: no hidden true reward


@pytest.mark.e2e
def test_borp_sentiment_probe_on_vader_ratings_through_train_py(tmp_path, shared_cache):
    sdist = larger_sdist(tmp_path / vader_ratings.SDIST)
    folder, proc = train_run(tmp_path, shared_cache, [
            "method=borp", "probe=borp_sentiment", "dataset=vader_ratings", f"dataset.path={sdist}",
            "dataset.n_train=60", "dataset.n_eval=30", "dataset.n_ood=20", "method.n_components=2",
            "model.build.num_layers=4"])  # an intermediate layer besides the final one: u is their gap
    assert "rho(u,rater_sd)" in proc.stdout
    metrics = json.loads((folder / "metrics.json").read_text())
    assert set(metrics) == {"vader_ratings_eval", "vader_ratings_ood"}
    for block in metrics.values():
        assert np.isfinite(block["probe/u_rater_std_spearman"])
        # the judge was asked: its alpha is reported unless it answered one digit throughout (the random-init
        # tiny LM does), which ``constant`` says instead of an undefined correlation
        judge = "probe/baseline/score_judge/"
        assert (judge + "alpha_interval" in block) is not block[judge + "constant"]
        # the length baselines: a ridge on the sentence's length, the probe's correlation beyond length
        assert np.isfinite(block["probe/baseline/length_ridge/rmse"])
        assert {"probe/partial_pearson_given_length", "probe/pearson_with_log_length"} <= set(block)
    predictions = pd.read_parquet(folder / "predictions" / "vader_ratings_eval.parquet")
    assert predictions["rater_std"].between(0, 4).all() and len(predictions) > 10
    status = json.loads((folder / "status.json").read_text())
    assert status["fit"]["cv_groups"] > 3  # grouped by document, not by the three template prompts
    assert_strict_json_files(folder)  # no bare NaN, whatever the judge answered


def test_the_sentiment_probe_asks_its_judge_about_the_feeling():
    from rewarduq_exp.methods.score_judge import judge_instruction

    text = judge_instruction("What feeling does the text express? Answer in one word.", negative="negative",
                             positive="positive", scale="Rate the feeling from {low} (very {negative}) to {high} "
                             "(very {positive}).")
    assert text == ("What feeling does the text express?\nRate the feeling from 1 (very negative) to 5 "
                    "(very positive). Answer with a single digit and nothing else.")
    with pytest.raises(UserError, match=r"probe.judge_scale=.* may use only \{low\}"):
        judge_instruction("Q", scale="from {lowest}")
