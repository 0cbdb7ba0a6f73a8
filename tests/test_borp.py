"""BoRP probe: the regressor on contrastive difference vectors, its ablations, geometric resampling,
the layer-gap uncertainty, the polarization index, persistence and bad input; the extraction and the baselines on
the tiny model."""

import numpy as np
import pytest
import torch
from conftest import ROOT
from omegaconf import OmegaConf

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.borp import (
    BorpProbe,
    ContrastiveExtractor,
    MeanPoolRidge,
    ProbeTemplate,
    check_layers,
    cv_splits,
    design_matrix,
    geometric_features,
    geometric_resample,
    mean_pooled_features,
    polarization_index,
    polarized_samples,
)
from rewarduq_exp.methods.score_judge import ScoreOnlyJudge
from rewarduq_exp.metrics.probe import krippendorff_alpha, pearson, spearman
from rewarduq_exp.models.backbone import Backbone

FINAL, INTER = 40, 15


def synthetic(n: int = 600, d: int = 48, seed: int = 0):
    """Difference vectors at two layers of a pointwise 1-5 score skewed to the median (as industrial data is).

    Each layer's vector is ``(s - 3) w`` (the score direction) plus strong "topic" variation in 4 other directions
    (which an unsupervised PCA with few components latches onto) plus noise; 30% of the samples are *hard*: both
    layers see them with 10x more noise, independently, so the layers disagree more where the errors are larger.
    """
    rng = np.random.default_rng(seed)
    score = rng.choice(np.arange(1, 6), size=n, p=[0.07, 0.18, 0.5, 0.18, 0.07]).astype(float)
    hard = rng.random(n) < 0.3
    w = rng.normal(size=d)
    w /= np.linalg.norm(w)
    topics = np.linalg.qr(rng.normal(size=(d, 4)))[0].T

    def layer():
        noise = np.where(hard, 0.8, 0.08)[:, None]
        return (score - 3)[:, None] * w + rng.normal(size=(n, 4)) * 6.0 @ topics + rng.normal(size=(n, d)) * noise

    return score, hard, {FINAL: layer(), INTER: layer()}


@pytest.fixture(scope="module")
def data():
    y, hard, feats = synthetic()
    train = {k: v[:400] for k, v in feats.items()}
    test = {k: v[400:] for k, v in feats.items()}
    return y[:400], y[400:], train, test, hard[400:]


@pytest.fixture(scope="module")
def fitted(data):
    y_tr, _, train, _, _ = data
    return BorpProbe(final_layer=FINAL, intermediate_layer=INTER).fit(train, y_tr)


def test_probe_far_above_chance_and_a_weak_baseline(data, fitted):
    y_tr, y_te, train, test, _ = data
    pred = fitted.predict(test)
    alpha, r = krippendorff_alpha(y_te, pred.score), pearson(y_te, pred.score)
    assert alpha > 0.75 and r > 0.8, (alpha, r)
    assert pred.score.min() >= 1 and pred.score.max() <= 5
    # n_components was chosen by cross-validation, per head
    assert set(fitted.cv_) == {FINAL, INTER}
    assert fitted.heads_[FINAL].n_components in fitted.cv_[FINAL]["n_components"].values
    # the weak baseline: unsupervised PCA with 2 components keeps the topic directions, not the score
    weak = BorpProbe(final_layer=FINAL, regressor="pca", n_components=2).fit(train, y_tr).predict(test).score
    assert krippendorff_alpha(y_te, weak) < 0.2 and pearson(y_te, weak) < 0.3
    assert alpha > krippendorff_alpha(y_te, weak) + 0.5
    # PLS with the same 2 components finds the score direction (supervised)
    pls2 = BorpProbe(final_layer=FINAL, n_components=2).fit(train, y_tr).predict(test).score
    assert pearson(y_te, pls2) > pearson(y_te, weak) + 0.3


def test_uncertainty_tracks_the_error(data, fitted):
    _, y_te, _, test, hard = data
    pred = fitted.predict(test)
    err = np.abs(pred.score - y_te)
    assert spearman(pred.u, err) > 0.3
    assert pred.u[hard].mean() > 2 * pred.u[~hard].mean()
    np.testing.assert_allclose(pred.u, np.abs(pred.score_final - pred.score_intermediate))
    low, high = pred.bounds(beta=0.5)
    np.testing.assert_allclose(high - low, pred.u)


