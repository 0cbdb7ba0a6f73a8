"""``dataset=label_ranking/<name>``: where a label-ranking CSV comes from (a local folder or the authors' repository).

The 13 CSVs of the calibrated-label-ranking paper (appendix B) are published in the authors' repository
(Advueu963/Calibrated_Preference_Learning, ``src/cal_pref/data/<name>.csv``). A run reads ``<data_dir>/<name>.csv``
when ``paths.label_ranking_dir`` (or the environment variable ``REWARDUQ_LABEL_RANKING_DIR``) names a folder;
otherwise it downloads the file once from ``url`` (pinned to a commit) into ``<cache_dir>/label_ranking/``, atomically,
so concurrent sweep jobs never read half a file.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

from rewarduq_exp.core.atomic_write import atomic_path
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.hub_access import url_answers
from rewarduq_exp.data.label_ranking import LabelRankingData, load_label_ranking

DEFAULT_URL = ("https://raw.githubusercontent.com/Advueu963/Calibrated_Preference_Learning/dc0b533/"
               "src/cal_pref/data/{name}.csv")
DOWNLOAD_TIMEOUT_S = 30
# the whole time a user waits for a host that does not answer (a firewall that drops packets: no error, only silence)
PROBE_TIMEOUT_S = 5.0


class LabelRankingSource:
    """One label-ranking dataset: features and rankings, evaluated by ``folds``-fold cross-validation."""

    kind = "label_ranking"
    train_split = "all"  # cross-validation uses every row; there is no fixed train/test split

    def __init__(self, name: str, data_dir: str | None = None, cache_dir: str = "outputs/cache",
                 url: str = DEFAULT_URL, folds: int = 5, file: str | None = None, kind: str = "label_ranking"):
        if kind != self.kind:
            raise UserError(f"dataset.kind={kind!r} is invalid for a label-ranking dataset: must be label_ranking")
        self.name = str(name)
        self.file = str(file or name)
        self.data_dir = data_dir
        self.cache_dir = Path(cache_dir)
        self.url = url
        if isinstance(folds, bool) or not isinstance(folds, int) or folds < 2:
            raise UserError(f"dataset.folds={folds!r} is invalid: must be an integer >= 2 (k-fold cross-validation)")
        self.folds = folds

    def path(self) -> Path:
        if self.data_dir:
            path = Path(self.data_dir) / f"{self.file}.csv"
            if not path.is_file():
                raise UserError(f"dataset '{self.name}': {path} not found; paths.label_ranking_dir="
                                f"{self.data_dir} must hold the paper's CSVs (<name>.csv)")
            return path
        path = self.cache_dir / "label_ranking" / f"{self.file}.csv"
        if not path.is_file():
            self._download(path)
        return path

    def _download(self, path: Path) -> None:
        url = self.url.format(name=self.file)
        hint = ("without network, copy the CSVs to a folder and pass paths.label_ranking_dir=<folder> (or set "
                "REWARDUQ_LABEL_RANKING_DIR)")
        if url.startswith(("http://", "https://")) and not url_answers(url, PROBE_TIMEOUT_S):
            raise UserError(f"dataset '{self.name}': {url} does not answer within {PROBE_TIMEOUT_S:g} s; {hint}")
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
                data = response.read()
        except (OSError, ValueError) as err:
            raise UserError(f"dataset '{self.name}': could not download {url} ({str(err).splitlines()[0][:120]}); "
                            f"{hint}") from None
        with atomic_path(path) as tmp:
            tmp.write_bytes(data)

    def load(self) -> LabelRankingData:
        data = load_label_ranking(self.path())
        if len(data.ranks) < self.folds:
            raise UserError(f"dataset '{self.name}' has {len(data.ranks)} rows, fewer than dataset.folds={self.folds}")
        return data
