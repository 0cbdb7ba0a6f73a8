"""``method=borp``: the BoRP probe (rewarduq_exp/methods/borp.py) behind the method contract, so the runner trains
it on pointwise data (HelpSteer2, the synthetic world's 1-5 ratings) and scores any preference eval set with bounds
``score +- beta * u`` (u = the layer gap of eq. 3), which RewardUQ's metrics, the selection and the tables read like
any other method's predictions.

The probe reads its suffix template, layers and batch size from ``probe=borp_contrastive`` (the run's probe config,
given through the encoder); ``method.*`` holds the regressor. On pointwise eval sets the runner also asks
:meth:`BorpMethod.baselines` for the baselines of the same run: the two of the same backbone (the generative
score-only judge and a mean-pooled ridge; ``method.baselines=false`` leaves them out) and a ridge on the response's
length (characters, words, backbone tokens; no backbone pass, always there), so they are compared in one run.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.hashing import stable_hash
from rewarduq_exp.core.setting_bounds import WIDTH, Bound
from rewarduq_exp.methods.base import RewardMethod, Scores, read_method_info, saved_size, write_method_info
from rewarduq_exp.methods.borp import (
    BorpPrediction,
    BorpProbe,
    ContrastiveExtractor,
    MeanPoolRidge,
    ProbeTemplate,
    RidgeBaseline,
    SavedSizes,
    by_layer,
    mean_pooled_prefixes,
    render_heads,
    render_prefixes,
)
from rewarduq_exp.methods.score_judge import JUDGE_SCALE, JUDGE_SCORINGS, ScoreOnlyJudge, judge_instruction
from rewarduq_exp.methods.settings import MethodSettings, cast, one_of, setting

PROBE_KIND = "borp_contrastive"
RUBRIC = "{rubric}"
# Why there is no SGLang backend (docs/borp.md): its public API returns only the final layer's hidden state, after
# the final norm (eq. 3 needs an intermediate layer too), and it pins its own torch/transformers/CUDA stack, so it
# cannot share this environment; nothing could be run or checked without a GPU.
SGLANG_NOT_BUILT = ("probe.backend=sglang is not available: SGLang's engine returns only the final layer's hidden "
                    "state (other layers only through its internal speculative-decoding capture), eq. 3 needs an "
                    "intermediate one too, and SGLang needs its own CUDA environment; use probe.backend=hf, which "
                    "also reuses the conversation's KV cache for every suffix")
PROBE_FILE = "probe.npz"
RIDGE_FILE = "mean_pool_ridge.npz"
LENGTH_RIDGE_FILE = "length_ridge.npz"


def _messages(values) -> list:
    return [list(v) for v in values]


def response_text(messages) -> str:
    """The text of a response (its messages' contents, one per line), as its length is counted."""
    return "\n".join(str(m["content"]) for m in messages)


# A column of pointwise data naming the cross-validation group of each row, where the prompt does not.
CV_GROUP = "cv_group"


def prompt_groups(prompts) -> np.ndarray:
    """One integer per row, equal for rows whose prompt (the whole message list) is the same."""
    keys = [stable_hash([dict(m) for m in p]) for p in prompts]
    return pd.factorize(pd.Series(keys))[0]


def _beta(value, key):
    if not float(value) > 0:
        raise UserError(f"{key}={value} is invalid: must be a number > 0")
    return float(value)


@dataclass(kw_only=True)
class BorpSettings(MethodSettings, config="borp"):
    """Defaults and comments: ``conf/method/borp.yaml``. The probe's own settings are checked by
    :class:`~rewarduq_exp.methods.borp.BorpProbe` (its messages)."""

    regressor: str = setting(doc="pls | pca")
    n_components: int | None = setting(doc="null: chosen by cross-validation",
                                       bound=Bound(1, WIDTH, "components", "more than any backbone's width, the "
                                                   "features' dimension", allow=(None,)))
    cv_folds: int = setting(bound=Bound(2, 1000, "folds", "every fold fits the regressor again"),
                            doc="folds of the cross-validation")
    extra_features: bool = setting(check=cast(bool), doc="append ||d|| and the distance to the centroid")
    resample: bool = setting(check=cast(bool), doc="geometric resampling of the training set")
    resample_power: float = setting(check=cast(float), doc="0: no change .. 1: flat histogram")
    score_range: list[float] = setting(check=cast(lambda v: [float(x) for x in v], "a list of numbers"),
                               doc="[low, high] of the ratings")
    beta: float = setting(check=_beta, doc="bounds score +- beta * u")
    baselines: bool = setting(check=cast(bool), doc="also score with the judge and a mean-pooled ridge")
    judge_scoring: str = setting(check=one_of(JUDGE_SCORINGS), doc="digit | expected")
    seed: int = setting(default=0, check=cast(int), doc="cross-validation folds, resampling")
    device: str = setting(default="auto", runtime=True, doc="auto | cpu | cuda | cuda:<i>")
    show_progress: bool = setting(default=True, runtime=True, doc="progress bars")

    def probe_settings(self) -> dict:
        """The keywords of :class:`~rewarduq_exp.methods.borp.BorpProbe` these settings give."""
        return {"regressor": self.regressor, "n_components": self.n_components, "cv_folds": self.cv_folds,
                "extra_features": self.extra_features, "resample": self.resample,
                "resample_power": self.resample_power, "score_range": tuple(self.score_range), "seed": self.seed}

    def validate(self) -> None:
        super().validate()
        BorpProbe(**self.probe_settings())  # its one-line errors, before any data or model


class BorpMethod(RewardMethod):
    name = "borp"
    task = "pointwise"               # trains on rated responses (prompt, response, score)
    # Its difference vectors, the ridge's mean-pooled states and the judge's digit logits go through the shared
    # feature cache (keyed by backbone, template, layers and texts): a sweep over the regressor's settings runs the
    # backbone once, and under torchrun the processes split that work.
    uses_feature_cache = True

    settings_class = BorpSettings

    def __init__(self, encoder=None, **values):
        super().__init__(encoder, **values)
        self.use_baselines = self.settings.baselines
        self.show_progress = self.settings.show_progress and not os.environ.get("TQDM_DISABLE")
        self.probe: BorpProbe | None = None
        self._num_layers: int | None = None
        self._extractor = None
        self._ridge: MeanPoolRidge | None = None
        self._length_ridge: RidgeBaseline | None = None
        self._judge = None

    # ------------------------------------------------------------------ the probe config and the backbone
    def _probe_cfg(self):
        if self.encoder is None:
            raise RuntimeError("BorpMethod needs encoder= (the backbone with the run's probe config)")
        cfg = self.encoder.probe_cfg
        if cfg.get("kind") != PROBE_KIND:
            raise UserError(f"method=borp reads hidden states through a contrastive probe: pass "
                            f"probe={PROBE_KIND} (got probe={cfg.get('name')})")
        backend = cfg.get("backend", "hf")
        if backend == "sglang":
            raise UserError(SGLANG_NOT_BUILT)
        if backend != "hf":
            raise UserError(f"probe.backend={backend!r} is invalid; allowed: hf")
        return cfg

    def layers(self) -> tuple[int, int | None]:
        """(final layer, intermediate layer) as hidden_states indices; the intermediate default is 3/8 of the depth
        (the paper's layer 15 of Qwen3-14B's 40), always below the final layer (``hidden_states[depth]`` is the
        final layer's output, the same as -1)."""
        cfg = self._probe_cfg()
        final = int(cfg.layer)
        intermediate = cfg.get("intermediate_layer")
        if intermediate is None:
            depth = self._depth()
            if depth < 2:  # a one-layer model has no intermediate layer (0 is the embeddings): no uncertainty
                return final, None
            intermediate = min(max(1, round(depth * 15 / 40)), depth - 1)
        return final, (None if intermediate == "none" else int(intermediate))

    def _depth(self) -> int:
        """The backbone's number of layers, read from its config once (layers() is asked for every scoring call)."""
        if self._num_layers is None:
            from transformers import AutoConfig

            self._num_layers = int(self.encoder.backbone.from_pretrained(AutoConfig, "config").num_hidden_layers)
        return self._num_layers

    def templates(self) -> list[ProbeTemplate]:
        """The generic probe (``probe.instruction``), or, for a refined probe (phase 3), one template per rubric in
        ``probe.rubrics``, each rubric put into ``probe.rubric_instruction`` at ``{rubric}``."""
        cfg = self._probe_cfg()
        rubrics = list(cfg.get("rubrics") or [])
        common = {"answer": str(cfg.answer), "positive": str(cfg.positive), "negative": str(cfg.negative),
                  "think": str(cfg.think)}
        if not rubrics:
            return [ProbeTemplate(instruction=str(cfg.instruction), **common)]
        wrapper = str(cfg.get("rubric_instruction") or "")
        if RUBRIC not in wrapper:
            raise UserError(f"probe.rubric_instruction must contain {RUBRIC}, where each rubric of probe.rubrics "
                            "goes")
        empty = [i for i, r in enumerate(rubrics) if not str(r).strip()]
        if empty:
            raise UserError(f"probe.rubrics[{empty[0]}] is empty; give the rubric's text")
        return [ProbeTemplate(instruction=wrapper.replace(RUBRIC, str(r).strip()), **common) for r in rubrics]

    def identity(self, layers: list[int]) -> dict:
        """The feature-cache identity of the difference vectors (one template: the same key as before rubrics)."""
        templates = [t.as_dict() for t in self.templates()]
        which = {"template": templates[0]} if len(templates) == 1 else {"templates": templates}
        return {"kind": PROBE_KIND, **which, "layers": layers}

    def probe_layers(self) -> list[int]:
        """The layers read: the final one, then the intermediate one if any."""
        final, intermediate = self.layers()
        return [final] + ([] if intermediate is None else [intermediate])

    def extractor(self) -> ContrastiveExtractor:
        if self._extractor is None:
            cfg = self._probe_cfg()
            self._extractor = ContrastiveExtractor.from_backbone(
                self.encoder.backbone, self.templates(), self.probe_layers(), batch_size=int(cfg.batch_size),
                reuse=bool(cfg.get("reuse_prefix", True)))
        return self._extractor

    def _cached(self, what: dict, conversations: tuple[list[str], list[str]], compute) -> np.ndarray:
        """``compute(prefixes, heads)`` (a numpy array or tensor, one row per prefix) through the feature cache, for
        the ``(prefixes, heads)`` of :meth:`_conversations`; its forward passes are counted in the encoder's
        stats."""
        import torch

        prefixes, heads = conversations

        def rows(idx):
            before = self._forward_passes()
            out = torch.as_tensor(np.asarray(compute([prefixes[i] for i in idx], [heads[i] for i in idx]),
                                             dtype=np.float32))
            self.encoder.stats["backbone_forward_passes"] += self._forward_passes() - before
            return out

        return self.encoder.cached(what, prefixes, rows).numpy()

    def _forward_passes(self) -> int:
        return sum(part.stats.get("forward_passes", 0) for part in (self._extractor, self._judge) if part is not None)

    def _conversations(self, prompts, responses) -> tuple[list[str], list[str]]:
        """The rendered conversations and their heads: each prompt rendered alone, the part that conversations asking
        the same share (run once per batch)."""
        system_prompt = str(self._probe_cfg().get("default_system_prompt", "keep"))
        tok, prompts = self.encoder.tokenizer, _messages(prompts)
        return (render_prefixes(tok, prompts, _messages(responses), system_prompt),
                render_heads(tok, prompts, system_prompt))

    def features(self, prompts, responses) -> dict[int, np.ndarray]:
        layers = self.probe_layers()
        what = self.identity(layers)
        conversations = self._conversations(prompts, responses)
        return by_layer(self._cached(what, conversations, self.extractor().differences), layers)

    def mean_pooled(self, prompts, responses) -> np.ndarray:
        """The ridge baseline's input: mean-pooled final-layer states of the conversations (cached)."""
        final, _ = self.layers()
        what = {"kind": "mean_pooled_conversation", "layer": final}
        return self._cached(what, self._conversations(prompts, responses), lambda texts, heads: mean_pooled_prefixes(
            self.encoder.tokenizer, self.extractor().model, texts, final, int(self._probe_cfg().batch_size),
            stats=self.extractor().stats, heads=heads))

    def response_lengths(self, responses) -> np.ndarray:
        """(n, 3) lengths of the responses (:data:`~rewarduq_exp.metrics.probe.LENGTH_COLUMNS`): characters,
        whitespace-separated words and tokens of the backbone's tokenizer (the response's text alone, no template
        or special tokens). Tokenizer only: no backbone pass."""
        texts = [response_text(r) for r in _messages(responses)]
        tokens = self.encoder.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        return np.array([[len(t), len(t.split()), len(ids)] for t, ids in zip(texts, tokens)],
                        dtype=float).reshape(len(texts), 3)

    def length_features(self, responses) -> np.ndarray:
        """The length ridge's input: :func:`~rewarduq_exp.metrics.probe.length_covariates` of the lengths."""
        from rewarduq_exp.metrics.probe import length_covariates  # matplotlib with it: only once a run fits

        return length_covariates(self.response_lengths(responses))

    def _ridge_baseline(self, inputs: str) -> RidgeBaseline:
        return RidgeBaseline(score_range=tuple(self.settings.score_range), cv_folds=self.cv_folds,
                             seed=self.seed, inputs=inputs)

    # ------------------------------------------------------------------ contract
    def fit(self, train: pd.DataFrame, eval: pd.DataFrame | None = None) -> BorpMethod:  # noqa: A002
        if "response" not in train.columns or "score" not in train.columns:
            raise UserError("method=borp trains on pointwise data (prompt, response, score), e.g. dataset=helpsteer2 "
                            "or dataset=synthetic_pointwise")
        t0 = time.perf_counter()
        final, intermediate = self.layers()
        features = self.features(train["prompt"], train["response"])
        t_features = time.perf_counter() - t0
        self.probe = BorpProbe(final_layer=final, intermediate_layer=intermediate, **self.settings.probe_settings())
        # Folds grouped by prompt: responses to one prompt share its level (HelpSteer2: ~2 per prompt). Data whose
        # prompt is a template says what belongs together itself (vader_ratings: the sentences of one article).
        groups = (pd.factorize(train[CV_GROUP].astype(str))[0] if CV_GROUP in train.columns
                  else prompt_groups(train["prompt"]))
        self.probe.fit(features, train["score"].to_numpy(dtype=float), groups=groups)
        self.fit_summary = {"train_responses": len(train), "cv_groups": int(groups.max()) + 1,
                            "layers": [final, intermediate],
                            "feature_dim": int(features[final].shape[1]), "seconds_features": round(t_features, 3),
                            "seconds_regression": round(time.perf_counter() - t0 - t_features, 3)}
        y = train["score"].to_numpy(dtype=float)
        # The length baseline: the same ridge and grouped penalty search on the response's length covariates.
        self._length_ridge = self._ridge_baseline("length features").fit(
            self.length_features(train["response"]), y, groups=groups)
        if self.use_baselines:
            x = self.mean_pooled(train["prompt"], train["response"])
            self._ridge = self._ridge_baseline("mean-pooled features").fit(x, y, groups=groups)
        return self

    def predict(self, prompts, responses) -> BorpPrediction:
        if self.probe is None:
            raise RuntimeError("BorpMethod is not fitted: call fit or load first")
        return self.probe.predict(self.features(prompts, responses))

    def score(self, prompts, completions) -> Scores:
        pred = self.predict(prompts, completions)
        u = np.zeros_like(pred.score) if pred.u is None else pred.u   # one head: no uncertainty
        return Scores(reward=pred.score, u=u, beta=self.beta)

    def score_pairs(self, frame: pd.DataFrame) -> tuple[Scores, Scores]:
        n = len(frame)
        both = self.score(list(frame["prompt"]) * 2, list(frame["chosen"]) + list(frame["rejected"]))
        cut = slice(0, n), slice(n, 2 * n)
        return tuple(both[c] for c in cut)

    def judge_instruction(self) -> str:
        """The score-only judge's request: the probe's own question (generic probe) or rubrics (refined probe) on the
        probe's score scale (see :func:`~rewarduq_exp.methods.score_judge.judge_instruction`)."""
        cfg = self._probe_cfg()
        rubrics = [str(r).strip() for r in (cfg.get("rubrics") or [])]
        basis = (str(cfg.rubric_instruction).replace(RUBRIC, "\n\n".join(rubrics)) if rubrics
                 else str(cfg.instruction))
        low, high = (int(round(v)) for v in self.settings.score_range)
        return judge_instruction(basis, low=low, high=high, negative=str(cfg.negative), positive=str(cfg.positive),
                                 scale=str(cfg.get("judge_scale") or JUDGE_SCALE))

    def baselines(self, frame: pd.DataFrame) -> dict[str, np.ndarray]:
        """Scores of the baselines on a pointwise frame: the generative score-only judge, asked the probe's own
        question (the decoded digit; ``judge_scoring=expected``: the mean of its distribution over the digits), and
        the mean-pooled ridge fitted on the training split (both only with ``baselines=true``), and the length ridge
        fitted on the training split (whenever the run has one: a model saved before it existed has none)."""
        out = {}
        if self._length_ridge is not None:
            out["length_ridge"] = self._length_ridge.predict(self.length_features(frame["response"]))
        if not self.use_baselines:
            return out
        if self._judge is None:  # the causal LM is loaded once per run, and only if a judgment is not cached
            low, high = (int(round(v)) for v in self.settings.score_range)
            self._judge = ScoreOnlyJudge.from_backbone(
                self.encoder.backbone, self.judge_instruction(), scores=[str(v) for v in range(low, high + 1)],
                batch_size=int(self._probe_cfg().batch_size), think=str(self._probe_cfg().think))
        raw = self._cached(self._judge.identity(), self._conversations(frame["prompt"], frame["response"]),
                           self._judge.raw)
        out["score_judge"] = self._judge.result(raw).scores(self.judge_scoring)
        if self._ridge is not None:
            out["mean_pool_ridge"] = self._ridge.predict(self.mean_pooled(frame["prompt"], frame["response"]))
        return out

    def save(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.probe.save(directory / PROBE_FILE)
        if self._ridge is not None:
            self._ridge.save(directory / RIDGE_FILE)
        if self._length_ridge is not None:
            self._length_ridge.save(directory / LENGTH_RIDGE_FILE)
        extra = {"backbone": self.encoder.backbone.identity(), "probe": dict(self._probe_cfg())} \
            if self.encoder is not None else {}
        write_method_info(directory, self, **extra)

    @staticmethod
    def saved_sizes(info: dict, directory) -> SavedSizes:
        """The bounds of the saved probe's and ridges' arrays: ``fit_summary.feature_dim`` and
        ``fit_summary.train_responses`` of ``method.json`` (each capped; absent: the caps)."""
        from rewarduq_exp.core.payload_bounds import MAX_FEATURE_DIM, MAX_ROWS

        d = saved_size(info, "fit_summary", "feature_dim", MAX_FEATURE_DIM, directory)
        n = saved_size(info, "fit_summary", "train_responses", MAX_ROWS, directory)
        said = [f"{k}={v}" for k, v in (("feature_dim", d), ("train_responses", n)) if v is not None]
        return SavedSizes(d, n, f"{', '.join(said)} in method.json" if said else "")

    def load(self, directory: str | os.PathLike) -> BorpMethod:
        directory = Path(directory)
        info = read_method_info(directory, self.name)
        sizes = self.saved_sizes(info, directory)
        self.probe = BorpProbe.load(directory / PROBE_FILE, sizes)
        if (directory / RIDGE_FILE).exists():
            self._ridge = MeanPoolRidge.load(directory / RIDGE_FILE, sizes)
        if (directory / LENGTH_RIDGE_FILE).exists():
            self._length_ridge = RidgeBaseline.load(directory / LENGTH_RIDGE_FILE, sizes)
        self.fit_summary = info.get("fit_summary", {})
        return self