def test_ablation_switches(data):
    y_tr, _, train, test, _ = data
    one = {FINAL: train[FINAL]}
    full = BorpProbe(final_layer=FINAL, n_components=3).fit(one, y_tr)
    plain = BorpProbe(final_layer=FINAL, n_components=3, extra_features=False).fit(one, y_tr)
    assert full.heads_[FINAL].coef.shape == (48 + 2,) and plain.heads_[FINAL].coef.shape == (48,)
    assert full.estimators_[FINAL].n_features_in_ == 50 and plain.estimators_[FINAL].n_features_in_ == 48
    pca = BorpProbe(final_layer=FINAL, n_components=3, regressor="pca").fit(one, y_tr)
    assert type(full.estimators_[FINAL]).__name__ == "PLSRegression" and full.estimators_[FINAL].scale
    assert [name for name, _ in pca.estimators_[FINAL].steps] == ["standardscaler", "pca", "linearregression"]
    flat = BorpProbe(final_layer=FINAL, n_components=3, resample=False).fit(one, y_tr)
    assert np.array_equal(flat.train_rows_, np.arange(400))
    assert not np.array_equal(np.sort(full.train_rows_), np.arange(400))
    # the linear map a head keeps is the estimator's prediction
    x = design_matrix(test[FINAL], full.heads_[FINAL].centroid)
    np.testing.assert_allclose(full.heads_[FINAL].predict(test[FINAL]), full.estimators_[FINAL].predict(x).ravel(),
                               atol=1e-8)
    no_u = BorpProbe(final_layer=FINAL, n_components=3).fit(train, y_tr).predict(test)
    assert no_u.u is None and no_u.score_intermediate is None


def test_geometric_features_and_design_matrix():
    d = np.array([[3.0, 4.0], [0.0, -1.0]])
    norm, dist = geometric_features(d, centroid=np.array([1.0, 1.0]))
    np.testing.assert_allclose(norm, [5.0, 1.0])
    np.testing.assert_allclose(dist, [2 + 3, 1 + 2])
    np.testing.assert_allclose(design_matrix(d, [1.0, 1.0]), [[3, 4, 5, 5], [0, -1, 1, 3]])


def test_resampling_flattens_the_distance_histogram():
    rng = np.random.default_rng(1)
    dist = np.abs(rng.standard_t(3, size=2000))  # dense centre, long tail
    rows = geometric_resample(dist, n_bins=10, power=0.5, max_upsample=5.0, seed=0)
    assert rows.min() >= 0 and rows.max() < len(dist)
    assert abs(len(rows) - len(dist)) < 0.2 * len(dist)
    centre, tail = np.quantile(dist, 0.5), np.quantile(dist, 0.95)
    assert np.mean(dist[rows] <= centre) < 0.5 - 0.1  # dense centre down-sampled
    assert np.mean(dist[rows] >= tail) > 0.05 + 0.05  # tail up-sampled
    counts = np.bincount(rows, minlength=len(dist))
    assert counts.max() <= 5  # at most ceil(max_upsample) copies of a sample
    np.testing.assert_array_equal(rows, geometric_resample(dist, power=0.5, seed=0))  # seeded
    assert not np.array_equal(rows, geometric_resample(dist, power=0.5, seed=1))
    np.testing.assert_array_equal(np.sort(geometric_resample(dist, power=0.0, seed=3)), np.arange(len(dist)))
    flat = geometric_resample(dist, n_bins=10, power=1.0, max_upsample=1e9, seed=0)
    edges = np.linspace(dist.min(), dist.max(), 11)
    before, after = np.histogram(dist, bins=edges)[0], np.histogram(dist[flat], bins=edges)[0]
    falling = before == np.maximum.accumulate(before[::-1])[::-1]  # bins where the histogram is its own envelope
    assert after[falling & (before > 0)].std() <= 1.0  # power=1: those bins all get the same count


