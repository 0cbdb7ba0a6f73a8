"""Human sentiment ratings of real sentences (``dataset=vader_ratings``): pointwise data for probes, built offline.

The evaluation data of the VADER paper (Hutto & Gilbert, ICWSM 2014) ships in the source distribution of
``vaderSentiment==3.3.2`` on PyPI (MIT licence), inside ``additional_resources/hutto_ICWSM_2014.tar.gz``: four
corpora of real sentences, each rated for sentiment by 15-99 independent, screened human raters on an integer scale
from -4 (extremely negative) to 4 (extremely positive):

=================  ==========================================  =======
corpus             files (``<prefix>_GroundTruth.txt`` + ...)    rows
=================  ==========================================  =======
``tweets``         ``tweets``                                   4,200
``movie_reviews``  ``movieReviewSnippets`` (rotten tomatoes)    10,605
``amazon_reviews`` ``amazonReviewSnippets``                     3,708
``nyt_editorials`` ``nytEditorialSnippets``                     5,190
=================  ==========================================  =======

``<prefix>_GroundTruth.txt`` holds ``id<TAB>mean<TAB>text``; ``<prefix>_anonDataRatings.txt`` holds
``id<TAB>mean<TAB>std<TAB>[raw ratings]``. Both are UTF-8 with CRLF line ends (the Amazon ratings file starts with a
byte-order mark); tweets keep HTML entities (``&amp;``), unescaped here.

Why this data: it is the one human-rated text corpus that the package registry (the only network this project may
assume) carries, so BoRP's regression target on real text needs no hub access, and the raw ratings give each
sentence's rater disagreement, against which a probe's uncertainty can be checked (``probe/u_rater_std_spearman``).

Choices:

* **Target**: the mean of the raw ratings (the ratings file). For 199 tweets the ground-truth file's mean differs from
  it (by up to 1.1 points; the ratings file's mean is the mean of its own raw ratings), so the raw ratings win.
* **Scale**: ``score = 3 + mean / 2`` puts -4..4 on BoRP's 1..5 (linear, so correlations are unchanged).
  ``mean_rating`` (-4..4), ``rater_std`` and ``n_raters`` travel along; ``subset`` is the corpus.
* **Conversation**: the probe judges assistant replies, so each sentence is the reply to a user turn asking for a
  text of its corpus's kind (``PROMPTS``).
* **Cross-validation groups** (``cv_group``): the source document (NYT and Amazon ids are ``<document>_<sentence>``),
  since every row of a corpus shares one template prompt and grouping by prompt would leave one fold per corpus.
* **Splits**: ``train`` and ``eval`` partition the documents of the ``corpora`` (seeded; eval holds about
  ``eval_fraction`` of the rows); ``ood`` is the ``ood_corpora``, a different register. ``cal``, the calibration
  split (:mod:`rewarduq_exp.data.calibration_split`), takes whole documents out of ``train``: about ``cal_fraction``
  of the rows that are not in ``eval`` (at least one document, never all; seeded; eval is as without it;
  ``cal_fraction=0``: no ``cal``). Repeated sentences are kept once, so no text sits on two sides.
  ``n_train``/``n_eval``/``n_ood``/``n_cal`` take the first rows of each split (null: all); growing one never changes
  which rows another split holds.
"""

from __future__ import annotations

import ast
import hashlib
import html
import io
import logging
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
from filelock import FileLock

from rewarduq_exp.core.atomic_write import atomic_path
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.calibration_split import CAL_SPLIT, calibration_rows, check_fraction, no_cal_split
from rewarduq_exp.data.contract import make_pointwise_frame, make_preference_frame

log = logging.getLogger("rewarduq_exp")

REQUIREMENT = "vaderSentiment==3.3.2"
SDIST = "vaderSentiment-3.3.2.tar.gz"
SDIST_SHA256 = "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9"
INNER_ARCHIVE = "hutto_ICWSM_2014.tar.gz"
DOWNLOAD_COMMAND = f"pip download --no-deps --no-binary :all: {REQUIREMENT}"

