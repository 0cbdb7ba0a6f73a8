"""What the policy is optimised for: the objectives compared on the same RL seeds and prompts.

Every objective is a reward of one completion, computed from one feature pass of the trained run (:class:`RunScorer`):

- ``mean``: the run's reward r;
- ``conservative``: r - k u_std, u in the comparable unit of best-of-n (``u_std = u sd(r) / sd(u)``, the spreads
  taken over the reference policy's samples, i.e. the pool at KL = 0: a constant per run, so the reward stays a
  fixed function of the text); k from ``task.k_grid``, chosen on the selection seeds;
- ``worst_case`` (Coste et al. 2024, WCO): the smallest reward over the run's draws (ENS-MLP's members, the epinet's
  evaluation indices, BAY-LIN's posterior draws);
- ``uncertainty_weighted`` (Coste et al. 2024, UWO): the draws' mean minus lambda times their variance, the variance
  in the same comparable unit (``var sd(r) / sd(var)`` over the pool); lambda from ``task.lambda_grid``, chosen on the
  selection seeds;
- ``kl``: r with the trainer's KL penalty to the reference at coefficient beta (``task.kl_coefs``, every one reported:
  the standard mitigation every RLHF user has);
- ``knn``: r - k d_std, d the mean distance to the ``task.knn`` nearest training completions in the run's feature
  space (best-of-n's rival, which needs no knowledge of the shortcut), in the same comparable unit, k chosen as for
  ``conservative``;
- ``filter``: oracle knowledge, an upper reference: a completion beyond the training range of a known shortcut
  feature (more fillers, or more words, than any training completion) gets the pool's lowest reward minus one sd of
  it, below every completion of the pool.

The gold never enters an objective. Rewards are the recalibrated ones where the run has a calibration (r / T, u s / T,
draws / T), as everywhere downstream; ``task.recalibrated=false`` reads the raw scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.base import FeatureHeadMethod

OBJECTIVES = ("mean", "conservative", "worst_case", "uncertainty_weighted", "kl", "knn", "filter")
# objectives with a coefficient chosen on the selection seeds, and the task setting that holds its grid
CHOSEN = {"conservative": "k_grid", "uncertainty_weighted": "lambda_grid", "knn": "k_grid"}
NEEDS_DRAWS = ("worst_case", "uncertainty_weighted")
NEEDS_FEATURES = ("knn",)
# the memory the features of recent policy samples may take (a repeated completion is encoded once)
SAMPLE_FEATURE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Objective:
    name: str
    coef: float = 0.0      # k, lambda or the KL coefficient; 0 for mean, worst_case and filter

    @property
    def kl_coef(self) -> float:
        return self.coef if self.name == "kl" else 0.0

    @property
    def label(self) -> str:
        return self.name if self.name in ("mean", "worst_case", "filter") else f"{self.name}@{self.coef:g}"


class RunScorer:
    """A trained run's scores of completions, all from one pass of its encoder: ``r``, ``u``, the draws and the
    k-NN distance to its training features, each where the method has it."""

    def __init__(self, model, world, knn: int, recalibrated: bool = True):
        self.model = model
        self.calibration = model.calibration if recalibrated else None
        method = model.method
        self.features_method = method if isinstance(method, FeatureHeadMethod) and method.encoder is not None else None
        self.sample_encoder = None
        self.start_run()
        self.world = world
        self.knn = int(knn)
        self._index = None
        self.pool: dict[str, float] = {}
        self.train_max = world.training_feature_max()

    def start_run(self) -> None:
        """Forget the features of earlier samples. The policy's samples are new texts at every call, so they are kept
        in memory, not in the run's disk cache; and each RL run starts from an empty store, so that its numbers are a
        function of its own calls only (a text's features may differ in the last bits with the batch it was computed
        in: a resumed study, whose processes scored other runs first, must give the same numbers)."""
        if self.features_method is not None:
            self.sample_encoder = self.features_method.encoder.in_memory(SAMPLE_FEATURE_BYTES)

    @property
    def has_draws(self) -> bool:
        """Whether the method draws rewards (members, indices, posterior samples): it overrides the base's None."""
        method = self.features_method
        return method is not None and type(method)._sample_features is not FeatureHeadMethod._sample_features

    def _neighbours(self):
        if self._index is None:
            from sklearn.neighbors import NearestNeighbors

            train = self.world.load(self.world.train_split)
            zc, zr = self.features_method.encoder.encode_pairs(train, desc="features (train)")
            reference = np.concatenate([zc.numpy(), zr.numpy()]).astype(np.float64)
            mean, sd = reference.mean(0), reference.std(0)
            sd = np.where(sd > 0, sd, 1.0)
            index = NearestNeighbors(n_neighbors=min(self.knn, len(reference))).fit((reference - mean) / sd)
            self._index = (index, mean, sd)
        return self._index

    def score(self, prompts: list, texts: list[str], want: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
        """``reward``, ``u`` and, if asked (``want``), ``draws`` (S, N) and ``knn`` (N,) of the completions."""
        completions = [[{"role": "assistant", "content": t}] for t in texts]
        out = {}
        if self.features_method is None:
            table = self.model.score(prompts, completions, raw=self.calibration is None)
            out["reward"], out["u"] = table.reward.to_numpy(), table.uncertainty.to_numpy()
            return out
        import torch

        method = self.features_method
        z = self.sample_encoder.encode(prompts, completions, desc="features (policy samples)")
        scores = method.score_features(z)
        if self.calibration is not None:
            scores = self.calibration.apply(scores)
        out["reward"], out["u"] = np.asarray(scores.reward, np.float64), np.asarray(scores.u, np.float64)
        if "draws" in want:
            with torch.no_grad():
                draws = method._sample_features(z.to(method.device))
            if draws is not None:
                t = self.calibration.temperature if self.calibration is not None else 1.0
                out["draws"] = draws.double().cpu().numpy() / t
        if "knn" in want:
            index, mean, sd = self._neighbours()
            distances, _ = index.kneighbors((z.numpy().astype(np.float64) - mean) / sd)
            out["knn"] = distances.mean(1)
        return out

    def fit_pool(self, prompts: list, texts: list[str]) -> dict[str, float]:
        """The spreads that put u, the draws' variance and the k-NN distance in the reward's unit, and the filter's
        floor, from the reference policy's samples (the pool at KL = 0). No gold is read."""
        want = tuple(w for w, ok in (("draws", self.has_draws), ("knn", self.features_method is not None)) if ok)
        s = self.score(prompts, texts, want)
        sd_r = float(np.std(s["reward"]))

        def unit(values) -> float:
            sd = float(np.std(values))
            return sd_r / sd if sd > 0 else 0.0

        self.start_run()
        self.pool = {"sd_reward": sd_r, "u_unit": unit(s["u"]),
                     "floor": float(np.min(s["reward"]) - max(sd_r, 1e-6))}
        if "draws" in s:
            self.pool["var_unit"] = unit(s["draws"].var(0, ddof=1))
        if "knn" in s:
            self.pool["knn_unit"] = unit(s["knn"])
        return self.pool

    def beyond(self, texts: list[str]) -> np.ndarray:
        found = self.world.text_features(texts)
        out = np.zeros(len(texts), dtype=bool)
        for name, values in found.items():
            out |= values > self.train_max.get(name, np.inf)
        return out

    def objective_values(self, objective: Objective, prompts: list, texts: list[str],
                         scores: dict | None = None) -> np.ndarray:
        name, c = objective.name, objective.coef
        want = ("draws",) if name in NEEDS_DRAWS else ("knn",) if name in NEEDS_FEATURES else ()
        s = scores if scores is not None and all(w in scores for w in want) else self.score(prompts, texts, want)
        r = s["reward"]
        if name in ("mean", "kl"):
            return r
        if name == "conservative":
            return r - c * self.pool["u_unit"] * s["u"]
        if name == "worst_case":
            return s["draws"].min(0)
        if name == "uncertainty_weighted":
            return s["draws"].mean(0) - c * self.pool["var_unit"] * s["draws"].var(0, ddof=1)
        if name == "knn":
            return r - c * self.pool["knn_unit"] * s["knn"]
        if name == "filter":
            return np.where(self.beyond(texts), self.pool["floor"], r)
        raise UserError(f"objective {name!r} is invalid; allowed: {', '.join(OBJECTIVES)}")

    def supports(self, name: str) -> bool:
        if name in NEEDS_DRAWS:
            return self.has_draws
        if name in NEEDS_FEATURES:
            return self.features_method is not None
        return True