def test_resampling_thins_low_distances_even_where_the_distance_histogram_is_sparse():
    # Distances of many-dimensional difference vectors to their centroid concentrate away from 0 (chi-like): the
    # lowest distances are rare in the histogram, yet they are the samples closest to the centre, which the paper
    # down-samples. Weighting by the inverse histogram up-sampled this lowest decile x1.4-1.7.
    rng = np.random.default_rng(0)
    for dist in (np.sqrt(rng.chisquare(40, size=3000)),                 # chi, 40 dimensions
                 rng.lognormal(mean=1.0, sigma=0.35, size=3000),        # skewed, mode away from 0
                 np.abs(rng.normal(size=(3000, 64))).sum(1)):           # L1 distance of 64-d Gaussian noise
        rows = geometric_resample(dist, n_bins=10, power=0.5, max_upsample=5.0, seed=0)
        copies = np.bincount(rows, minlength=len(dist))
        low, high = dist <= np.quantile(dist, 0.1), dist >= np.quantile(dist, 0.9)
        assert copies[low].mean() < 0.9       # the lowest-distance decile is down-sampled
        assert copies[high].mean() > 1.2      # the far tail is up-sampled
        order = np.argsort(dist)
        per_decile = [copies[chunk].mean() for chunk in np.array_split(order, 10)]
        assert per_decile[-1] == max(per_decile) and per_decile[0] <= np.median(per_decile)


def _siblings_share_their_prompt(n_prompts=60, per_prompt=3, dim=120, seed=0):
    """Responses of one prompt share a prompt vector in their features and a prompt level in their score, and the
    two are unrelated across prompts: nothing generalises to a new prompt, but a sibling gives the answer away."""
    rng = np.random.default_rng(seed)
    groups = np.repeat(np.arange(n_prompts), per_prompt)
    x = rng.normal(size=(n_prompts, dim))[groups] + 0.05 * rng.normal(size=(len(groups), dim))
    y = np.clip(3 + rng.normal(size=n_prompts)[groups] + 0.05 * rng.normal(size=len(groups)), 1, 5)
    return x, y, groups


def test_cross_validation_folds_never_split_a_prompt():
    _, _, groups = _siblings_share_their_prompt()
    splits = cv_splits(len(groups), 5, groups, seed=0)
    assert len(splits) == 5
    for train, test in splits:
        assert not set(groups[train]) & set(groups[test])
    assert sorted(np.concatenate([t for _, t in splits])) == list(range(len(groups)))
    assert len(cv_splits(6, 5, [0, 0, 1, 1, 2, 2])) == 3  # fewer prompts than folds: one fold per prompt
    with pytest.raises(UserError, match=">= 2 distinct prompts"):
        cv_splits(4, 5, [7, 7, 7, 7])


def test_ridge_and_component_search_are_grouped_by_prompt():
    # Ungrouped CV (leave-one-out for the ridge, KFold for PLS) sees the sibling and rewards memorising it: small
    # penalty, many components. Grouped by prompt it sees that nothing carries over to a new prompt.
    x, y, groups = _siblings_share_their_prompt()
    leaky, grouped = MeanPoolRidge().fit(x, y), MeanPoolRidge().fit(x, y, groups=groups)
    assert leaky.alpha_ <= 10 and grouped.alpha_ == max(grouped.alphas)
    probe = dict(final_layer=FINAL, resample=False, component_grid=(1, 2, 4, 8, 16, 32))
    leaky = BorpProbe(**probe).fit({FINAL: x}, y).cv_[FINAL]
    grouped = BorpProbe(**probe).fit({FINAL: x}, y, groups=groups).cv_[FINAL]
    # the leaky search rewards components that memorise siblings (error falls with k, far below the variance);
    # grouped, no k predicts a new prompt (every k's error is about the variance of y)
    assert leaky.cv_mse.iloc[-1] < 0.25 * y.var() and leaky.cv_mse.is_monotonic_decreasing
    assert grouped.cv_mse.min() > 0.9 * y.var()