CORPORA = {"tweets": "tweets", "movie_reviews": "movieReviewSnippets",
           "amazon_reviews": "amazonReviewSnippets", "nyt_editorials": "nytEditorialSnippets"}
PROMPTS = {"tweets": "Write a tweet.",
           "movie_reviews": "Write a sentence from a movie review.",
           "amazon_reviews": "Write a sentence from a product review.",
           "nyt_editorials": "Write a sentence from a newspaper editorial."}
SPLITS = ("train", "eval", "ood", CAL_SPLIT)
RATING_RANGE = (-4.0, 4.0)


def pair_prompt(corpus: str) -> list[dict]:
    """The user turn of the preference pairs (and of best-of-n on them): a positive text of the corpus's kind."""
    return [{"role": "user", "content": PROMPTS[corpus].removesuffix(".") + " with a positive feeling."}]


def _names(values, key: str) -> list[str]:
    values = [values] if isinstance(values, str) else list(values or [])
    bad = [v for v in values if v not in CORPORA]
    if bad or not values:
        raise UserError(f"{key}={values} is invalid: name one or more of {', '.join(CORPORA)} (got {bad or 'none'})")
    return values


def _size(value, key: str, hint: str = ""):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{key}={value!r} is invalid: must be a positive integer, or null for the whole split{hint}")
    return value


