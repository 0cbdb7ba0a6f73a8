"""BoRP: Bootstrapped Regression Probing (Sun, Zhang and Wu), as plain Python classes.

A conversation is scored by reading the backbone's hidden state at the final token of a *probe suffix* appended to
it, under a positive and a negative wording, and mapping the difference to a score with a PLS regressor; the gap
between the scores read at an intermediate and at the final layer is the uncertainty. Wiring (Hydra configs, the
method interface, the feature cache) is done elsewhere; this module holds the science.

The paper's equations were lost in the text extraction. The readings chosen here, from the surrounding text and the
figures' captions:

* **Eq. 1 (contrastive representation).** ``d = h_l(x + s_pos)[last] - h_l(x + s_neg)[last]``: the hidden state at
  layer ``l`` of the final token of the conversation ``x`` followed by the positive probe suffix, minus the same under
  the negative suffix ("Performance is Excellent/Terrible", section 3.2 phase 1). The two suffixes share everything
  but the polarity word (``{polarity}`` in :class:`ProbeTemplate`), so common-mode content (topic, syntax) cancels.
  Suffix = a further user turn with the probe instruction + the assistant generation prefix with Qwen3's empty
  ``<think>`` block (appendix A) + the start of the answer; the final token is the polarity word's last token.
* **Geometric features (section 3.2, 3.3; appendix E: "dim + 2").** Intensity ``N = ||d||_2`` and outlierness
  ``D = ||d - c||_1``, the Manhattan distance to the centroid ``c`` = mean of ``d`` over the (original, not
  resampled) training split. The regressor's input is ``[d, N, D]`` (``extra_features=False``: ``d`` alone).
* **Eq. 2 (polarization index).** ``PI = z(N) * D / mean(D)``: the signed intensity (training-set z-score of the
  norm) scaled by the relative outlierness. The text says the norm rises step-wise with the score (fig. 2a) while the
  distance is U-shaped, large at both extremes (fig. 2b), and that PI "pushes extreme scores to the tails" (fig. 2c,
  both tails: top-k and bottom-k are mined). A product does that: high-score samples have a positive ``z(N)`` and a
  large ``D`` (large positive PI), low-score samples a negative ``z(N)`` and a large ``D`` (large negative PI), and
  the dense centre (``D`` small, ``z(N)`` near 0) stays near 0. A sum of z-scores would not: a low-score sample's
  large distance cancels its low norm. The sum (mean of the two z-scores) is available as ``fusion="mean_z"``.
* **Geometric resampling (section 3.3).** "Down-sampling high-density regions (low distance D) and up-sampling
  low-density tails": the paper equates low D with high density, i.e. it takes the density of the difference
  vectors to fall with the distance to their centroid, and the aim is to weight samples up as D grows (the median
  scores sit near the centroid, the extremes far from it, fig. 2b). The histogram of D itself is NOT that density:
  in many dimensions D concentrates away from 0 (a chi-like shape), so its lowest bins are sparse although they hold
  the samples closest to the centre; weighting by the inverse of the histogram (our first reading) up-sampled the
  lowest-distance decile x1.4-1.7, the opposite of the paper. Our reading: ``resample_bins`` equal-width bins of
  ``D`` over the training split; the density at bin ``b`` is the non-increasing envelope of the histogram,
  ``rho_b = max(n_b' for b' >= b)`` (the core, and everything closer to the centroid than the histogram's mode,
  counts as dense; beyond the mode it is the histogram); a sample of bin ``b`` gets weight ``rho_b^(-power)``, bin
  ``b`` is resampled to ``t_b ∝ n_b * rho_b^(-power)`` samples (total ``n``), capped at ``max_upsample * n_b``.
  ``power=1`` flattens the histogram beyond its mode, ``power=0`` changes nothing, the default 0.5 is in between.
  A bin that shrinks is sub-sampled without replacement; one that grows repeats each of its samples ``t_b // n_b``
  times plus a random ``t_b % n_b`` of them once more (so no sample gets more than ``ceil(max_upsample)`` copies).
  Seeded. The indices come from the final layer's ``D`` and are shared by both heads, so the two layers are fitted
  on the same samples and ``u`` reflects the layers, not resampling noise.
* **Regressor (section 3.3, appendix E).** ``PLSRegression(n_components, scale=True)``; the paper's component count
  was lost, so it is chosen by K-fold cross-validation on the training split (MSE of the clipped predictions) unless
  given, with folds grouped by prompt when the prompts are known (``groups``: HelpSteer2 has ~2 responses per
  prompt, and a sibling response in the training folds leaks the prompt into validation). The folds are built on
  the original samples and each fold's training part is resampled on its own
  (resampling before splitting would put copies of a held-out sample into the training folds), which is why a small
  loop over ``sklearn.model_selection.KFold`` is used instead of ``GridSearchCV``. ``regressor="pca"`` is the
  ablation of table 4: standardise, PCA to ``n_components``, ordinary least squares.
* **Eq. 3 (uncertainty).** ``u = |y_final - y_intermediate|``: one regressor per layer (the paper: layers 40 and 15 of
  Qwen3-14B), both predictions clipped to the score range first. The reported score is the final layer's (the
  paper's main layer; fig. 3a shows the score stabilising in late layers).
* **Prediction** is clipped to ``score_range`` (1..5).

A fitted head is reduced to its linear map ``y = [d, N, D] · w + b`` (both PLS and PCA + OLS are linear in their
input), so a saved probe holds arrays only and loads without scikit-learn objects.

Also here: :class:`RidgeBaseline` (alias :class:`MeanPoolRidge`), the ridge of the baselines: on mean-pooled hidden
states, and on the response's length features (no backbone pass). The generative "score-only" judge baseline is
:mod:`rewarduq_exp.methods.score_judge`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from rewarduq_exp.core.atomic_write import atomic_path
from rewarduq_exp.core.errors import UserError, first_line
from rewarduq_exp.models import prefix_cache
from rewarduq_exp.models.shared_prefix import share_lengths

REGRESSORS = ("pls", "pca")
FUSIONS = ("product", "mean_z")
DEFAULT_COMPONENT_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
POLARITY = "{polarity}"
SAVE_FORMAT = "borp-probe"
SAVE_VERSION = 2  # 2: .npz + JSON (1 was a joblib pickle)
PROBE_KIND, RIDGE_KIND = "borp_probe", "mean_pool_ridge"
# RIDGE_KIND names every RidgeBaseline file (mean-pooled states or length features, see its ``inputs``): the string is
# the file format's, kept from when the mean-pooled ridge was the only one.
SAVED_KINDS = {PROBE_KIND: "BoRP probe", RIDGE_KIND: "ridge baseline"}

# The generic ("blind") probe of phase 1; our own wording of the idea in section 3.2 ("Performance is
# Excellent/Terrible"), not the paper's figure 4, which was lost.
GENERIC_INSTRUCTION = ("Look back at the conversation above. How satisfied is the user with the assistant's replies? "
                       "Judge the assistant's performance in one word.")
GENERIC_ANSWER = "The assistant's performance is {polarity}"


# ---------------------------------------------------------------------------------------------------- template
@dataclass(frozen=True)
class ProbeTemplate:
    """The contrastive probe suffix of eq. 1: a user turn (``instruction``), the assistant generation prefix (with
    the empty think block, ``think`` as in :func:`~rewarduq_exp.models.prefix_cache.render_suffix`) and the start of
    the answer (``answer``). ``{polarity}`` (in the instruction or the answer) becomes ``positive`` or ``negative``;
    a refined probe (phase 3) puts the bootstrapped rubric into ``instruction``."""

    instruction: str = GENERIC_INSTRUCTION
    answer: str = GENERIC_ANSWER
    positive: str = "Excellent"
    negative: str = "Terrible"
    think: str = "auto"

    def __post_init__(self):
        if not str(self.instruction).strip():
            raise UserError("probe template: instruction is empty; give the probe prompt (a further user turn), with "
                            f"{POLARITY} in it or in the answer")
        if POLARITY not in self.instruction and POLARITY not in self.answer:
            raise UserError(f"probe template: neither instruction nor answer contains {POLARITY}, so the positive "
                            "and negative suffixes would be identical; put it where the polarity word goes")
        if not str(self.positive).strip() or not str(self.negative).strip() or self.positive == self.negative:
            raise UserError(f"probe template: positive={self.positive!r} and negative={self.negative!r} must be two "
                            "different non-empty words")
        if self.think not in prefix_cache.THINK_MODES:
            raise UserError(f"probe template: think={self.think!r} is invalid; allowed: "
                            f"{', '.join(prefix_cache.THINK_MODES)}")

    def suffix(self, tokenizer, polarity: str) -> str:
        # str.replace, not str.format: rubrics may hold braces of their own.
        instruction = str(self.instruction).replace(POLARITY, polarity)
        answer = str(self.answer).replace(POLARITY, polarity)
        return prefix_cache.render_suffix(tokenizer, instruction, answer, self.think)

    def suffixes(self, tokenizer) -> tuple[str, str]:
        """(positive suffix, negative suffix) as text."""
        return self.suffix(tokenizer, self.positive), self.suffix(tokenizer, self.negative)

    def as_dict(self) -> dict:
        return {"instruction": self.instruction, "answer": self.answer, "positive": self.positive,
                "negative": self.negative, "think": self.think}


def check_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    """The layers as given, after checking each is a valid ``hidden_states`` index for ``num_layers`` layers."""
    prefix_cache.normalize_layers(layers, num_layers)
    return [int(k) for k in layers]


# ---------------------------------------------------------------------------------------------------- extraction
class ContrastiveExtractor:
    """Difference vectors of eq. 1 at several layers, for (prompt, response) conversations.

    The conversation is the prefix; the positive and negative suffixes reuse its KV cache
    (:func:`~rewarduq_exp.models.prefix_cache.suffix_states`, ``reuse=True``) or are run from scratch
    (``reuse=False``; same numbers within float tolerance). ``model`` is a headless decoder.

    ``template`` may be a list (phase 3, several rubrics): the 2R suffixes of R templates all share the one prefix
    pass, and a layer's vector is the concatenation of the R difference vectors, in template order.
    """

    def __init__(self, tokenizer, model, template: ProbeTemplate | Sequence[ProbeTemplate], layers: Sequence[int], *,
                 batch_size: int = 32, reuse: bool = True):
        self.tokenizer = tokenizer
        self.model = model
        self.templates = [template] if isinstance(template, ProbeTemplate) else list(template)
        if not self.templates:
            raise UserError("the probe needs at least one template (rubric)")
        self.num_layers = prefix_cache.num_layers_of(model)
        self.layers = check_layers(layers, self.num_layers)
        if int(batch_size) < 1:
            raise UserError(f"probe batch_size={batch_size} is invalid: must be an integer >= 1")
        self.batch_size = int(batch_size)
        self.reuse = bool(reuse)
        self.stats: dict = {}

    @classmethod
    def from_backbone(cls, backbone, template: ProbeTemplate, layers: Sequence[int], **kwargs):
        """Checks the layers against the checkpoint's config before the weights are loaded."""
        from transformers import AutoConfig

        config = backbone.from_pretrained(AutoConfig, "config")
        check_layers(layers, int(config.num_hidden_layers))
        return cls(backbone.tokenizer, backbone.load_encoder(), template, layers, **kwargs)

    def states(self, prompts, responses) -> np.ndarray:
        """(n, 2R, n_layers, d) hidden states of R templates: [:, 2r] under template r's positive suffix,
        [:, 2r + 1] under its negative one."""
        return self._states(render_prefixes(self.tokenizer, prompts, responses), render_heads(self.tokenizer, prompts))

    def _states(self, prefixes: Sequence[str], heads: Sequence[str] | None = None) -> np.ndarray:
        pre_ids = prefix_cache.tokenize_pieces(self.tokenizer, prefixes)
        suffixes = [text for t in self.templates for text in t.suffixes(self.tokenizer)]
        suf_ids = prefix_cache.tokenize_pieces(self.tokenizer, suffixes)
        if self.reuse:
            h = prefix_cache.suffix_states(self.model, pre_ids, suf_ids, self.layers,
                                           pad_id=self.tokenizer.pad_token_id, batch_size=self.batch_size,
                                           stats=self.stats,
                                           share_lengths=share_lengths(self.tokenizer, pre_ids, heads))
        else:
            h = prefix_cache.full_recompute(self.model, pre_ids, suf_ids, self.layers,
                                            pad_id=self.tokenizer.pad_token_id, batch_size=self.batch_size,
                                            stats=self.stats)
        return h.numpy()

    def differences(self, prefixes: Sequence[str], heads: Sequence[str] | None = None) -> np.ndarray:
        """(n, n_layers, R d) difference vectors (eq. 1) of rendered conversations (:func:`render_prefixes`), the R
        templates' vectors side by side. ``heads[i]``: the start of ``prefixes[i]`` that conversations with the same
        prompt share (its prompt rendered alone), run once per batch."""
        h = self._states(prefixes, heads)
        diff = h[:, 0::2] - h[:, 1::2]                                 # (n, R, n_layers, d)
        return np.concatenate(list(diff.transpose(1, 0, 2, 3)), axis=-1)  # (n, n_layers, R d)

    def extract(self, prompts, responses) -> dict[int, np.ndarray]:
        """{layer (as given): (n, d) difference vectors d = h(positive) - h(negative)} (eq. 1)."""
        prefixes = render_prefixes(self.tokenizer, prompts, responses)
        return by_layer(self.differences(prefixes, render_heads(self.tokenizer, prompts)), self.layers)