def test_polarization_index_pushes_extremes_to_both_tails():
    rng = np.random.default_rng(2)
    score = rng.choice(np.arange(1, 6), size=1000, p=[0.07, 0.18, 0.5, 0.18, 0.07])
    w = rng.normal(size=32)
    w /= np.linalg.norm(w)
    # the norm rises with the score (fig. 2a), the distance to the centroid is U-shaped (fig. 2b)
    diff = (2.0 + score)[:, None] * w + rng.normal(size=(1000, 32)) * 0.1
    pi = polarization_index(diff)
    top, bottom = polarized_samples(pi, 50)
    assert (score[top] == 5).mean() > 0.9 and (score[bottom] == 1).mean() > 0.9
    assert pi[top].min() > pi[bottom].max() and len(set(top) & set(bottom)) == 0
    # the sum of z-scores puts the low extreme back in the middle: its bottom tail is not the 1s
    _, bottom_mean = polarized_samples(polarization_index(diff, fusion="mean_z"), 50)
    assert (score[bottom_mean] == 1).mean() < 0.5


def test_save_load_round_trip(tmp_path, data, fitted):
    _, _, _, test, _ = data
    path = fitted.save(tmp_path / "model" / "probe.npz")
    assert [p.name for p in path.parent.iterdir()] == ["probe.npz"]  # atomic: no temporary left behind
    with np.load(path, allow_pickle=False) as npz:  # plain arrays: loading never unpickles
        assert "meta" in npz.files and npz[f"head/{FINAL}/coef"].dtype == np.float64
    loaded = BorpProbe.load(path)
    a, b = fitted.predict(test), loaded.predict(test)
    np.testing.assert_allclose(a.score, b.score, atol=1e-12)
    np.testing.assert_allclose(a.u, b.u, atol=1e-12)
    assert loaded.config() == fitted.config()
    np.testing.assert_allclose(fitted.polarization(test), loaded.polarization(test))
    assert loaded.cv_[FINAL].equals(fitted.cv_[FINAL])
    np.testing.assert_array_equal(loaded.train_rows_, fitted.train_rows_)
    with pytest.raises(UserError, match="not fitted"):
        BorpProbe().save(tmp_path / "x.npz")
    with pytest.raises(UserError, match="no saved BoRP probe"):
        BorpProbe.load(tmp_path / "missing.npz")
    import pickle

    (tmp_path / "old.npz").write_bytes(pickle.dumps({"format": "borp-probe", "version": 1}))
    with pytest.raises(UserError, match="not a saved BoRP probe"):  # a pickle (format 1) is refused, not run
        BorpProbe.load(tmp_path / "old.npz")


def test_ridge_baseline_is_its_linear_map_and_round_trips(tmp_path):
    from sklearn.linear_model import RidgeCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(3)
    x = rng.normal(size=(200, 12)) * rng.uniform(0.1, 10, size=12)
    y = np.clip(3 + x @ rng.normal(size=12) * 0.1 + rng.normal(size=200) * 0.3, 1, 5)
    ridge = MeanPoolRidge().fit(x, y)
    reference = make_pipeline(StandardScaler(), RidgeCV(alphas=list(ridge.alphas))).fit(x, y)
    np.testing.assert_allclose(ridge.predict(x), np.clip(reference.predict(x), 1, 5), atol=1e-9)
    loaded = MeanPoolRidge.load(ridge.save(tmp_path / "ridge.npz"))
    np.testing.assert_allclose(loaded.predict(x), ridge.predict(x), atol=1e-12)
    assert loaded.alpha_ == ridge.alpha_


def test_bad_input_one_line_errors(data):
    y_tr, _, train, _, _ = data
    cases = [
        (lambda: check_layers([15, 41], 40),
         r"probe layer=41 is out of range for a model with 40 layers; allowed 0..40"),
        (lambda: ProbeTemplate(instruction=""), "instruction is empty"),
        (lambda: ProbeTemplate(instruction="Rate it.", answer="It is good"), "neither instruction nor answer contains"),
        (lambda: BorpProbe(regressor="svm"), r"regressor='svm' is invalid; allowed: pls, pca"),
        (lambda: BorpProbe(final_layer=FINAL, n_components=5).fit({FINAL: train[FINAL][:4]}, y_tr[:4]),
         r"too few training samples \(4\) for n_components=5"),
        (lambda: BorpProbe(final_layer=FINAL).fit({FINAL: train[FINAL][:6]}, y_tr[:6]),
         r"too few training samples \(6\) to choose n_components by 5-fold cross-validation"),
        (lambda: BorpProbe(final_layer=FINAL, intermediate_layer=3).fit({FINAL: train[FINAL]}, y_tr),
         r"features lack layer\(s\) \[3\]"),
        (lambda: BorpProbe(final_layer=FINAL, intermediate_layer=FINAL), "needs two different layers"),
        (lambda: polarization_index(train[FINAL], fusion="max"), "allowed: product, mean_z"),
    ]
    for call, message in cases:
        with pytest.raises(UserError, match=message) as err:
            call()
        assert "\n" not in str(err.value)