def _lines(data: bytes, what: str, fields: int) -> list[list[str]]:
    rows = []
    for number, line in enumerate(data.decode("utf-8-sig").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != fields:
            raise UserError(f"{what} line {number} has {len(parts)} tab-separated fields, expected {fields}: it is "
                            f"not the VADER ratings format (the files of {SDIST})")
        rows.append(parts)
    return rows


def parse_corpus(ground_truth: bytes, ratings: bytes, corpus: str) -> pd.DataFrame:
    """One corpus as a table: ``id``, ``text``, ``mean_rating``, ``rater_std``, ``n_raters``, ``corpus``."""
    prefix = CORPORA[corpus]
    texts = {row[0]: row[2] for row in _lines(ground_truth, f"{prefix}_GroundTruth.txt", 3)}
    rows = []
    for ident, _mean, _std, raw in _lines(ratings, f"{prefix}_anonDataRatings.txt", 4):
        if ident not in texts:
            raise UserError(f"{prefix}_anonDataRatings.txt has id {ident} that {prefix}_GroundTruth.txt lacks")
        try:
            votes = np.asarray(ast.literal_eval(raw), dtype=float)
        except (ValueError, SyntaxError):
            raise UserError(f"{prefix}_anonDataRatings.txt id {ident}: the raw ratings {raw[:40]!r} are not a list "
                            "of numbers") from None
        if votes.ndim != 1 or len(votes) == 0 or votes.min() < RATING_RANGE[0] or votes.max() > RATING_RANGE[1]:
            raise UserError(f"{prefix}_anonDataRatings.txt id {ident}: raw ratings must be a non-empty list in "
                            f"{RATING_RANGE[0]:g}..{RATING_RANGE[1]:g}")
        rows.append((ident, html.unescape(texts[ident]).strip(), votes.mean(), votes.std(), len(votes)))
    frame = pd.DataFrame(rows, columns=["id", "text", "mean_rating", "rater_std", "n_raters"])
    frame["corpus"] = corpus
    return frame


def _archive_files(archive: tarfile.TarFile) -> dict[str, bytes]:
    """The ratings files of an archive, by base name; the sdist's nested archive is opened in memory."""
    files = {}
    for member in archive.getmembers():
        base = member.name.rsplit("/", 1)[-1]
        if not member.isfile():
            continue
        if base == INNER_ARCHIVE:
            with tarfile.open(fileobj=io.BytesIO(archive.extractfile(member).read())) as inner:
                files.update(_archive_files(inner))
        elif base.endswith(("_GroundTruth.txt", "_anonDataRatings.txt")):
            files[base] = archive.extractfile(member).read()
    return files


def read_source(path: Path) -> dict[str, bytes]:
    """The ratings files from the sdist, from ``hutto_ICWSM_2014.tar.gz`` itself, or from a folder holding them."""
    if path.is_dir():
        return {p.name: p.read_bytes() for p in path.rglob("*.txt")
                if p.name.endswith(("_GroundTruth.txt", "_anonDataRatings.txt"))}
    try:
        with tarfile.open(path) as archive:
            return _archive_files(archive)
    except (tarfile.TarError, OSError, EOFError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0].rstrip(":")
        raise UserError(f"dataset.path={path} is not a readable tar archive ({first}); point it at {SDIST}, "
                        f"{INNER_ARCHIVE} or a folder of its .txt files") from None


class VaderRatings:
    """Real sentences with human sentiment ratings (module docstring), as the pointwise contract."""

    kind = "pointwise"

    def __init__(self, name: str = "vader_ratings", path: str | None = None, cache_dir: str = "outputs/cache",
                 download: bool = True, corpora=("tweets", "movie_reviews", "amazon_reviews"),
                 ood_corpora=("nyt_editorials",), eval_fraction: float = 0.2, seed: int = 0,
                 n_train: int | None = None, n_eval: int | None = None, n_ood: int | None = None,
                 train_split: str = "train", eval_splits=("eval", "ood"), cal_fraction: float = 0.1,
                 n_cal: int | None = None):
        self.name = name
        self.path = Path(path).expanduser() if path else None
        self.cache_dir = Path(cache_dir)
        self.download = bool(download)
        self.corpora = _names(corpora, "dataset.corpora")
        self.ood_corpora = _names(ood_corpora, "dataset.ood_corpora")
        overlap = sorted(set(self.corpora) & set(self.ood_corpora))
        if overlap:
            raise UserError(f"dataset.corpora and dataset.ood_corpora share {', '.join(overlap)}: a corpus is either "
                            "in distribution (train/eval) or out of it (ood)")
        if not 0 < float(eval_fraction) < 1:
            raise UserError(f"dataset.eval_fraction={eval_fraction} is invalid: must be strictly between 0 and 1")
        self.eval_fraction = float(eval_fraction)
        self.cal_fraction = check_fraction(cal_fraction)
        self.cal_split = CAL_SPLIT if self.cal_fraction else None
        self.seed = int(seed)
        self.sizes = {"train": _size(n_train, "dataset.n_train"), "eval": _size(n_eval, "dataset.n_eval"),
                      "ood": _size(n_ood, "dataset.n_ood"),
                      CAL_SPLIT: _size(n_cal, "dataset.n_cal", "; no calibration split: dataset.cal_fraction=0")}
        self.train_split = train_split
        self.eval_splits = tuple(eval_splits)
        self._table: pd.DataFrame | None = None

    # -- where the data comes from ------------------------------------------------------------------------------
    def source(self) -> Path:
        """The file or folder to read: ``dataset.path``, or the sdist in ``<cache_dir>/downloads`` (fetched once)."""
        if self.path is not None:
            if not self.path.exists():
                raise UserError(f"dataset.path={self.path}: not found; point it at {SDIST} ({DOWNLOAD_COMMAND}), "
                                f"{INNER_ARCHIVE} or a folder of its .txt files")
            return self.path
        target = self.cache_dir / "downloads" / SDIST
        if target.is_file():
            return target
        if not self.download:
            raise UserError(f"dataset '{self.name}': {target} is missing and dataset.download=false; fetch it with "
                            f"{DOWNLOAD_COMMAND} -d {target.parent}, or set dataset.path=<{SDIST}>")
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target) + ".lock"):  # parallel sweep jobs: one download
            if not target.is_file():
                self._fetch(target)
        return target

    def _fetch(self, target: Path) -> None:
        """``pip download`` of the sdist (the user's index settings apply: mirrors, proxies), checked by SHA-256."""
        log.info("downloading %s (human sentiment ratings, 2.5 MB) into %s", SDIST, target.parent)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                   REQUIREMENT, "-d", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / SDIST
            if done.returncode != 0 or not got.is_file():
                last = (done.stderr.strip().splitlines() or ["no file"])[-1][:160]
                raise UserError(f"dataset '{self.name}': could not download {REQUIREMENT} from the package index "
                                f"({last}); on a machine with access run {DOWNLOAD_COMMAND} and pass "
                                f"dataset.path=<{SDIST}>")
            data = got.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != SDIST_SHA256:
            raise UserError(f"dataset '{self.name}': the downloaded {SDIST} has SHA-256 {digest[:16]}..., not the "
                            f"published {SDIST_SHA256[:16]}...; check your package index")
        with atomic_path(target) as tmp_file:
            tmp_file.write_bytes(data)

    def table(self) -> pd.DataFrame:
        """Every sentence of the configured corpora with its split (``train``/``eval``/``cal``/``ood``), read once."""
        if self._table is not None:
            return self._table
        source = self.source()
        files = read_source(source)
        parts = []
        for corpus in self.corpora + self.ood_corpora:
            prefix = CORPORA[corpus]
            names = (f"{prefix}_GroundTruth.txt", f"{prefix}_anonDataRatings.txt")
            missing = [n for n in names if n not in files]
            if missing:
                raise UserError(f"{source} has no {', '.join(missing)}: it is not {SDIST} (or its "
                                f"{INNER_ARCHIVE}); corpora allowed: {', '.join(CORPORA)}")
            parts.append(parse_corpus(files[names[0]], files[names[1]], corpus))
        table = pd.concat(parts, ignore_index=True).drop_duplicates("text", ignore_index=True)
        table["cv_group"] = table["corpus"] + "-" + table["id"].str.split("_").str[0]
        # Whole documents go to train or eval (the sentences of one article share its tone): documents in a seeded
        # order, eval takes them until it holds eval_fraction of the rows.
        inside = table["corpus"].isin(self.corpora).to_numpy()
        docs = table.loc[inside, "cv_group"].value_counts(sort=False)
        docs = docs.iloc[np.random.default_rng([self.seed, 4242]).permutation(len(docs))]
        eval_docs = docs.index[np.cumsum(docs.to_numpy()) <= self.eval_fraction * inside.sum()]
        table["split"] = np.where(~inside, "ood", np.where(table["cv_group"].isin(eval_docs), "eval", "train"))
        if self.cal_split:
            # Whole documents again, out of train: about cal_fraction of its rows, in an order of their own (a hash
            # of the document keyed with the seed), so eval is the same with or without them.
            rest = np.flatnonzero(table["split"].to_numpy() == "train")
            held = calibration_rows(table["cv_group"].to_numpy()[rest].tolist(), self.cal_fraction,
                                    salt=f"{CAL_SPLIT}:{self.seed}", by_rows=True, group="document",
                                    source=f"dataset '{self.name}' (corpora {', '.join(self.corpora)})")
            table.loc[table.index[rest[held]], "split"] = CAL_SPLIT
        # Rows in a seeded random order, so the first n rows of a split are a random sample whatever n is.
        table = table.iloc[np.random.default_rng([self.seed, 4343]).permutation(len(table))]
        self._table = table.reset_index(drop=True)
        return self._table

    def split_rows(self, split: str) -> pd.DataFrame:
        """The sentences of one split, in the table's seeded order."""
        if split not in SPLITS:
            raise UserError(f"{self.name} split '{split}' does not exist; allowed: {', '.join(SPLITS)}")
        if split == CAL_SPLIT and not self.cal_split:
            raise no_cal_split(self.name, "dataset.cal_fraction=0")
        rows = self.table()
        return rows[rows["split"] == split]

    def load(self, split: str) -> pd.DataFrame:
        rows = self.split_rows(split)
        if self.sizes[split] is not None:
            rows = rows.iloc[: self.sizes[split]]
        if rows.empty:
            raise UserError(f"dataset '{self.name}' split '{split}' is empty (corpora: "
                            f"{', '.join(self.ood_corpora if split == 'ood' else self.corpora)})")
        prompts = [[{"role": "user", "content": PROMPTS[c]}] for c in rows["corpus"]]
        responses = [[{"role": "assistant", "content": t}] for t in rows["text"]]
        scores = {"mean_rating": rows["mean_rating"].to_numpy(), "rater_std": rows["rater_std"].to_numpy(),
                  "n_raters": rows["n_raters"].to_numpy(), "rating": 3.0 + rows["mean_rating"].to_numpy() / 2.0}
        ids = [f"vader-{c}-{i}" for c, i in zip(rows["corpus"], rows["id"])]
        frame = make_pointwise_frame(ids, prompts, responses, scores, target="rating", subset=list(rows["corpus"]))
        frame["cv_group"] = rows["cv_group"].to_numpy()
        return frame