def render_prefixes(tokenizer, prompts, responses, system_prompt: str = "keep") -> list[str]:
    """The conversations as the shared prefixes of the probe suffixes (``system_prompt``: keep or drop a template's
    default system prompt, :func:`~rewarduq_exp.models.prefix_cache.render_prefix`)."""
    return [prefix_cache.render_prefix(tokenizer, p, r, system_prompt) for p, r in zip(prompts, responses)]


def render_heads(tokenizer, prompts, system_prompt: str = "keep") -> list[str]:
    """Each prompt rendered alone, as :func:`render_prefixes` renders it before the response: the start of the
    conversation that conversations asking the same share."""
    return [prefix_cache.render_prefix(tokenizer, p, [], system_prompt) for p in prompts]


def by_layer(diff, layers: Sequence[int]) -> dict[int, np.ndarray]:
    """{layer: (n, d)} views of an (n, n_layers, d) array whose second axis follows ``layers``."""
    diff = np.asarray(diff)
    return {int(layer): np.ascontiguousarray(diff[:, i]) for i, layer in enumerate(layers)}


# ---------------------------------------------------------------------------------------------------- geometry
def _as_matrix(diff, what: str = "difference vectors") -> np.ndarray:
    x = np.asarray(diff, dtype=np.float64)
    if x.ndim != 2 or len(x) == 0:
        raise UserError(f"{what} must be a non-empty (n, d) array, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise UserError(f"{what} contain NaN/inf")
    return x


def geometric_features(diff, centroid) -> tuple[np.ndarray, np.ndarray]:
    """(N, D): the L2 norm of each difference vector and its Manhattan (L1) distance to ``centroid``."""
    x = _as_matrix(diff)
    return np.linalg.norm(x, axis=1), np.abs(x - np.asarray(centroid, dtype=np.float64)).sum(1)


def design_matrix(diff, centroid, extra_features: bool = True) -> np.ndarray:
    """The regressor's input: ``[d, N, D]`` (``extra_features``) or ``d`` (the ablation)."""
    x = _as_matrix(diff)
    if not extra_features:
        return x
    norm, dist = geometric_features(x, centroid)
    return np.hstack([x, norm[:, None], dist[:, None]])


def geometric_resample(distance, *, n_bins: int = 10, power: float = 0.5, max_upsample: float = 5.0,
                       seed: int = 0) -> np.ndarray:
    """Indices of the resampled training set (module docstring): equal-width bins of ``distance``, bin ``b`` with
    ``n_b`` samples resampled to ``t_b ∝ n_b * rho_b^(-power)``, ``rho_b`` the histogram's non-increasing envelope
    ``max(n_b' for b' >= b)`` (sum ``n``, at most ``max_upsample * n_b``, at least 1): low distances are thinned,
    the far tail is repeated."""
    dist = np.asarray(distance, dtype=np.float64).ravel()
    n = len(dist)
    if int(n_bins) < 1 or not 0 <= float(power) <= 1 or float(max_upsample) < 1:
        raise UserError(f"resampling: bins={n_bins} must be >= 1, power={power} in [0, 1], "
                        f"max_upsample={max_upsample} >= 1")
    rng = np.random.default_rng(seed)
    lo, hi = float(dist.min()), float(dist.max())
    edges = np.linspace(lo, hi, int(n_bins) + 1) if hi > lo else np.array([lo, lo + 1.0])
    which = np.clip(np.searchsorted(edges, dist, side="right") - 1, 0, len(edges) - 2)
    counts = np.bincount(which, minlength=len(edges) - 1)
    full = counts > 0
    # Density seen from the centroid outwards: never rising with the distance (see the module docstring).
    density = np.maximum.accumulate(counts[::-1])[::-1]
    weight = np.zeros(len(counts))
    weight[full] = counts[full] * density[full] ** (-float(power))
    target = np.minimum(weight / weight.sum() * n, float(max_upsample) * counts)
    target = np.where(full, np.maximum(1, np.rint(target)), 0).astype(np.int64)
    chosen = []
    for b in np.flatnonzero(full):
        members = np.flatnonzero(which == b)
        t = int(target[b])
        # Every member ``t // n_b`` times, plus a random subset of ``t % n_b`` distinct members: as even as integer
        # counts allow (a shrinking bin is a plain sub-sample without replacement).
        repeats, rest = divmod(t, len(members))
        chosen.append(np.concatenate([np.tile(members, repeats), rng.choice(members, size=rest, replace=False)]))
    return rng.permutation(np.concatenate(chosen))


def cv_splits(n: int, folds: int, groups=None, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train, validation) index pairs for ``folds``-fold cross-validation, grouped when ``groups`` is given: rows of
    one group (the responses to one prompt) never sit on both sides, else a response's sibling in the training folds
    leaks its prompt's level into validation and the search picks too little regularisation. With fewer groups than
    folds, one fold per group."""
    from sklearn.model_selection import GroupKFold, KFold

    if groups is None:
        return list(KFold(int(folds), shuffle=True, random_state=seed).split(np.zeros((n, 1))))
    groups = np.asarray(groups)
    if len(groups) != n:
        raise UserError(f"groups must hold one entry per sample ({n}), got {len(groups)}")
    n_groups = len(np.unique(groups))
    if n_groups < 2:
        raise UserError("cross-validation grouped by prompt needs >= 2 distinct prompts; all samples share one")
    splitter = GroupKFold(min(int(folds), n_groups), shuffle=True, random_state=seed)
    return list(splitter.split(np.zeros((n, 1)), groups=groups))


# ---------------------------------------------------------------------------------------------------- polarization
@dataclass(eq=False)
class PolarizationStats:
    """Reference statistics of a set of difference vectors (the training split or the unlabeled pool being mined)."""

    centroid: np.ndarray
    norm_mean: float
    norm_std: float
    dist_mean: float
    dist_std: float

    @classmethod
    def from_reference(cls, diff) -> PolarizationStats:
        x = _as_matrix(diff)
        centroid = x.mean(0)
        norm, dist = geometric_features(x, centroid)
        return cls(centroid, float(norm.mean()), float(norm.std()) or 1.0, float(dist.mean()) or 1.0,
                   float(dist.std()) or 1.0)

    def as_dict(self) -> dict:
        return {"centroid": self.centroid, "norm_mean": self.norm_mean, "norm_std": self.norm_std,
                "dist_mean": self.dist_mean, "dist_std": self.dist_std}


def polarization_index(diff, stats: PolarizationStats | None = None, fusion: str = "product") -> np.ndarray:
    """The polarization index of eq. 2 (reading in the module docstring).

    ``product``: ``PI = z(N) * D / mean(D)``, extremes of both signs in both tails. ``mean_z``: ``(z(N) + z(D)) / 2``.
    ``stats`` default: the statistics of ``diff`` itself (mining an unlabeled pool).
    """
    if fusion not in FUSIONS:
        raise UserError(f"polarization fusion={fusion!r} is invalid; allowed: {', '.join(FUSIONS)}")
    x = _as_matrix(diff)
    stats = stats or PolarizationStats.from_reference(x)
    norm, dist = geometric_features(x, stats.centroid)
    z_norm = (norm - stats.norm_mean) / stats.norm_std
    if fusion == "product":
        return z_norm * dist / stats.dist_mean
    return 0.5 * (z_norm + (dist - stats.dist_mean) / stats.dist_std)


def polarized_samples(pi, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(top, bottom): the indices of the ``k`` largest PI values (largest first) and of the ``k`` smallest (smallest
    first), the samples phase 2 hands to the teacher model; ``k`` is capped at ``len(pi) // 2`` so the two never
    overlap."""
    pi = np.asarray(pi, dtype=np.float64).ravel()
    if int(k) < 1:
        raise UserError(f"k={k} is invalid: the number of polarized samples per tail must be >= 1")
    k = min(int(k), len(pi) // 2)
    order = np.argsort(pi, kind="stable")
    return order[::-1][:k].copy(), order[:k].copy()


# ---------------------------------------------------------------------------------------------------- heads
@dataclass(eq=False)
class LinearHead:
    """One fitted per-layer regressor, reduced to its linear map on ``design_matrix(d, centroid, extra_features)``."""

    centroid: np.ndarray
    coef: np.ndarray
    intercept: float
    n_components: int
    extra_features: bool

    def predict(self, diff) -> np.ndarray:
        """Unclipped scores."""
        return design_matrix(diff, self.centroid, self.extra_features) @ self.coef + self.intercept


def make_estimator(regressor: str, n_components: int):
    from sklearn.cross_decomposition import PLSRegression
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LinearRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if regressor == "pls":
        return PLSRegression(n_components=int(n_components), scale=True)
    if regressor == "pca":
        return make_pipeline(StandardScaler(), PCA(n_components=int(n_components), random_state=0),
                             LinearRegression())
    raise UserError(f"regressor={regressor!r} is invalid; allowed: {', '.join(REGRESSORS)}")


def linear_map(estimator, n_features: int) -> tuple[np.ndarray, float]:
    """(w, b) with ``estimator.predict(X) == X @ w + b`` for a fitted PLS or PCA + OLS pipeline. ``b`` is the
    prediction at the origin (public ``predict``); ``w`` comes from the documented coefficient attributes."""
    b = float(np.ravel(estimator.predict(np.zeros((1, n_features))))[0])
    if hasattr(estimator, "x_rotations_"):  # PLS: y = (X - mean) @ coef_.T + intercept_
        w = np.asarray(estimator.coef_, dtype=np.float64).reshape(-1)
    else:  # StandardScaler -> PCA -> LinearRegression
        scaler, pca, ols = (step for _, step in estimator.steps)
        scale = scaler.scale_ if scaler.scale_ is not None else np.ones(n_features)
        w = (pca.components_.T @ np.ravel(ols.coef_)) / scale
    return w, b


def fit_head(diff, y, *, regressor: str = "pls", n_components: int = 2, extra_features: bool = True,
             rows: np.ndarray | None = None, centroid: np.ndarray | None = None) -> tuple[LinearHead, object]:
    """Fit one layer's regressor on ``diff[rows]`` (``rows``: e.g. resampled indices; default all). The centroid
    defaults to the mean of ``diff`` (all rows, before resampling). Returns the head and the sklearn estimator."""
    x = _as_matrix(diff)
    y = np.asarray(y, dtype=np.float64).ravel()
    centroid = x.mean(0) if centroid is None else np.asarray(centroid, dtype=np.float64)
    rows = np.arange(len(x)) if rows is None else np.asarray(rows)
    design = design_matrix(x, centroid, extra_features)
    if np.ptp(y[rows]) == 0 or np.ptp(design[rows], axis=0).max() == 0:
        # Every (resampled) training score, or every feature vector, is the same: PLS would divide by a zero
        # variance (NaN); the least-squares answer is the constant mean score.
        return LinearHead(centroid, np.zeros(design.shape[1]), float(y[rows].mean()), int(n_components),
                          bool(extra_features)), None
    est = make_estimator(regressor, n_components)
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        # PLS says so when y is fully explained before the last component (the rest are then zero): harmless.
        warnings.filterwarnings("ignore", message="y residual is constant", category=UserWarning)
        warnings.filterwarnings("ignore", category=RuntimeWarning)
        try:
            est.fit(design[rows], y[rows])
        except ValueError as err:  # NaN from a zero-variance (e.g. all-duplicate) training set
            raise UserError(f"the {regressor} regressor could not be fitted on {len(np.unique(rows))} distinct "
                            f"training samples ({str(err).splitlines()[0]}); give more training data, fewer "
                            "components (method.n_components) or method.resample=false") from None
    w, b = linear_map(est, design.shape[1])
    check = design[rows[:8]]
    if not np.allclose(check @ w + b, np.ravel(est.predict(check)), rtol=1e-6, atol=1e-6 * (1 + np.abs(y).max())):
        raise RuntimeError(f"the {regressor} estimator is not the expected linear map (scikit-learn changed?)")
    return LinearHead(centroid, w, b, int(n_components), bool(extra_features)), est


# ---------------------------------------------------------------------------------------------------- the probe
@dataclass(eq=False)
class BorpPrediction:
    score: np.ndarray                                # the final layer's clipped score (the reported one)
    score_final: np.ndarray
    score_intermediate: np.ndarray | None = None
    u: np.ndarray | None = None                      # eq. 3; None without an intermediate layer

    def bounds(self, beta: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """(score - beta u, score + beta u): the bounds of the predictions file."""
        u = np.zeros_like(self.score) if self.u is None else self.u
        return self.score - beta * u, self.score + beta * u


@dataclass(eq=False)
class BorpProbe:
    """The BoRP regressor(s) on difference vectors (module docstring for every formula).

    ``features`` passed to :meth:`fit` / :meth:`predict` map a layer (as given to the extractor) to its ``(n, d)``
    difference vectors; ``final_layer`` and ``intermediate_layer`` pick the two heads (``intermediate_layer=None``:
    one head, no uncertainty). ``n_components=None`` chooses it per head by ``cv_folds``-fold cross-validation over
    ``component_grid``.
    """

    final_layer: int = -1
    intermediate_layer: int | None = None
    regressor: str = "pls"
    n_components: int | None = None
    component_grid: Sequence[int] = DEFAULT_COMPONENT_GRID
    cv_folds: int = 5
    extra_features: bool = True
    resample: bool = True
    resample_bins: int = 10
    resample_power: float = 0.5
    max_upsample: float = 5.0
    score_range: tuple[float, float] = (1.0, 5.0)
    seed: int = 0
    # fitted
    heads_: dict = field(default_factory=dict, repr=False)
    estimators_: dict = field(default_factory=dict, repr=False)
    cv_: dict = field(default_factory=dict, repr=False)
    train_rows_: np.ndarray | None = field(default=None, repr=False)
    polarization_: PolarizationStats | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.regressor not in REGRESSORS:
            raise UserError(f"regressor={self.regressor!r} is invalid; allowed: {', '.join(REGRESSORS)}")
        if self.n_components is not None and int(self.n_components) < 1:
            raise UserError(f"n_components={self.n_components} is invalid: must be >= 1 (or null to choose it by "
                            "cross-validation)")
        if int(self.cv_folds) < 2:
            raise UserError(f"cv_folds={self.cv_folds} is invalid: must be >= 2")
        lo, hi = (float(v) for v in self.score_range)
        if not lo < hi:
            raise UserError(f"score_range={tuple(self.score_range)} is invalid: needs low < high")
        self.score_range = (lo, hi)
        if self.intermediate_layer is not None and int(self.intermediate_layer) == int(self.final_layer):
            raise UserError(f"intermediate_layer={self.intermediate_layer} equals final_layer: the uncertainty of "
                            "eq. 3 needs two different layers (or intermediate_layer=null for none)")

    @property
    def layers(self) -> list[int]:
        return [int(self.final_layer)] + ([] if self.intermediate_layer is None else [int(self.intermediate_layer)])

    def _views(self, features: Mapping) -> dict[int, np.ndarray]:
        missing = [k for k in self.layers if k not in features]
        if missing:
            raise UserError(f"features lack layer(s) {missing}; got layers {sorted(features)}; extract the probe's "
                            f"layers {self.layers}")
        views = {k: _as_matrix(features[k], f"features of layer {k}") for k in self.layers}
        if len({len(v) for v in views.values()}) != 1:
            raise UserError("features of the two layers hold different numbers of samples")
        return views

    def clip(self, scores) -> np.ndarray:
        return np.clip(scores, *self.score_range)

    # ------------------------------------------------------------------------------------------- fitting
    def resample_rows(self, diff, centroid=None) -> np.ndarray:
        """The training rows after geometric resampling (identity without ``resample``)."""
        x = _as_matrix(diff)
        if not self.resample:
            return np.arange(len(x))
        centroid = x.mean(0) if centroid is None else centroid
        _, dist = geometric_features(x, centroid)
        return geometric_resample(dist, n_bins=self.resample_bins, power=self.resample_power,
                                  max_upsample=self.max_upsample, seed=self.seed)

    def _check_size(self, n: int, n_features: int, k: int) -> None:
        if n < k + 1:
            raise UserError(f"too few training samples ({n}) for n_components={k}: PLS/PCA with k components needs "
                            f"at least k+1 samples; lower n_components or add samples")
        if k > n_features:
            raise UserError(f"n_components={k} exceeds the {n_features} input features; allowed 1..{n_features}")

    def _candidates(self, n: int, n_features: int, splits=None) -> list[int]:
        folds = int(self.cv_folds)
        if n < 2 * folds:
            raise UserError(f"too few training samples ({n}) to choose n_components by {folds}-fold "
                            f"cross-validation (needs >= {2 * folds}); set n_components or add samples")
        fold_train = min(len(t) for t, _ in splits) if splits else n - -(-n // folds)
        grid = sorted({int(k) for k in self.component_grid if 1 <= int(k) <= min(fold_train - 1, n_features)})
        if not grid:
            top = min(fold_train - 1, n_features)
            raise UserError(f"no n_components in component_grid={list(self.component_grid)} fits {fold_train} "
                            f"training samples per fold and {n_features} features; allowed 1..{top}")
        return grid

    def cross_validate(self, diff, y, groups=None) -> pd.DataFrame:
        """Mean held-out MSE (clipped predictions) per candidate ``n_components``; resampling inside each fold; folds
        grouped by ``groups`` (e.g. the prompt) when given."""
        x = _as_matrix(diff)
        y = np.asarray(y, dtype=np.float64).ravel()
        p = x.shape[1] + (2 if self.extra_features else 0)
        self._candidates(len(x), p)  # too few samples: say so before splitting
        splits = cv_splits(len(x), int(self.cv_folds), groups, self.seed)
        grid = self._candidates(len(x), p, splits)
        errors = {k: [] for k in grid}
        for train, test in splits:
            centroid = x[train].mean(0)
            rows = train[self.resample_rows(x[train], centroid)]
            for k in grid:
                head, _ = fit_head(x, y, regressor=self.regressor, n_components=k,
                                   extra_features=self.extra_features, rows=rows, centroid=centroid)
                errors[k].append(np.mean((self.clip(head.predict(x[test])) - y[test]) ** 2))
        return pd.DataFrame({"n_components": grid, "cv_mse": [float(np.mean(errors[k])) for k in grid]})

    def fit(self, features: Mapping, y, groups=None) -> BorpProbe:
        """Fit the head(s); ``groups`` (one per sample, e.g. the prompt) groups the folds of the component search."""
        views = self._views(features)
        y = np.asarray(y, dtype=np.float64).ravel()
        final = views[int(self.final_layer)]
        if len(y) != len(final) or not np.isfinite(y).all():
            raise UserError(f"scores must be {len(final)} finite values, one per sample (got {len(y)})")
        p = final.shape[1] + (2 if self.extra_features else 0)
        if self.n_components is not None:
            self._check_size(len(y), p, int(self.n_components))
        else:
            self._candidates(len(y), p)  # fail before any fitting
        self.polarization_ = PolarizationStats.from_reference(final)
        self.train_rows_ = self.resample_rows(final, self.polarization_.centroid)
        self.heads_, self.estimators_, self.cv_ = {}, {}, {}
        for layer, x in views.items():
            k = self.n_components
            if k is None:
                table = self.cross_validate(x, y, groups)
                self.cv_[layer] = table
                k = int(table.loc[table["cv_mse"].idxmin(), "n_components"])  # ties: the smaller k (listed first)
            self.heads_[layer], self.estimators_[layer] = fit_head(
                x, y, regressor=self.regressor, n_components=int(k), extra_features=self.extra_features,
                rows=self.train_rows_)
        return self

    # ------------------------------------------------------------------------------------------- predicting
    def _fitted(self) -> None:
        if not self.heads_:
            raise UserError("the BoRP probe is not fitted; call fit(features, scores) or load a saved probe")

    def predict(self, features: Mapping) -> BorpPrediction:
        self._fitted()
        views = self._views(features)
        final = self.clip(self.heads_[int(self.final_layer)].predict(views[int(self.final_layer)]))
        if self.intermediate_layer is None:
            return BorpPrediction(score=final, score_final=final)
        inter = self.clip(self.heads_[int(self.intermediate_layer)].predict(views[int(self.intermediate_layer)]))
        return BorpPrediction(score=final, score_final=final, score_intermediate=inter, u=np.abs(final - inter))

    def polarization(self, features: Mapping, fusion: str = "product") -> np.ndarray:
        """PI (eq. 2) of new samples against the training split's statistics (final layer)."""
        self._fitted()
        return polarization_index(self._views(features)[int(self.final_layer)], self.polarization_, fusion)

    # ------------------------------------------------------------------------------------------- persistence
    def config(self) -> dict:
        return {"final_layer": int(self.final_layer),
                "intermediate_layer": None if self.intermediate_layer is None else int(self.intermediate_layer),
                "regressor": self.regressor, "n_components": self.n_components,
                "component_grid": [int(k) for k in self.component_grid], "cv_folds": int(self.cv_folds),
                "extra_features": bool(self.extra_features), "resample": bool(self.resample),
                "resample_bins": int(self.resample_bins), "resample_power": float(self.resample_power),
                "max_upsample": float(self.max_upsample), "score_range": list(self.score_range),
                "seed": int(self.seed)}

    def save(self, path: str | Path) -> Path:
        """One ``.npz`` file (written atomically): the fitted heads and statistics as arrays, the config and scalars
        as a JSON string beside them. Loading it runs ``np.load(allow_pickle=False)``, which never executes code,
        unlike a pickle."""
        self._fitted()
        arrays = {"polarization/centroid": self.polarization_.centroid, "train_rows": self.train_rows_}
        heads = {}
        for layer, head in self.heads_.items():
            arrays[f"head/{layer}/centroid"] = head.centroid
            arrays[f"head/{layer}/coef"] = head.coef
            heads[str(layer)] = {"intercept": float(head.intercept), "n_components": int(head.n_components),
                                 "extra_features": bool(head.extra_features)}
        polarization = {k: v for k, v in self.polarization_.as_dict().items() if k != "centroid"}
        meta = {"format": SAVE_FORMAT, "version": SAVE_VERSION, "kind": PROBE_KIND, "config": self.config(),
                "heads": heads,
                "polarization": polarization, "cv": {str(k): t.to_dict("list") for k, t in self.cv_.items()}}
        return save_arrays(path, meta, arrays)

    @classmethod
    def load(cls, path: str | Path, sizes: SavedSizes | None = None) -> BorpProbe:
        """A probe saved by :meth:`save`; ``sizes`` (the run's feature dimension and training rows) bound its arrays
        before they are read (without: :mod:`~rewarduq_exp.core.payload_bounds`' constants)."""
        meta, arrays = load_arrays(path, PROBE_KIND, sizes)
        try:
            probe = cls(**{**meta["config"], "score_range": tuple(meta["config"]["score_range"])})
            probe.heads_ = {int(k): LinearHead(centroid=arrays[f"head/{k}/centroid"], coef=arrays[f"head/{k}/coef"],
                                               **h)
                            for k, h in meta["heads"].items()}
            probe.polarization_ = PolarizationStats(centroid=arrays["polarization/centroid"], **meta["polarization"])
            probe.cv_ = {int(k): pd.DataFrame(t) for k, t in meta["cv"].items()}
            probe.train_rows_ = arrays["train_rows"]
        except (KeyError, TypeError, ValueError, AttributeError) as err:  # an array or a meta field missing or odd
            raise UserError(f"{path}: not a complete saved {SAVED_KINDS[PROBE_KIND]} ({type(err).__name__}: "
                            f"{first_line(err)})") from None
        return probe


def save_arrays(path: str | Path, meta: dict, arrays: Mapping[str, np.ndarray]) -> Path:
    """Write ``arrays`` and the JSON-able ``meta`` (stored as the string array ``meta``) to one ``.npz``,
    atomically."""
    import json

    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:  # a file object: np.savez would append ".npz" to a name
        np.savez(fh, meta=np.array(json.dumps(meta)), **{k: np.asarray(v) for k, v in arrays.items()})
    return path


@dataclass(frozen=True)
class SavedSizes:
    """What a run's settings say of the arrays of its saved probe and ridges: the feature dimension and the training
    rows (``method.json``'s fit summary); None where not known, then bounded by
    :data:`~rewarduq_exp.core.payload_bounds.MAX_FEATURE_DIM` / :data:`~rewarduq_exp.core.payload_bounds.MAX_ROWS`.
    ``source`` says where they come from (shown when a file is refused)."""

    feature_dim: int | None = None
    train_rows: int | None = None
    source: str = ""


# The length ridge's inputs: metrics.probe.length_covariates, (characters, words, tokens) and their log1p.
LENGTH_FEATURES = 6


def _expected_arrays(kind: str, meta: dict, sizes: SavedSizes) -> dict:
    """{array: Expected} of a saved probe or ridge, from its meta (layers, extra features, inputs) and ``sizes``."""
    import math

    from rewarduq_exp.core.payload_bounds import MAX_FEATURE_DIM, MAX_ROWS, AtMost, Expected

    d = sizes.feature_dim or AtMost(MAX_FEATURE_DIM)
    why = sizes.source or f"no fit summary: at most {MAX_FEATURE_DIM} features, {MAX_ROWS} rows"
    if kind == RIDGE_KIND:
        if meta.get("inputs") == "length features":
            return {"coef": Expected((LENGTH_FEATURES,), "f", "the length ridge's covariates")}
        return {"coef": Expected((AtMost(d) if isinstance(d, int) else d,), "f", why)}
    config = meta["config"]
    layers = {int(config["final_layer"])}
    if config.get("intermediate_layer") is not None:
        layers.add(int(config["intermediate_layer"]))
    heads = meta["heads"]
    if not isinstance(heads, dict) or {int(k) for k in heads} != layers:
        raise ValueError(f"heads {sorted(heads)} are not the layers {sorted(layers)} of its config")
    rows = MAX_ROWS
    if sizes.train_rows is not None:  # geometric resampling: each bin at most max_upsample x its size, >= 1 sample
        rows = min(MAX_ROWS, math.ceil(float(config["max_upsample"])) * sizes.train_rows
                   + int(config["resample_bins"]))
    out = {"polarization/centroid": Expected((d,), "f", why), "train_rows": Expected((AtMost(rows),), "iu", why)}
    for layer, head in heads.items():
        extra = 2 if bool(head["extra_features"]) else 0
        width = d + extra if isinstance(d, int) else AtMost(d.n + extra)
        out[f"head/{layer}/centroid"] = Expected((d,), "f", why)
        out[f"head/{layer}/coef"] = Expected((width,), "f", why)
    return out


def load_arrays(path: str | Path, kind: str, sizes: SavedSizes | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, arrays) of a file written by :func:`save_arrays`, after checking its format, version and kind (a probe
    file read as the ridge, or the reverse, is one line naming both, not a KeyError on a missing array).

    Nothing is read before its declared shape is checked (:class:`~rewarduq_exp.core.payload_bounds.NpzArrays`):
    first the meta (one JSON string, at most ``MAX_JSON_BYTES`` characters), then the arrays that meta and ``sizes``
    (the run's settings) say the file holds, with their shapes; anything else is refused in one line."""
    import json

    from rewarduq_exp.core.payload_bounds import Expected, NpzArrays
    from rewarduq_exp.core.saved_files import MAX_JSON_BYTES

    what = SAVED_KINDS[kind]
    path = Path(path)
    sizes = sizes or SavedSizes()
    with NpzArrays(path, what) as npz:
        if "meta" not in npz.declared:
            raise UserError(f"{path}: not a saved {what}")
        npz.check_one("meta", Expected((), "U", "a JSON string", max_itemsize=4 * MAX_JSON_BYTES))
        try:
            meta = json.loads(str(npz.read("meta")))
        except (ValueError, RecursionError) as err:  # bad or deeply nested meta JSON
            raise UserError(f"{path}: not a saved {what} ({(str(err).splitlines() or [type(err).__name__])[0]}); "
                            "the file is damaged or of another kind") from None
        if not isinstance(meta, dict):
            raise UserError(f"{path}: not a saved {what} (its meta is not a JSON object)")
        if meta.get("format") != SAVE_FORMAT:
            raise UserError(f"{path}: not a saved {what}")
        if meta.get("version") != SAVE_VERSION:
            raise UserError(f"{path}: {what} format version {meta.get('version')}; this code reads version "
                            f"{SAVE_VERSION}; retrain the run")
        # Files from before the kind was stored: a probe is the one with heads.
        found = meta.get("kind") or (PROBE_KIND if "heads" in meta else RIDGE_KIND)
        if found != kind:
            loader = {PROBE_KIND: "BorpProbe.load", RIDGE_KIND: "RidgeBaseline.load"}.get(found)
            if loader is None:
                raise UserError(f"{path}: not a saved {what} (kind {found!r})")
            raise UserError(f"{path} holds a {SAVED_KINDS.get(found, found)}, not a {what}; read it with {loader}")
        try:
            expected = _expected_arrays(kind, meta, sizes)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:  # a meta field missing/odd
            raise UserError(f"{path}: not a complete saved {what} ({type(err).__name__}: {first_line(err)})") from None
        npz.check(expected | {"meta": Expected((), "U", max_itemsize=4 * MAX_JSON_BYTES)})
        arrays = {name: npz.read(name) for name in expected}
    return meta, arrays


# ---------------------------------------------------------------------------------------------------- baseline
def mean_pooled_features(tokenizer, model, prompts, responses, layer: int = -1, batch_size: int = 32) -> np.ndarray:
    """(n, d) mean over the real tokens of the rendered conversation at ``layer`` (the ridge baseline's input)."""
    return mean_pooled_prefixes(tokenizer, model, render_prefixes(tokenizer, prompts, responses), layer, batch_size,
                                heads=render_heads(tokenizer, prompts))


def mean_pooled_prefixes(tokenizer, model, prefixes: Sequence[str], layer: int = -1, batch_size: int = 32,
                         stats: dict | None = None, heads: Sequence[str] | None = None) -> np.ndarray:
    """:func:`mean_pooled_features` of already rendered conversations (``heads`` as in
    :meth:`ContrastiveExtractor.differences`)."""
    check_layers([layer], prefix_cache.num_layers_of(model))
    ids = prefix_cache.tokenize_pieces(tokenizer, prefixes)
    h = prefix_cache.mean_pooled_states(model, ids, [layer], pad_id=tokenizer.pad_token_id, batch_size=batch_size,
                                        stats=stats, share_lengths=share_lengths(tokenizer, ids, heads))
    return h[:, 0].numpy()


@dataclass(eq=False)
class RidgeBaseline:
    """A baseline: standardised features -> ridge regression, the penalty chosen over ``alphas`` by ``RidgeCV``:
    ``cv_folds``-fold CV grouped by prompt when ``fit`` gets ``groups`` (leave-one-out, the efficient default, lets a
    response's sibling of the same prompt inform its prediction and picks too small a penalty), else efficient
    leave-one-out; predictions clipped to ``score_range``. Like the probe's heads, the fitted pipeline is reduced to
    its linear map ``y = x · w + b`` (standardising then ridge is linear in x).

    One class for every ridge baseline of a BoRP run; ``inputs`` names what ``x`` holds (messages, the saved file):
    mean-pooled hidden states (``MeanPoolRidge``, the default) or the response's length features (the length ridge,
    :func:`rewarduq_exp.metrics.probe.length_covariates`)."""

    alphas: Sequence[float] = (0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0)
    score_range: tuple[float, float] = (1.0, 5.0)
    cv_folds: int = 5
    seed: int = 0
    inputs: str = "mean-pooled features"
    coef_: np.ndarray | None = field(default=None, repr=False)
    intercept_: float = 0.0
    alpha_: float | None = None

    def fit(self, x, y, groups=None) -> RidgeBaseline:
        from sklearn.linear_model import RidgeCV
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        x = _as_matrix(x, self.inputs)
        y = np.asarray(y, dtype=np.float64).ravel()
        if len(y) != len(x) or len(y) < 3:
            raise UserError(f"the ridge baseline needs >= 3 samples with one score each (got {len(x)} and {len(y)})")
        cv = None if groups is None else cv_splits(len(y), int(self.cv_folds), groups, self.seed)
        scaler, ridge = StandardScaler(), RidgeCV(alphas=list(self.alphas), cv=cv)
        make_pipeline(scaler, ridge).fit(x, y)
        self.coef_ = np.ravel(ridge.coef_) / scaler.scale_
        self.intercept_ = float(ridge.intercept_ - scaler.mean_ @ self.coef_)
        self.alpha_ = float(ridge.alpha_)
        return self

    def predict(self, x) -> np.ndarray:
        if self.coef_ is None:
            raise UserError("the ridge baseline is not fitted; call fit(features, scores) first")
        return np.clip(_as_matrix(x, self.inputs) @ self.coef_ + self.intercept_, *self.score_range)

    def save(self, path: str | Path) -> Path:
        meta = {"format": SAVE_FORMAT, "version": SAVE_VERSION, "kind": RIDGE_KIND, "inputs": self.inputs,
                "intercept": self.intercept_, "alpha": self.alpha_, "alphas": [float(a) for a in self.alphas],
                "score_range": list(self.score_range)}
        return save_arrays(path, meta, {"coef": self.coef_})

    @classmethod
    def load(cls, path: str | Path, sizes: SavedSizes | None = None) -> RidgeBaseline:
        meta, arrays = load_arrays(path, RIDGE_KIND, sizes)
        try:
            return cls(alphas=tuple(meta["alphas"]), score_range=tuple(meta["score_range"]), coef_=arrays["coef"],
                       intercept_=float(meta["intercept"]), alpha_=meta["alpha"],
                       inputs=str(meta.get("inputs", cls.inputs)))  # files from before ``inputs``: mean-pooled
        except (KeyError, TypeError, ValueError) as err:  # an array or a meta field missing or odd
            raise UserError(f"{path}: not a complete saved {SAVED_KINDS[RIDGE_KIND]} ({type(err).__name__}: "
                            f"{first_line(err)})") from None


# The mean-pooled-states ridge: the name the baseline had before the length ridge shared its class.
MeanPoolRidge = RidgeBaseline