def test_a_probe_file_read_as_the_ridge_or_the_reverse_is_one_line(tmp_path, fitted):
    rng = np.random.default_rng(0)
    ridge = MeanPoolRidge().fit(rng.normal(size=(30, 4)), rng.uniform(1, 5, size=30))
    probe_file, ridge_file = fitted.save(tmp_path / "probe.npz"), ridge.save(tmp_path / "mean_pool_ridge.npz")
    with pytest.raises(UserError, match=r"probe.npz holds a BoRP probe, not a ridge baseline; read it "
                                        r"with BorpProbe.load") as error:
        MeanPoolRidge.load(probe_file)
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match=r"mean_pool_ridge.npz holds a ridge baseline, not a BoRP probe"):
        BorpProbe.load(ridge_file)
    assert BorpProbe.load(probe_file).layers == fitted.layers  # the right way round still loads


def test_layers_read_the_model_config_once(monkeypatch, deep_backbone):
    import transformers

    from rewarduq_exp.methods.borp_method import BorpMethod

    probe_cfg = OmegaConf.load(ROOT / "conf" / "probe" / "borp_contrastive.yaml")
    encoder = type("Encoder", (), {"backbone": deep_backbone, "probe_cfg": probe_cfg})()
    method = BorpMethod(encoder=encoder, show_progress=False)
    calls = []
    original = transformers.AutoConfig.from_pretrained
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *a, **k: calls.append(a) or original(*a, **k))
    first = method.layers()
    for _ in range(5):
        assert method.layers() == first
        method.probe_layers()
        method.identity(method.probe_layers())
    assert len(calls) == 1 and first[1] is not None


def test_ridge_baseline_on_mean_pooled_features():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(300, 20))
    y = np.clip(np.rint(3 + x[:, 0] + 0.5 * x[:, 1]), 1, 5)
    model = MeanPoolRidge().fit(x[:200], y[:200])
    pred = model.predict(x[200:])
    assert pearson(y[200:], pred) > 0.8 and pred.min() >= 1 and pred.max() <= 5
    with pytest.raises(UserError, match="not fitted"):
        MeanPoolRidge().predict(x)


# ---------------------------------------------------------------------------------------------------- tiny model
CONVS = [
    ([{"role": "user", "content": "What is the capital of France?"}], [{"role": "assistant", "content": "Paris."}]),
    ([{"role": "user", "content": "Write a short poem about the sea."}],
     [{"role": "assistant", "content": "The quick brown fox jumps over the lazy dog. " * 4}]),
    ([{"role": "user", "content": "topic reply"}],
     [{"role": "assistant", "content": "Thank you, that is a good point."}]),
]


@pytest.fixture(scope="module")
def deep_backbone(cache_dir):
    cfg = OmegaConf.load(ROOT / "conf" / "model" / "tiny-qwen3.yaml")
    cfg.build.num_layers = 3
    return Backbone(cfg, cache_dir=cache_dir, device="cpu")


def test_contrastive_extractor_on_the_tiny_model(deep_backbone):
    prompts, responses = zip(*CONVS)
    ex = ContrastiveExtractor.from_backbone(deep_backbone, ProbeTemplate(), layers=[1, -1], batch_size=4)
    feats = ex.extract(prompts, responses)
    assert sorted(feats) == [-1, 1] and feats[1].shape == (3, 256)
    states = ex.states(prompts, responses)
    np.testing.assert_allclose(feats[-1], states[:, 0, 1] - states[:, 1, 1])
    assert np.abs(feats[-1]).max() > 1e-4
    slow = ContrastiveExtractor(deep_backbone.tokenizer, ex.model, ProbeTemplate(), [1, -1], reuse=False)
    np.testing.assert_allclose(slow.extract(prompts, responses)[1], feats[1], atol=1e-4)
    with pytest.raises(UserError, match="out of range for a model with 3 layers"):
        ContrastiveExtractor.from_backbone(deep_backbone, ProbeTemplate(), layers=[15, 40])
    pooled = mean_pooled_features(deep_backbone.tokenizer, ex.model, prompts, responses, layer=2)
    assert pooled.shape == (3, 256)