class VaderPairs(VaderRatings):
    """The same sentences as preference pairs (``dataset=vader_pairs``): real text for the preference methods.

    Within each split, the sentences of each corpus are shuffled (seeded) and taken two at a time; the user turn asks
    for a positive text of the corpus's kind and the sentence the raters found more positive is ``chosen``. Pairs
    whose mean ratings differ by less than ``min_gap`` (on the raters' -4..4 scale) are dropped: the crowd itself
    barely tells them apart. ``n_train``/``n_eval``/``n_ood``/``n_cal`` count pairs. Extra columns: ``true_gap`` (the
    mean ratings' difference, chosen minus rejected) and the two ``rater_std``.
    """

    kind = "pairs"

    def __init__(self, *args, min_gap: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        if not float(min_gap) >= 0:
            raise UserError(f"dataset.min_gap={min_gap} is invalid: must be a number >= 0 (rating points, -4..4)")
        self.min_gap = float(min_gap)

    def load(self, split: str) -> pd.DataFrame:
        rows = self.split_rows(split)
        firsts, seconds = [], []
        for _, corpus_rows in rows.groupby("corpus", sort=True):
            index = corpus_rows.index.to_numpy()  # already in the table's seeded order
            half = len(index) // 2
            firsts.append(index[:2 * half:2])
            seconds.append(index[1:2 * half:2])
        a, b = rows.loc[np.concatenate(firsts)], rows.loc[np.concatenate(seconds)]
        gap = a["mean_rating"].to_numpy() - b["mean_rating"].to_numpy()
        keep = np.abs(gap) >= max(self.min_gap, 1e-9)  # a tie has no preferred side
        a, b, gap = a[keep], b[keep], gap[keep]
        # columns id, text, rater_std of each side, the more positive sentence first
        sides = a[["id", "text", "rater_std"]].to_numpy(object), b[["id", "text", "rater_std"]].to_numpy(object)
        first_wins = (gap > 0)[:, None]
        chosen, rejected = np.where(first_wins, *sides), np.where(first_wins, *sides[::-1])
        # the pairs of all corpora interleaved in a seeded order, so the first n are a random sample
        order = np.random.default_rng([self.seed, 4444]).permutation(len(chosen))
        if self.sizes[split] is not None:
            order = order[: self.sizes[split]]
        if len(order) == 0:
            raise UserError(f"dataset '{self.name}' split '{split}' has no pair with a rating gap >= "
                            f"dataset.min_gap={self.min_gap:g}")
        chosen, rejected, corpus = chosen[order], rejected[order], a["corpus"].to_numpy()[order]
        prompts = [pair_prompt(c) for c in corpus]
        frame = make_preference_frame(
            [f"vader-{c}-{x}-{y}" for c, x, y in zip(corpus, chosen[:, 0], rejected[:, 0])], prompts,
            [[{"role": "assistant", "content": t}] for t in chosen[:, 1]],
            [[{"role": "assistant", "content": t}] for t in rejected[:, 1]], subset=corpus)
        frame["true_gap"] = np.abs(gap)[order]
        frame["chosen_rater_std"] = chosen[:, 2].astype(float)
        frame["rejected_rater_std"] = rejected[:, 2].astype(float)
        return frame
