"""RPC: ranking by pairwise comparison, one Platt-calibrated decision tree per item pair (appendix C)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from joblib import Parallel, delayed
from sklearn.calibration import CalibratedClassifierCV
from sklearn.tree import DecisionTreeClassifier

from rewarduq_exp.core.atomic_write import write_atomic
from rewarduq_exp.core.errors import UserError, first_line
from rewarduq_exp.core.setting_bounds import Bound
from rewarduq_exp.methods.base import LabelRankingMethod, saved_size
from rewarduq_exp.methods.label_ranking._common import check_xy
from rewarduq_exp.methods.settings import LabelRankingSettings, cast, setting
from rewarduq_exp.ranking.pairwise import PairwiseOnly

# What an RPC model file may hold besides plain containers and numpy arrays: the fitted calibrated trees. skops
# refuses any other type on load, so reading a model file never runs code it names (unlike a pickle).
RPC_TRUSTED_TYPES = ["sklearn.calibration._CalibratedClassifier", "sklearn.calibration._SigmoidCalibration",
                     "sklearn.tree._tree.Tree"]
RPC_MODELS_FILE = "pairs.skops"


def _fit_pair(X: np.ndarray, y: np.ndarray, seed: int, cv: int, eps: float):
    """A calibrated tree for one pair, or the clipped base rate where a class has fewer than ``cv`` rows (a stratified
    ``cv``-fold Platt scaling needs at least one row of each class per fold)."""
    counts = np.bincount(y, minlength=2)
    if counts.min() < cv:
        return float(np.clip(counts[1] / len(y), eps, 1 - eps))
    clf = CalibratedClassifierCV(estimator=DecisionTreeClassifier(random_state=seed), cv=cv, method="sigmoid")
    return clf.fit(X, y)


def _damaged_models_file(path: Path, err: Exception) -> UserError:
    first = first_line(err)
    return UserError(f"{path} could not be read as an RPC model file ({type(err).__name__}: {first}); the run "
                     "folder is damaged: copy it again or retrain")


@dataclass(kw_only=True)
class PairwiseSettings(LabelRankingSettings):
    """What RPC and PL-RPC share (``conf/method/rpc.yaml``, ``conf/method/pl_rpc.yaml``)."""

    cv: int = setting(bound=Bound(2, 1000, "folds", "every fold fits every pair's classifier again"),
                      doc="Platt scaling's cross-validation folds")
    eps: float = setting(check=cast(float), doc="pairwise probabilities clipped to [eps, 1 - eps]")
    n_jobs: int | None = setting(runtime=True, doc="pairs fitted in parallel (joblib)",
                                 bound=Bound(-4096, 4096, "jobs", "more jobs than any machine has cores (a negative "
                                             "count is joblib's: -1 = every core)", allow=(None,)))


@dataclass(kw_only=True)
class RPCSettings(PairwiseSettings, config="rpc"):
    """Defaults and comments: ``conf/method/rpc.yaml``."""


class RPCLearner(LabelRankingMethod):
    """RPC: for each item pair a < b, a binary classifier for "a is ranked before b".

    The classifier is ``CalibratedClassifierCV(DecisionTreeClassifier(random_state=seed), cv=2, method="sigmoid")``
    (Platt scaling, ensemble of the per-fold calibrated trees). A pair whose training labels have a single class (or
    fewer than ``cv`` rows of one class) predicts its training frequency as a constant instead (the reference code
    appended an artificial training row instead). Probabilities are clipped to [eps, 1 - eps]. ``n_jobs`` fits pairs
    in parallel (joblib); results do not depend on it. The fitted trees are saved with skops (``pairs.skops``), which
    loads only the types in ``RPC_TRUSTED_TYPES``.
    """

    name = "rpc"

    settings_class = RPCSettings

    def fit(self, X, ranks) -> RPCLearner:
        X, ranks = check_xy(X, ranks)
        self.m = ranks.shape[1]
        self.pairs = np.stack(np.triu_indices(self.m, 1), axis=1)
        labels = [(ranks[:, a] < ranks[:, b]).astype(np.int64) for a, b in self.pairs]
        self.models = Parallel(n_jobs=self.n_jobs)(
            delayed(_fit_pair)(X, y, self.seed, self.cv, self.eps) for y in labels)
        self.fit_summary = {"train_rows": len(X), "pairs": len(self.pairs),
                            "constant_pairs": sum(isinstance(model, float) for model in self.models)}
        return self

    def predict_pairwise(self, X) -> np.ndarray:
        """P(a > b) as an (n, m, m) matrix with zero diagonal."""
        self._require_fit()
        X = np.asarray(X, dtype=np.float64)
        out = np.zeros((len(X), self.m, self.m))
        for (a, b), model in zip(self.pairs, self.models):
            if isinstance(model, float):
                p = np.full(len(X), model)
            else:
                p = model.predict_proba(X)[:, list(model.classes_).index(1)]
            p = np.clip(p, self.eps, 1 - self.eps)
            out[:, a, b], out[:, b, a] = p, 1.0 - p
        return out

    def predict_distribution(self, X) -> PairwiseOnly:
        return PairwiseOnly(self.predict_pairwise(X))

    def fitted_arrays(self) -> dict[str, np.ndarray]:
        return {"pairs": self.pairs}

    def save(self, directory) -> None:
        import skops.io

        super().save(directory)
        write_atomic(Path(directory) / RPC_MODELS_FILE, skops.io.dumps(list(self.models)))

    def load_fitted(self, arrays, values) -> None:
        super().load_fitted(arrays, values)
        self.pairs = arrays["pairs"]

    def expected_arrays(self, info: dict, directory) -> dict:
        """The item pairs a < b: m (m - 1) / 2 rows of two labels (``fitted.m`` of method.json)."""
        from rewarduq_exp.core.payload_bounds import Expected

        m = self.saved_labels(info, directory)
        return {"pairs": Expected((m * (m - 1) // 2, 2), "iu", f"m={m} in method.json")}

    def models_file_bound(self, info: dict, directory) -> tuple[int, str]:
        """(bytes, where the bound comes from) of ``pairs.skops``, unpacked: per pair, ``cv`` calibrated trees of at
        most 2 n - 1 nodes each for n training rows (a node: 64 bytes of tree plus 16 of class values), plus 64 KiB
        of per-object bookkeeping, plus 1 MiB."""
        from rewarduq_exp.core.payload_bounds import MAX_ROWS

        m = self.saved_labels(info, directory)
        rows = saved_size(info, "fit_summary", "train_rows", MAX_ROWS, directory) or MAX_ROWS
        pairs = m * (m - 1) // 2
        bound = pairs * max(1, self.cv) * (2 * rows * 80 + (64 << 10)) + (1 << 20)
        return bound, f"m={m}, train_rows={rows} in method.json, cv={self.cv}"

    def load(self, directory) -> RPCLearner:
        import skops.io

        from rewarduq_exp.core.payload_bounds import check_zip_total
        from rewarduq_exp.core.saved_files import read_bounded
        from rewarduq_exp.methods.base import read_method_info

        super().load(directory)
        path = Path(directory) / RPC_MODELS_FILE
        bound, why = self.models_file_bound(read_method_info(directory, self.name), directory)
        if not path.exists():
            raise UserError(f"{path} is missing; the run folder is damaged: copy it again or retrain")
        # The file, and what its zip members unpack to, are bounded by the run's settings before skops reads it.
        data = read_bounded(path, bound, f"{path} (an RPC model file of {why})")
        check_zip_total(data, path, bound, why)
        try:
            untrusted = sorted(set(skops.io.get_untrusted_types(data=data)) - set(RPC_TRUSTED_TYPES))
        except Exception as err:  # noqa: BLE001 (cut short, not a skops zip: skops' errors do not name the file)
            raise _damaged_models_file(path, err) from None
        if untrusted:
            raise UserError(f"{path} holds types an RPC model never has ({', '.join(untrusted)}); not loading it")
        try:
            self.models = skops.io.load(io.BytesIO(data), trusted=RPC_TRUSTED_TYPES)
        except Exception as err:  # noqa: BLE001 (a damaged member of the archive)
            raise _damaged_models_file(path, err) from None
        return self