def test_several_rubrics_share_one_prefix_pass_and_concatenate(deep_backbone):
    """Phase 3 with R rubric templates: 2R suffixes on one prefix pass, vectors side by side in template order."""
    prompts, responses = zip(*CONVS)
    rubrics = [ProbeTemplate(instruction="Rubric A: is the reply on topic? One word."),
               ProbeTemplate(instruction="Rubric B: is the reply polite? One word.", positive="Good", negative="Bad")]
    single = [ContrastiveExtractor.from_backbone(deep_backbone, t, layers=[1, -1], batch_size=12) for t in rubrics]
    both = ContrastiveExtractor(deep_backbone.tokenizer, single[0].model, rubrics, [1, -1], batch_size=12)
    feats = both.extract(prompts, responses)
    alone = [ex.extract(prompts, responses) for ex in single]
    for layer in (1, -1):
        assert feats[layer].shape == (3, 512)
        np.testing.assert_allclose(feats[layer], np.hstack([a[layer] for a in alone]), atol=1e-4)
    # the conversations ran once for both rubrics (one batch of 3 either way): the prefix tokens of one rubric
    assert both.stats["prefix_tokens"] == single[0].stats["prefix_tokens"]
    assert both.stats["suffix_tokens"] > single[0].stats["suffix_tokens"]
    with pytest.raises(UserError, match="at least one template"):
        ContrastiveExtractor(deep_backbone.tokenizer, single[0].model, [], [1, -1])


def test_score_only_judge_on_the_tiny_model(deep_backbone):
    prompts, responses = zip(*CONVS)
    judge = ScoreOnlyJudge.from_backbone(deep_backbone, batch_size=2)
    res = judge.judge(prompts, responses)
    np.testing.assert_allclose(res.probs.sum(1), 1.0, atol=1e-6)
    assert ((res.expected >= 1) & (res.expected <= 5)).all() and set(res.argmax) <= {1, 2, 3, 4, 5}
    assert ((res.mass > 0) & (res.mass <= 1)).all()
    # the reference: the causal LM on the concatenated ids, next-token logits at the end
    tok = deep_backbone.tokenizer
    ids = tok(judge.tokenizer.apply_chat_template(list(prompts[1]) + list(responses[1]), tokenize=False)
              + judge.suffix, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = judge.lm(input_ids=torch.tensor([ids])).logits[0, -1, judge.score_ids]
    np.testing.assert_allclose(res.probs[1], torch.softmax(logits, -1).numpy(), atol=1e-5)
    with pytest.raises(UserError, match="must be one token"):
        ScoreOnlyJudge(tok, judge.lm, scores=("1", "10"))


def _borp_method(backbone, **probe_overrides):
    from rewarduq_exp.methods.borp_method import BorpMethod

    probe_cfg = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "probe" / "borp_contrastive.yaml"), probe_overrides)
    encoder = type("Encoder", (), {"backbone": backbone, "probe_cfg": probe_cfg, "tokenizer": backbone.tokenizer})()
    return BorpMethod(encoder=encoder, show_progress=False)


def test_the_judge_is_asked_the_probes_question_on_the_probes_scale(deep_backbone):
    generic = _borp_method(deep_backbone).judge_instruction()
    assert "How satisfied is the user with the assistant's replies?" in generic  # the probe's own question
    assert "one word" not in generic  # the probe's answer format is not the judge's
    assert "on a scale from 1 (Terrible) to 5 (Excellent). Answer with a single digit" in generic
    rubric = "Verbosity: 5 means far too long for what was asked; 1 means terse."
    refined = _borp_method(deep_backbone, rubrics=[rubric]).judge_instruction()
    assert rubric in refined and "Under this rubric" in refined and "single digit" in refined
    # and that is the text the judge's suffix carries (after the conversation, as a further user turn)
    method = _borp_method(deep_backbone, rubrics=[rubric])
    judge = ScoreOnlyJudge.from_backbone(deep_backbone, method.judge_instruction())
    assert rubric in judge.suffix and "Rate the assistant's performance on a scale from 1" in judge.suffix


