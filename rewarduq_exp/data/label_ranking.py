"""Label-ranking datasets (the calibrated-label-ranking paper): CSV loading and per-fold preprocessing.

File format (``<data_dir>/<name>.csv``):

* the KEBI-style files: header ``A1..Ad, L1..Lm``; every ``L<j>`` column is a target holding the rank (1 = best) of
  item j, every other column a numeric, already scaled feature. Item names are ``L1..Lm``.
* ``political.csv``: the targets are the last six columns ``Pos. of <PARTY> in Ranking`` (ranks of LINKE, GRUENE,
  SPD, CDU/CSU, FDP, AFD; the item names are the party names); the features include 3 string columns and the survey
  missing-code 977. The column ``caseid`` is a unique respondent id: it is dropped as an identifier (the reference
  code kept it as a numeric feature, where it can only act as noise or as a row-order leak).

Targets are detected by name: columns ``L<digits>`` if any exist, otherwise columns ``Pos. of <item> in Ranking``.
Each target row must be a permutation of 1..m (no ties exist in the shipped data); the ranks are returned unchanged
(1 = best, item ids are column positions), which is the ranks-per-item encoding of ``rewarduq_exp.ranking``.

Preprocessing is per fold: ``LabelRankingData.preprocess`` is an unfitted scikit-learn transformer (a template) and
``LabelRankingData.fold(train_idx, test_idx)`` clones it, fits it on the training rows only and transforms both
sides. Datasets with numeric features only get the identity (their features are already scaled, as in the reference);
datasets with string columns get a ColumnTransformer:

* numeric columns: NaN -> most frequent value; the missing-code 977 -> median of the column's other values;
  StandardScaler;
* string columns: most-frequent imputation; OneHotEncoder(handle_unknown="ignore") (a level that appears only in the
  test fold becomes all zeros).

String columns are recognised by ``not pd.api.types.is_numeric_dtype`` (object under pandas 2, ``str`` under pandas
3): the reference code tested ``dtype == object`` and silently dropped them under pandas 3.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, TransformerMixin, clone
from sklearn.compose import ColumnTransformer
from sklearn.impute import SimpleImputer
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import FunctionTransformer, OneHotEncoder, StandardScaler

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.ranking.permutations import check_rankings

MISSING_CODE = 977
ID_COLUMNS = ("caseid",)
_L_COLUMN = re.compile(r"^L\d+$")
_POS_COLUMN = re.compile(r"^Pos\. of (.+) in Ranking$")

log = logging.getLogger("rewarduq_exp")


def _to_float(x):
    return np.asarray(x, dtype=np.float64)


class _FloatArray(BaseEstimator, TransformerMixin):
    """Cast to a float64 array (numeric columns arrive as an object array when the table has string columns)."""

    def fit(self, X, y=None):
        return self

    def transform(self, X):
        return _to_float(X)


def identity_preprocessor() -> FunctionTransformer:
    return FunctionTransformer(_to_float, validate=False)


def mixed_preprocessor(numeric: list[int], categorical: list[int]) -> ColumnTransformer:
    """The political-style preprocessing (see module docstring) over column indices of an object array."""
    numeric_pipe = Pipeline([
        ("float", _FloatArray()),
        ("nan", SimpleImputer(strategy="most_frequent", keep_empty_features=True)),
        ("code977", SimpleImputer(missing_values=MISSING_CODE, strategy="median", keep_empty_features=True)),
        ("scale", StandardScaler()),
    ])
    categorical_pipe = Pipeline([
        ("impute", SimpleImputer(strategy="most_frequent", missing_values=np.nan, keep_empty_features=True)),
        ("onehot", OneHotEncoder(handle_unknown="ignore", sparse_output=False)),
    ])
    parts = []
    if numeric:
        parts.append(("numeric", numeric_pipe, numeric))
    if categorical:
        parts.append(("categorical", categorical_pipe, categorical))
    return ColumnTransformer(parts, remainder="drop", sparse_threshold=0.0)


@dataclass
class LabelRankingData:
    """A label-ranking dataset: raw features ``X`` (n, d) (float64, or object when some columns hold strings),
    ``ranks`` (n, m) int64 ranks-per-item (1 = best), names, and the unfitted per-fold ``preprocess`` template."""

    name: str
    X: np.ndarray
    ranks: np.ndarray
    feature_names: list[str]
    item_names: list[str]
    preprocess: object
    categorical_features: list[str] = field(default_factory=list)
    dropped_columns: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.ranks)

    @property
    def m(self) -> int:
        return self.ranks.shape[1]

    def fold(self, train_idx, test_idx) -> tuple[np.ndarray, np.ndarray]:
        """(X_train, X_test) as float64 arrays, with a fresh preprocessor fitted on the training rows only."""
        pre = clone(self.preprocess)
        x_train = np.asarray(pre.fit_transform(self.X[train_idx]), dtype=np.float64)
        x_test = np.asarray(pre.transform(self.X[test_idx]), dtype=np.float64)
        return x_train, x_test


def available_datasets(data_dir) -> list[str]:
    return sorted(p.stem for p in Path(data_dir).glob("*.csv"))


def resolve_path(path_or_name, data_dir=None) -> Path:
    p = Path(path_or_name)
    if p.suffix == ".csv" or p.is_file():
        if not p.is_file():
            raise UserError(f"label-ranking data file {p} does not exist")
        return p
    if data_dir is None:
        raise UserError(f"label-ranking dataset {path_or_name!r}: give a CSV path or a data directory")
    candidate = Path(data_dir) / f"{path_or_name}.csv"
    if not candidate.is_file():
        known = available_datasets(data_dir) if Path(data_dir).is_dir() else []
        raise UserError(f"label-ranking dataset {path_or_name!r} not found as {candidate}; "
                        f"available: {', '.join(known) or 'none (no such directory or no CSV files)'}")
    return candidate


def load_label_ranking(path_or_name, data_dir=None) -> LabelRankingData:
    """Read one label-ranking CSV (a path, or a dataset name looked up as ``<data_dir>/<name>.csv``)."""
    path = resolve_path(path_or_name, data_dir)
    try:
        df = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not a readable CSV file ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    if df.empty:
        raise UserError(f"{path}: no data rows (a header only); a label-ranking file holds one row per instance: "
                        "its features and the rank of every label")
    columns = [str(c) for c in df.columns]
    targets = [c for c in columns if _L_COLUMN.match(c)]
    if targets:
        item_names = targets
    else:
        targets = [c for c in columns if _POS_COLUMN.match(c)]
        item_names = [_POS_COLUMN.match(c).group(1) for c in targets]
    if len(targets) < 2:
        raise UserError(f"{path}: found {len(targets)} label columns; need at least 2 named L1..Lm "
                        f"or 'Pos. of <item> in Ranking'")
    ranks = _read_ranks(df, targets, path)
    dropped = [c for c in columns if c in ID_COLUMNS]
    features = [c for c in columns if c not in targets and c not in dropped]
    if not features:
        raise UserError(f"{path}: no feature columns besides the labels")
    feat = df[features]
    categorical = [c for c in features if not pd.api.types.is_numeric_dtype(feat[c])]
    if categorical:
        # one object array; missing strings as np.nan whatever pandas version stored them as (None, pd.NA, nan)
        X = np.empty((len(df), len(features)), dtype=object)
        for j, c in enumerate(features):
            col = feat[c]
            if c in categorical:
                values = col.astype(object).to_numpy().copy()
                values[pd.isna(values)] = np.nan
                X[:, j] = values
            else:
                X[:, j] = col.to_numpy(dtype=np.float64, na_value=np.nan)
        cat_idx = [features.index(c) for c in categorical]
        num_idx = [j for j in range(len(features)) if j not in cat_idx]
        preprocess = mixed_preprocessor(num_idx, cat_idx)
    else:
        X = feat.to_numpy(dtype=np.float64, na_value=np.nan)
        if np.isnan(X).any():
            row, col = np.argwhere(np.isnan(X))[0]
            raise UserError(f"{path}: line {row + 2}, column {features[col]!r} is empty; only files with string "
                            f"columns get imputation, numeric-only files must be complete")
        preprocess = identity_preprocessor()
    return LabelRankingData(name=path.stem, X=X, ranks=ranks, feature_names=features, item_names=item_names,
                            preprocess=preprocess, categorical_features=categorical, dropped_columns=dropped)


def _read_ranks(df: pd.DataFrame, targets: list[str], path: Path) -> np.ndarray:
    lab = df[targets]
    for c in targets:
        if not pd.api.types.is_numeric_dtype(lab[c]):
            bad = lab[c][pd.to_numeric(lab[c], errors="coerce").isna()]
            row = int(bad.index[0]) if len(bad) else 0
            raise UserError(f"{path}: label column {c!r}, line {row + 2}: {lab[c].iloc[row]!r} is not a rank "
                            f"(labels must be integers 1..{len(targets)})")
    values = lab.to_numpy(dtype=np.float64, na_value=np.nan)
    finite = np.isfinite(values)
    integral = finite & (values == np.round(values))
    if not integral.all():
        row, col = np.argwhere(~integral)[0]
        raise UserError(f"{path}: label column {targets[col]!r}, line {row + 2}: {values[row, col]!r} is not an "
                        f"integer rank (labels must be integers 1..{len(targets)}, no missing values)")
    ranks = values.astype(np.int64)
    m = ranks.shape[1]
    ok = (np.sort(ranks, axis=1) == np.arange(1, m + 1)).all(axis=1)
    if not ok.all():
        row = int(np.flatnonzero(~ok)[0])
        raise UserError(f"{path}: line {row + 2} (data row {row}): labels {ranks[row].tolist()} are not a "
                        f"permutation of 1..{m} (each row gives every item a distinct rank, 1 = best; ties are not "
                        f"supported)")
    if len(ranks) > 1 and (ranks == ranks[0]).all():
        log.warning("%s: all %d rows have the same ranking %s: there is nothing to learn, and every metric of a "
                    "model that predicts it is trivially perfect (tau 1, ECE 0)", path, len(ranks), ranks[0].tolist())
    return check_rankings(ranks, what=f"{path}: label columns")