def test_the_judge_scores_the_decoded_digit_by_default():
    from rewarduq_exp.methods.score_judge import JudgeResult

    # p(1) = 0.4, p(5) = 0.6: greedy decoding says 5, the expectation 3.4 (which rounds to 3)
    probs = np.array([[0.4, 0.0, 0.0, 0.0, 0.6], [0.0, 0.1, 0.8, 0.1, 0.0]])
    result = JudgeResult(expected=probs @ np.arange(1, 6), argmax=np.arange(1, 6)[probs.argmax(1)].astype(float),
                         probs=probs, mass=np.ones(2))
    np.testing.assert_allclose(result.scores(), [5.0, 3.0])
    np.testing.assert_allclose(result.scores("expected"), [3.4, 3.0])
    with pytest.raises(UserError, match="allowed: digit, expected"):
        result.scores("mode")
    from rewarduq_exp.methods.borp_method import BorpMethod

    assert BorpMethod().judge_scoring == "digit"
    with pytest.raises(UserError, match=r"method.judge_scoring='mean' is invalid: allowed values are digit, expected"):
        BorpMethod(judge_scoring="mean")


DEFAULT_SYSTEM_TEMPLATE = (  # ChatML with a default system prompt when none is given, as SmolLM2's and Qwen2.5's
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}"
    "{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def default_system_model(tmp_path_factory, deep_backbone):
    """The deep tiny model saved with a chat template that adds a default system prompt."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("default-system")
    AutoModelForCausalLM.from_pretrained(deep_backbone.source).save_pretrained(folder)
    tok = deep_backbone.from_pretrained(__import__("transformers").AutoTokenizer, "tokenizer")
    tok.chat_template = DEFAULT_SYSTEM_TEMPLATE
    tok.save_pretrained(folder)
    return folder, tok


def test_templates_with_a_default_system_prompt_are_handled(default_system_model):
    from rewarduq_exp.models import prefix_cache

    _, tok = default_system_model
    # the probe turn is cut after the template's own text: no system prompt in the middle of the conversation
    suffix = prefix_cache.render_suffix(tok, "Judge the assistant in one word.", "It is {polarity}")
    assert suffix.startswith("<|im_start|>user\nJudge the assistant") and "helpful AI" not in suffix
    prompt, response = [{"role": "user", "content": "Hi"}], [{"role": "assistant", "content": "Hello."}]
    kept = prefix_cache.render_prefix(tok, prompt, response)
    dropped = prefix_cache.render_prefix(tok, prompt, response, system_prompt="drop")
    assert kept == "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n" + dropped
    assert dropped == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
    own = [{"role": "system", "content": "Be brief."}, *prompt]  # a conversation's own system turn always stays
    assert prefix_cache.render_prefix(tok, own, response, "drop").startswith("<|im_start|>system\nBe brief.")
    with pytest.raises(UserError, match="default_system_prompt='remove' is invalid; allowed: keep, drop"):
        prefix_cache.render_prefix(tok, prompt, response, system_prompt="remove")


def test_bench_probe_takes_any_local_causal_lm(default_system_model, tmp_path):
    from entry_points import run_entry_point

    folder, _ = default_system_model
    proc = run_entry_point(ROOT / "scripts" / "bench_probe.py",
                           ["--model-path", folder, "--smoke", "--device", "cpu"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"model: {folder.name}, hidden 256, 3 layers" in proc.stdout and "fraction of ideal" in proc.stdout
    proc = run_entry_point(ROOT / "scripts" / "bench_probe.py", ["--model-path", tmp_path / "nowhere", "--smoke"],
                           tmp_path)
    assert proc.returncode != 0 and "is not a folder with a checkpoint" in proc.stderr
