"""``downstream.py task=rl``: policy optimisation against a trained run's reward, measured against the world's gold.

- the KL of a policy to its reference (policy_samples.sequence_kl): both estimates, weighted by the policy's
  probability of each completion, against the exact sequence KL of two tiny float64 causal LMs whose every completion
  of up to 3 tokens is enumerated; KL(p || p) = 0 exactly;
- the gold of a text a policy writes (world_text.WorldText) against the world's own gold of the same words, with and
  without the filler options; unknown words, texts of fillers only, fillers added;
- the reference policy against the world's generator (reference.reference_check), a short SFT (e2e), and an SFT of 0
  steps that keeps the policy as it is;
- the study end to end on the tiny model (files and their sanity), Ctrl-C and resume (e2e), bad settings in one line;
  ``sample`` on the study's reference (the completion mask up to the first EOS, the caller's random state kept); a
  worker's loaded scorer reused only by jobs of the same settings;
- Gao et al.'s RL form (statistics.gao_fit / gao_peak, form="rl") and analysis.at_d by hand;
- VADER in Gao et al.'s gold-model setup (e2e): a tiny proxy run studied against a gold run trained on more pairs, the
  gold of a measurement recomputed from the gold run; a VADER study without task.gold_run, or with a gold run that is
  no VADER run, refused in one line before anything loads.
"""

import gzip
import io
import itertools
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from test_cli import NO_FIGURES, run

from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.downstream.rl.analysis import at_d
from rewarduq_exp.downstream.rl.policy_samples import Samples, sequence_kl
from rewarduq_exp.downstream.rl.reference import CHECK_SEED, reference_check
from rewarduq_exp.downstream.rl.world_text import WorldText
from rewarduq_exp.downstream.statistics import gao_fit, gao_peak

# ------------------------------------------------------------------------------------- the KL, by enumeration

VOCAB, EOS, PAD, MAX_NEW = 6, 5, 0, 3
PROMPTS = [[1, 2, 3], [4, 1]]          # the second is left-padded to the first's width


def tiny_causal_lm(seed: int):
    """A random 1-layer Llama of 6 tokens in float64 (so that two ways of computing a log-probability agree to
    ~1e-15); a wide initialisation, so that the policies are far from uniform and far from each other."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                         initializer_range=0.8, bos_token_id=None, eos_token_id=EOS, pad_token_id=PAD,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).double().eval()


def every_completion() -> list[tuple[int, ...]]:
    """Every completion of at most MAX_NEW tokens: some non-EOS tokens then EOS (which counts), or MAX_NEW
    non-EOS tokens (cut)."""
    words = [t for t in range(VOCAB) if t != EOS]
    out = [(*w, EOS) for k in range(MAX_NEW) for w in itertools.product(words, repeat=k)]
    return out + list(itertools.product(words, repeat=MAX_NEW))


def enumerated_samples() -> tuple[Samples, list[tuple[list[int], tuple[int, ...]]]]:
    """Samples holding every (prompt, completion), as ``sample`` lays them out: left-padded prompts, then the
    completion right-padded, the completion mask up to and including EOS."""
    width = max(len(p) for p in PROMPTS)
    rows, ids, attention, completion_mask = [], [], [], []
    for prompt in PROMPTS:
        for completion in every_completion():
            pad = width - len(prompt)
            tail = MAX_NEW - len(completion)
            ids.append([PAD] * pad + prompt + list(completion) + [PAD] * tail)
            attention.append([0] * pad + [1] * len(prompt) + [1] * len(completion) + [0] * tail)
            completion_mask.append([1] * len(completion) + [0] * tail)
            rows.append((prompt, completion))
    samples = Samples(torch.tensor(ids), torch.tensor(attention), width, torch.tensor(completion_mask),
                      [" ".join(map(str, c)) for _, c in rows])
    return samples, rows


@torch.no_grad()
def log_probs(model, rows) -> np.ndarray:
    """log p(completion | prompt) of every row, computed apart from ``sequence_kl``: per prompt, one forward pass of
    the unpadded prompt and each completion (right-padded: causal attention keeps the padding out of every earlier
    position, and the positions are 0, 1, ... as for a lone sequence)."""
    out = np.empty(len(rows))
    for prompt in PROMPTS:
        index = [i for i, (p, _) in enumerate(rows) if p == prompt]
        completions = [rows[i][1] for i in index]
        ids = torch.tensor([prompt + list(c) + [PAD] * (MAX_NEW - len(c)) for c in completions])
        logp = torch.log_softmax(model(input_ids=ids).logits.double(), dim=-1)[:, len(prompt) - 1:-1]
        token_logp = logp.gather(-1, ids[:, len(prompt):, None])[..., 0]
        mask = torch.tensor([[t < len(c) for t in range(MAX_NEW)] for c in completions])
        out[index] = (token_logp * mask).sum(1).numpy()
    return out


def test_both_kl_estimates_are_unbiased_for_the_exact_kl_of_every_completion():
    policy, reference = tiny_causal_lm(0), tiny_causal_lm(1)
    samples, rows = enumerated_samples()
    assert len(rows) == 2 * (1 + 5 + 25 + 125)
    lp, lq = log_probs(policy, rows), log_probs(reference, rows)
    exact, log_ratio = (x.numpy() for x in sequence_kl(policy, reference, samples))   # 312 rows: 20 chunks of 16
    for i in range(len(PROMPTS)):
        part = slice(i * len(rows) // 2, (i + 1) * len(rows) // 2)
        p = np.exp(lp[part])
        assert p.sum() == pytest.approx(1.0, abs=1e-12)   # the completions are every outcome of the policy
        kl = float(np.sum(p * (lp[part] - lq[part])))
        assert kl > 0.05   # the two policies differ: the checks below are not about a KL of ~0
        # (a) the sum of the exact per-token KLs along each completion, averaged under the policy
        assert float(np.sum(p * exact[part])) == pytest.approx(kl, rel=1e-9, abs=1e-12)
        # (b) the log-ratio: per completion, log p - log q itself (the left padding's positions are right)
        np.testing.assert_allclose(log_ratio[part], lp[part] - lq[part], rtol=1e-9, atol=1e-12)
        assert float(np.sum(p * log_ratio[part])) == pytest.approx(kl, rel=1e-9, abs=1e-12)
        # two different estimates of the same number, not one
        assert np.abs(exact[part] - log_ratio[part]).max() > 1e-3
    # KL(p || p) = 0, exactly, for every completion and both estimates
    same_exact, same_ratio = sequence_kl(policy, policy, samples)
    assert torch.equal(same_exact, torch.zeros(len(rows), dtype=torch.float64))
    assert torch.equal(same_ratio, torch.zeros(len(rows), dtype=torch.float64))


# ------------------------------------------------------------------------------------- the gold of a text

FILLER_OPTIONS = {"off": {}, "on": {"candidate_filler_share": 1.0, "filler_bias": 1}}


@pytest.mark.parametrize("options", FILLER_OPTIONS.values(), ids=FILLER_OPTIONS.keys())
def test_the_gold_of_a_text_is_the_worlds_gold_of_its_words(options):
    world = SyntheticWorld(seed=3, n_train=50, **options)
    text = WorldText(world)
    c = world.candidates("eval", 16, 32, seed=5)
    texts = [t for group in c.texts for t in group]
    topics = np.repeat(c.topic, 32)
    np.testing.assert_allclose(text.gold(topics, texts), c.gold.ravel(), rtol=0, atol=1e-12)
    if options:
        assert c.features["filler"].max() >= 4   # stuffed candidates are among them: the filler is left out
    # an unknown word counts as a word of utility 0
    chosen = [i for i in range(world.vocab_size) if i != world.filler_word][:3]
    words = [world.words[i] for i in chosen]
    topic = np.array([2])
    known = world.true_reward(topic, np.array([chosen]), np.array([3]))[0]
    assert text.gold(topic, [" ".join(words)])[0] == pytest.approx(known, abs=1e-12)
    assert text.gold(topic, [" ".join([*words, "xyzzy"])])[0] == pytest.approx(known * 3 / 4, abs=1e-12)
    assert text.gold(topic, ["xyzzy"])[0] == 0.0 and text.gold(topic, [""])[0] == 0.0
    filler = world.words[world.filler_word]
    if options:
        assert text.gold(topic, [f"{filler} {filler} {filler}"])[0] == 0.0
        stuffed = [" ".join(w + f" {filler}" * (i % 3) for i, w in enumerate(t.split())) for t in texts]
        assert stuffed != texts
        np.testing.assert_allclose(text.gold(topics, stuffed), text.gold(topics, texts), rtol=0, atol=1e-12)
    else:   # without the options the filler is a word like any other
        assert text.gold(topic, [f"{filler} {filler}"])[0] != 0.0


# ------------------------------------------------------------------------------------- the reference policy

def generator_draws(world, n: int, seed: int) -> tuple[list[str], np.ndarray]:
    per_topic = n // world.num_topics
    c = world.candidates("eval", world.num_topics, per_topic, seed=seed)
    return [t for group in c.texts for t in group], np.repeat(c.topic, per_topic)


def test_reference_check_finds_the_generator_alike_and_a_different_text_set_apart():
    world = SyntheticWorld(seed=0, n_train=200, candidate_filler_share=1.0, filler_bias=1)
    text = WorldText(world)
    train_max = world.training_feature_max()
    # the check's own draws: the same texts, KS 0 for every statistic
    texts, topics = generator_draws(world, 512, CHECK_SEED)
    same = reference_check(world, text, texts, topics, train_max).set_index("statistic")
    assert list(same.index) == ["gold", "words", "filler"]
    assert (same.ks == 0).all() and (same.reference_mean == same.generator_mean).all()
    # other draws of the generator: the same distribution (KS below the 1 % critical value at 2000 vs 2000, ~0.05)
    texts, topics = generator_draws(world, 2000, 7)
    other = reference_check(world, text, texts, topics, train_max).set_index("statistic")
    assert (other.ks < 0.05).all() and (other.ks > 0).all(), other
    assert (other.n_reference == 2000).all() and (other.n_generator == 2000).all()
    for name in ("words", "filler"):
        assert other.loc[name, "reference_beyond_train"] == pytest.approx(other.loc[name, "generator_beyond_train"],
                                                                          abs=0.02)
    # completions of 3 words (the generator writes 8 to 12): the words' KS is 1
    rng = np.random.default_rng(0)
    short = [" ".join(rng.choice(world.words, 3)) for _ in range(512)]
    apart = reference_check(world, text, short, np.arange(512) % world.num_topics, train_max).set_index("statistic")
    assert apart.loc["words", "ks"] == 1.0 and apart.loc["words", "ks_p"] < 1e-10
    assert apart.loc["words", "reference_mean"] == 3.0


@pytest.mark.e2e
def test_a_short_sft_imitates_the_generator(tiny_backbone, tmp_path):
    """40 steps of SFT of the tiny Qwen3 on the generator's candidates: its samples are near the generator's. The
    tolerances are loose on purpose, as a 40-step imitation is rough (measured: 9.1 words against 10.1, gold 0.04
    against 0.65, its fragments of words run together being unknown words of utility 0): 1.5 words, 1.0 gold (half
    its sd of about 2), a KS statistic of the gold below 0.2, fillers within 0.3 per completion, under 20 % unknown
    words. The untrained model fails them (measured: gold KS 0.47, gold sd 0.4 against 2.0, 0.01 fillers against
    0.74, 94 % unknown words), so the check still tells a working SFT from none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rewarduq_exp.downstream.rl.policy_samples import sample
    from rewarduq_exp.downstream.rl.reference import train_reference

    world = SyntheticWorld(seed=0, n_train=200)
    text = WorldText(world)
    sft = {"examples": 1280, "steps": 40, "batch_size": 32, "lr": 0.003, "seed": 0}
    topics = np.arange(384) % world.num_topics
    prompts = [world.prompt(int(t)) for t in topics]

    def statistics(folder) -> tuple[pd.DataFrame, float]:
        policy = AutoModelForCausalLM.from_pretrained(folder).eval()
        found = sample(policy, AutoTokenizer.from_pretrained(folder), prompts, 24, seed=1)
        tokens, lengths = text.tokens(found.texts)
        unknown = ((tokens == text.unknown) & (np.arange(tokens.shape[1]) < lengths[:, None])).sum() / lengths.sum()
        check = reference_check(world, text, found.texts, topics, {"words": 12, "filler": 12})
        return check.set_index("statistic"), float(unknown)

    folder = train_reference(world, tiny_backbone.source, tmp_path / "reference", sft, "cpu", False)
    assert (folder / "config.json").is_file() and not (folder / "trainer").exists()
    check, unknown = statistics(folder)
    gap = (check.reference_mean - check.generator_mean).abs()
    assert gap["words"] < 1.5 and gap["gold"] < 1.0 and gap["filler"] < 0.3, check.to_string()
    assert check.loc["gold", "ks"] < 0.2 and unknown < 0.2, (check.to_string(), unknown)
    untrained, unknown = statistics(tiny_backbone.source)
    gap = (untrained.reference_mean - untrained.generator_mean).abs()
    assert gap["filler"] > 0.5 and untrained.loc["gold", "ks"] > 0.3 and unknown > 0.8, (untrained.to_string(), unknown)
    # a folder already there is kept as it is (a resumed study reuses its reference)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert train_reference(world, tiny_backbone.source, folder, sft, "cpu", False) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_sft_of_zero_steps_keeps_the_policy_as_it_is(tiny_backbone, tmp_path):
    """task.sft.steps=0 (allowed): the reference is the policy itself. A Trainer given max_steps=0 trains one step."""
    from safetensors.torch import load_file

    from rewarduq_exp.downstream.rl.reference import train_reference

    world = SyntheticWorld(seed=0, n_train=50)
    sft = {"examples": 16, "steps": 0, "batch_size": 8, "lr": 0.003, "seed": 0}
    folder = train_reference(world, tiny_backbone.source, tmp_path / "reference", sft, "cpu", False)
    before = load_file(Path(tiny_backbone.source) / "model.safetensors")
    after = load_file(folder / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert (folder / "tokenizer.json").is_file() and not (folder / "trainer").exists()


# ------------------------------------------------------------------------------------- statistics by hand

def test_gao_rl_form_recovers_alpha_beta_and_its_peak():
    d = np.array([0.0, 0.1, 0.3, 0.6, 1.0, 1.5, 2.5, 4.0])
    alpha, beta = 0.7, 0.4
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = np.where(d > 0, d * (alpha - beta * np.log(d)), 0.0)
    fit_alpha, fit_beta = gao_fit(d, gain, form="rl")
    assert fit_alpha == pytest.approx(alpha, abs=1e-10) and fit_beta == pytest.approx(beta, abs=1e-10)
    d_peak, peak = gao_peak(fit_alpha, fit_beta, form="rl")
    assert d_peak == pytest.approx(np.exp(alpha / beta - 1), rel=1e-9)
    assert peak == pytest.approx(beta * np.exp(alpha / beta - 1), rel=1e-9)
    # the peak is the curve's maximum: d (alpha - beta log d) there equals beta d*
    assert d_peak * (alpha - beta * np.log(d_peak)) == pytest.approx(peak, rel=1e-12)
    assert gao_peak(0.5, -0.1, form="rl")[0] == np.inf   # never turns down
    # rows at once, and the best-of-n form unchanged (the default)
    rows = np.stack([gain, 2 * gain])
    a, b = gao_fit(d, rows, form="rl")
    np.testing.assert_allclose(a, [alpha, 2 * alpha], atol=1e-10)
    np.testing.assert_allclose(b, [beta, 2 * beta], atol=1e-10)
    bon = d * (2.0 - 0.8 * d)
    assert gao_fit(d, bon) == pytest.approx((2.0, 0.8), abs=1e-10)
    assert gao_fit(d, bon, form="best_of_n") == pytest.approx((2.0, 0.8), abs=1e-10)
    assert gao_peak(2.0, 0.8) == pytest.approx((2.0 / 1.6, 4.0 / 3.2))
    assert gao_fit(d, bon, form="rl") != pytest.approx((2.0, 0.8), abs=1e-3)   # the forms differ
    with pytest.raises(ValueError, match="form"):
        gao_fit(d, bon, form="ppo")


def test_at_d_interpolates_each_seeds_values_along_its_own_d():
    # 1 seed, 2 slots, 4 steps; d climbs 0 -> 0.5, stays (a flat span), then 1.0
    cube = np.array([[[0.0, 2.0, 3.0, 6.0], [1.0, -1.0, 5.0, 3.0]]])
    d = np.array([[0.0, 0.5, 0.5, 1.0]])
    np.testing.assert_allclose(at_d(cube, d, 0.25), [[1.0, 0.0]])        # halfway between steps 0 and 1
    np.testing.assert_allclose(at_d(cube, d, 0.75), [[4.5, 4.0]])        # halfway between steps 2 and 3
    np.testing.assert_allclose(at_d(cube, d, 0.5), [[2.0, -1.0]])        # the first step that reaches it
    np.testing.assert_allclose(at_d(cube, d, 0.6), [[3.0 + 0.2 * 3.0, 5.0 - 0.2 * 2.0]])
    np.testing.assert_allclose(at_d(cube, d, 0.0), [[0.0, 1.0]])         # at the start
    np.testing.assert_allclose(at_d(cube, d, 2.0), [[6.0, 3.0]])         # beyond the curve: its last value
    # a second seed with a curve of its own
    two = np.concatenate([cube, cube + 10])
    d2 = np.array([[0.0, 0.5, 0.5, 1.0], [0.0, 0.25, 1.0, 2.0]])
    np.testing.assert_allclose(at_d(two, d2, 0.5), [[2.0, -1.0], [10 + 2 + 1 / 3, 9 + 6 / 3 * 1]])


# ------------------------------------------------------------------------------------- the study end to end

SMALL_RUN = ["method=ens_mlp", "dataset.n_train=300", "dataset.n_eval=60", "dataset.n_ood=40", "progress=false",
             *NO_FIGURES]
# 14 RL runs of 2 steps (the conservative k chosen on seed 9 from 0 and 1; mean, k, kl and filter on 3 seeds), 16
# measured samples of at most 8 tokens at steps 0, 1 and 2, a reference of 2 SFT steps
TINY_RL = ["task=rl", "task.steps=2", "task.eval_every=1", "task.seeds=[0,1,2]", "task.select_seeds=[9]",
           "task.sft.steps=2", "task.sft.examples=64", "task.check_samples=16", "task.eval_samples=16",
           "task.k_grid=[0,1]", "task.lambda_grid=[1]", "task.kl_coefs=[0.1]", "task.draws=200",
           "task.objectives=[mean,conservative,kl,filter]", "task.max_tokens=8"]
TABLES = ("summary.csv", "comparisons.csv", "curves.csv", "over_worlds.csv", "choices.csv", "reference_check.csv")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, shared_cache) -> tuple[Path, Path]:
    """(working directory, an ENS-MLP run folder on a small synthetic world)."""
    cwd = tmp_path_factory.mktemp("rl")
    folder = cwd / "outputs" / "runs" / "ens_mlp"
    run("train.py", [*SMALL_RUN, f"hydra.run.dir={folder}"], cwd, shared_cache)
    return cwd, folder


def downstream(cwd: Path, cache: Path, out: Path, *args, check: bool = True):
    return run("downstream.py", ["progress=false", f"hydra.run.dir={out}", *args], cwd, cache, check=check)


@pytest.fixture(scope="module")
def study(trained_run, shared_cache):
    """``downstream.py task=rl`` with TINY_RL on the run, never stopped: (its CompletedProcess, its folder)."""
    cwd, run_dir = trained_run
    out = cwd / "outputs" / "rl_study"
    before = cache_shards(shared_cache)
    proc = downstream(cwd, shared_cache, out, f"run={run_dir}", *TINY_RL)
    proc.cache_shards_added = cache_shards(shared_cache) - before
    return proc, out


def cache_shards(cache: Path) -> set[Path]:
    return {*cache.glob("features/rows/*/shard-*"), *cache.glob("features/conversations/*/facts-*")}


def read_gz(path: Path) -> pd.DataFrame:
    return pd.read_csv(io.BytesIO(gzip.decompress(path.read_bytes())))


def test_rl_end_to_end_on_the_tiny_model(study):
    proc, out = study
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "completed" and status["task"] == "rl" and status["rl_runs"] == 14, status
    for name in (*TABLES, "samples.csv.gz"):
        assert (out / name).is_file(), name
    for name in ("rl_gold_vs_kl.png", "rl_proxy_vs_gold.png", "rl_feature.png"):
        assert (out / name).stat().st_size > 10_000, name
    assert "reference policy against the generator" in proc.stdout and f"tables and figures in {out}" in proc.stdout
    # the policy's samples are scored in memory: the run's feature cache gains no file per scoring call
    assert proc.cache_shards_added == set()

    # the coefficient: k of the conservative objective chosen on seed 9, the highest final gold (smallest on a tie)
    choices = pd.read_csv(out / "choices.csv")
    assert sorted(choices.coef) == [0.0, 1.0] and set(choices.objective) == {"conservative"}
    assert choices.chosen.sum() == 1
    k = float(choices[choices.chosen].coef.iloc[0])
    assert k == choices[choices.final_gold >= choices.final_gold.max() - 1e-12].coef.min()
    labels = {"mean", "filter", "kl@0.1", f"conservative@{k:g}"}

    samples = read_gz(out / "samples.csv.gz")
    report = samples[samples.role == "report"]
    assert set(samples[samples.role == "select"].rl_seed) == {9} and set(report.rl_seed) == {0, 1, 2}
    assert set(samples.step) == {0, 1, 2} and set(samples.slot) == set(range(16))
    assert (samples.tokens <= 8).all() and (samples.words <= samples.tokens).all()
    # step 0 is the reference itself: KL 0 exactly, and every objective's slots hold the same completions (the
    # sampling seed is the RL seed's and the step's only), so the same gold per slot
    start = samples[samples.step == 0]
    assert (start.kl == 0).all() and (start.kl_log_ratio == 0).all()
    for seed, group in start.groupby("rl_seed"):
        gold = group.assign(label=group.objective + "@" + group.coef.astype(str)).pivot(
            index="slot", columns="label", values="gold")
        assert gold.shape[1] == (2 if seed == 9 else 4)
        assert (gold.nunique(axis=1) == 1).all(), gold
    by_seed = start[start.objective == "mean"].pivot(index="slot", columns="rl_seed", values="gold")
    assert not np.allclose(by_seed[0], by_seed[1])   # other seeds, other samples
    assert (samples.kl >= -1e-12).all()   # sums of exact per-token KLs
    assert samples[samples.step == 2].kl.mean() > 0   # the policies moved

    curves = pd.read_csv(out / "curves.csv")
    assert set(curves[curves.role == "report"].objective_label) == labels
    assert len(curves) == len(samples.groupby(["objective", "coef", "role", "rl_seed", "step"]))
    np.testing.assert_allclose(curves.d, np.sqrt(curves.kl.clip(lower=0)))
    assert (curves[curves.step == 0].kl == 0).all()

    summary = pd.read_csv(out / "summary.csv")
    assert set(summary.objective_label) == labels and len(summary) == 4
    assert (summary.seeds == 3).all() and (summary.slots == 16).all() and (summary.steps == 2).all()
    assert {"gain_final_lo", "gain_final_hi", "largest_drop", "largest_drop_lo"} <= set(summary.columns)
    assert (summary.gain_final_lo <= summary.gain_final).all() and (summary.gain_final <= summary.gain_final_hi).all()
    np.testing.assert_allclose(summary.gain_final, summary.gold_final - summary.gold_start, atol=1e-12)
    assert summary.gold_start.nunique() == 1   # the same reference samples for every objective

    comparisons = pd.read_csv(out / "comparisons.csv")
    assert set(comparisons["at"]) == {"final", "matched_d"}
    pairs = set(zip(comparisons.objective, comparisons.baseline))
    conservative = f"conservative@{k:g}"
    assert pairs == {("kl@0.1", "mean"), ("filter", "mean"), (conservative, "mean"), ("filter", "kl@0.1"),
                     (conservative, "kl@0.1")}
    assert (comparisons.groupby(["objective", "baseline"]).at.nunique() == 2).all()
    matched = comparisons[comparisons["at"] == "matched_d"]
    assert (matched.d_a == matched.d_b).all()

    over = pd.read_csv(out / "over_worlds.csv")
    assert (over.worlds == 1).all() and {"summary", "comparisons"} == set(over.table)
    check = pd.read_csv(out / "reference_check.csv")
    assert list(check.statistic) == ["gold", "words", "filler"] and (check.n_reference == 16).all()


def test_a_loaded_scorer_is_reused_only_by_jobs_of_the_same_settings(study, trained_run, shared_cache):
    """A process keeps the last run's scorer for the next job; a job of other settings (another study in the same
    process: the tests run downstream.py in theirs) must not get it."""
    from dataclasses import replace

    from rewarduq_exp.downstream.rl import jobs

    _, out = study
    _, run_dir = trained_run
    (reference,) = (out / "reference").iterdir()
    job = jobs.Job(str(run_dir), "ens_mlp", (), str(reference), str(reference / "pool.csv"), "mean", 0.0, 0,
                   "report", (), "cpu", str(shared_cache), None, True, 10)
    scorer, _ = jobs._scorer(job)
    assert scorer.calibration is not None and scorer.knn == 10 and scorer.pool
    assert jobs._scorer(replace(job, seed=1, objective="kl", coef=0.1))[0] is scorer   # same run and settings
    raw, _ = jobs._scorer(replace(job, recalibrated=False))
    assert raw.calibration is None
    assert jobs._scorer(replace(job, knn=3))[0].knn == 3
    assert jobs._scorer(job)[0].calibration is not None


def test_samples_end_at_their_first_eos_and_leave_the_callers_random_state(study):
    """``sample`` on the study's reference (2 SFT steps: it ends most completions within 12 tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rewarduq_exp.downstream.rl.policy_samples import sample

    _, out = study
    (reference,) = (out / "reference").iterdir()
    model = AutoModelForCausalLM.from_pretrained(reference).eval()
    tokenizer = AutoTokenizer.from_pretrained(reference)
    world = SyntheticWorld(seed=0, n_train=50)
    prompts = [world.prompt(t % world.num_topics) for t in range(24)]
    state = torch.random.get_rng_state()
    found = sample(model, tokenizer, prompts, 12, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)   # a trainer's random stream goes on as before
    again = sample(model, tokenizer, prompts, 12, seed=3)
    assert torch.equal(found.input_ids, again.input_ids) and found.texts == again.texts
    assert not torch.equal(sample(model, tokenizer, prompts, 12, seed=4).input_ids, found.input_ids)
    completion = found.input_ids[:, found.prompt_width:]
    ended = 0
    for row, mask, text in zip(completion, found.completion_mask, found.texts):
        ends = (row == tokenizer.eos_token_id).nonzero()
        n = int(ends[0, 0]) + 1 if len(ends) else len(row)
        ended += bool(len(ends))
        assert mask.tolist() == [1] * n + [0] * (len(row) - n)
        assert text == tokenizer.decode(row[:n], skip_special_tokens=True).strip()
    assert 0 < ended < len(prompts)   # both kinds: ended by EOS and cut at 12 tokens
    assert torch.equal(found.attention_mask[:, found.prompt_width:], found.completion_mask)
    exact, log_ratio = sequence_kl(model, model, found)
    assert (exact == 0).all() and (log_ratio == 0).all()


# ------------------------------------------------------------------------------------- bad settings

BAD_SETTINGS = [
    (["task.algorithm=ppo"], "task.algorithm='ppo' is invalid; allowed: grpo, rloo"),
    (["task.objectives=[mean,foo]"], "task.objectives=['mean', 'foo'] is invalid: must be a non-empty list of mean"),
    (["task.steps=0"], "task.steps=0 is invalid: must be an integer >= 1"),
    (["task.generations=1"], "task.generations=1 is invalid: must be an integer >= 2"),
    (["task.eval_every=50", "task.steps=10"], "task.eval_every=50 is invalid: must be at most task.steps (10)"),
    (["task.seeds=[0]", "task.select_seeds=[0]"], "task.select_seeds=[0] and task.seeds=[0] share a seed"),
    (["task.kl_coefs=[0]"], "task.kl_coefs=[0] is invalid for the kl objective"),
    (["task.learning_rate=0"], "task.learning_rate=0 is invalid: must be a number in (0, 1]"),
    (["task.policy=nonexistent"], "task.policy='nonexistent' is invalid; allowed: null (the run's model) or"),
    (["task.k_grid=[-1]"], "task.k_grid=[-1] is invalid: must be a non-empty list of finite numbers >= 0"),
    # the bootstrap's seed is read last, the SFT's after the policy loads: both refused on the command line
    (["task.seed=-1"], "task.seed=-1 is invalid: must be an integer in [0, 4294967295]"),
    (["task.sft.seed=abc"], "task.sft.seed=abc is invalid: must be an integer in [0, 4294967295]"),
]


@pytest.mark.parametrize("args, message", BAD_SETTINGS, ids=[" ".join(a) for a, _ in BAD_SETTINGS])
def test_a_bad_setting_is_one_line_before_anything_loads(trained_run, shared_cache, tmp_path, args, message):
    cwd, run_dir = trained_run
    out = tmp_path / "rl"
    proc = downstream(cwd, shared_cache, out, f"run={run_dir}", *TINY_RL, *args, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert message in lines[0], lines[0]
    # refused before the study began: no status, no reference policy, no RL run
    assert not (out / "status.json").exists() and not (out / "reference").exists() and not (out / "rl_runs").exists()


# ------------------------------------------------------------------------------------- Ctrl-C and resume

@pytest.mark.e2e
def test_ctrl_c_then_the_same_command_gives_the_numbers_of_a_study_never_stopped(study, trained_run, shared_cache):
    from test_interrupts import finished, start_in_child, wait_for

    _, never_stopped = study
    cwd, run_dir = trained_run
    out = cwd / "outputs" / "rl_stopped"
    args = ["progress=false", f"hydra.run.dir={out}", f"paths.output_root={cwd / 'outputs'}",
            f"paths.cache_dir={shared_cache}", f"run={run_dir}", *TINY_RL]
    proc, results = start_in_child("downstream.py", args, cwd)
    wait_for(lambda: list((out / "rl_runs").glob("*.csv.gz")), timeout=300, what="the first RL run")
    os.kill(proc.pid, signal.SIGINT)
    done = finished(proc, results)
    assert done.returncode == 130, done.stderr[-2000:]
    assert done.stderr.splitlines() == [f"interrupted (SIGINT): the rl task stopped; the RL runs it finished are kept "
                                        f"in {out}/rl_runs: the same command with hydra.run.dir={out} resumes"]
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "interrupted", status
    kept = sorted(p.name for p in (out / "rl_runs").glob("*.csv.gz"))
    assert 1 <= len(kept) < len(list((never_stopped / "rl_runs").glob("*.csv.gz")))
    assert not (out / "summary.csv").exists()
    stamps = {name: (out / "rl_runs" / name).stat().st_mtime_ns for name in kept}
    time.sleep(0.01)

    downstream(cwd, shared_cache, out, f"run={run_dir}", *TINY_RL)
    assert json.loads((out / "status.json").read_text())["state"] == "completed"
    # the runs it had finished were read, not run again
    assert {name: (out / "rl_runs" / name).stat().st_mtime_ns for name in kept} == stamps
    # (a job's file is named by its settings, the folder's reference among them: other names in another folder)
    assert len(list((out / "rl_runs").glob("*.csv.gz"))) == len(list((never_stopped / "rl_runs").glob("*.csv.gz")))
    for name in TABLES:
        if name == "reference_check.csv":   # its seconds column is a wall-clock time
            a, b = (pd.read_csv(folder / name).drop(columns="seconds") for folder in (out, never_stopped))
            pd.testing.assert_frame_equal(a, b, check_exact=True)
        else:
            assert (out / name).read_bytes() == (never_stopped / name).read_bytes(), name


# ------------------------------------------------------------------------------------- VADER: a gold run's reward

# Two tiny-model ENS-MLP runs on the local VADER archive (tests/test_vader_ratings.py, never downloaded) with the same
# splits: the proxy on 6 pairs, the gold on every pair of the train split (Gao et al.'s gold-model setup)
VADER_RUN = ["method=ens_mlp", "dataset=vader_pairs", "dataset.min_gap=0.5", "dataset.eval_fraction=0.4", *NO_FIGURES]
# 8 RL runs of 2 steps: the conservative k chosen on seed 9 from 0 and 1; mean, k and filter on 2 seeds
TINY_VADER_RL = [*(a for a in TINY_RL if not a.startswith(("task.objectives=", "task.seeds="))),
                 "task.objectives=[mean,conservative,filter]", "task.seeds=[0,1]"]


@pytest.fixture(scope="module")
def vader_sdist(tmp_path_factory) -> Path:
    from test_vader_ratings import larger_sdist

    from rewarduq_exp.data import vader_ratings

    return larger_sdist(tmp_path_factory.mktemp("vader_sdist") / vader_ratings.SDIST)


def vader_run(tmp_path_factory, shared_cache, sdist: Path, name: str, *args) -> Path:
    from test_vader_ratings import train_run

    folder, _ = train_run(tmp_path_factory.mktemp(name), shared_cache, [*VADER_RUN, f"dataset.path={sdist}", *args])
    return folder


@pytest.fixture(scope="module")
def vader_proxy(tmp_path_factory, shared_cache, vader_sdist) -> Path:
    return vader_run(tmp_path_factory, shared_cache, vader_sdist, "vader_proxy", "dataset.n_train=6")


@pytest.fixture(scope="module")
def vader_gold(tmp_path_factory, shared_cache, vader_sdist) -> Path:
    return vader_run(tmp_path_factory, shared_cache, vader_sdist, "vader_gold", "dataset.n_train=null")


@pytest.mark.e2e
def test_rl_on_a_vader_run_measures_the_gold_runs_reward(vader_proxy, vader_gold, shared_cache, tmp_path):
    """``task=rl run=<proxy> task.gold_run=<gold>`` end to end: the gold of a measurement is the gold run's reward of
    the same text under its own prompt for the slot's corpus, recomputed here apart from the task; the reference
    check has the length in words and no filler (VADER has none)."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rewarduq_exp import load_run
    from rewarduq_exp.data.vader_ratings import pair_prompt
    from rewarduq_exp.downstream.rl.policy_samples import sample

    out = tmp_path / "rl_vader"
    proc = downstream(tmp_path, shared_cache, out, f"run={vader_proxy}", f"task.gold_run={vader_gold}", *TINY_VADER_RL)
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "completed" and status["rl_runs"] == 8, status
    for name in (*TABLES, "samples.csv.gz"):
        assert (out / name).is_file(), name
    assert f"tables and figures in {out}" in proc.stdout

    corpora = list(OmegaConf.load(vader_proxy / ".hydra" / "config.yaml").dataset.corpora)
    gold_model = load_run(vader_gold, device="cpu", cache_dir=shared_cache, progress=False)

    def gold_of(topics, texts) -> np.ndarray:
        """The gold run's reward, each text under the user turn it was trained with for the topic's corpus."""
        prompts = [pair_prompt(corpora[int(t)]) for t in topics]
        return gold_model.score(prompts, [[{"role": "assistant", "content": t}] for t in texts]).reward.to_numpy()

    # the reference's samples (the pool, its texts kept): the check's gold mean is the gold run's
    (reference,) = (out / "reference").iterdir()
    pool = pd.read_csv(reference / "pool.csv")
    pool_gold = gold_of(pool.topic, pool.text.fillna("").tolist())
    check = pd.read_csv(out / "reference_check.csv")
    assert list(check.statistic) == ["gold", "words"] and (check.n_reference == 16).all(), check
    gold_row = check.set_index("statistic").loc["gold"]
    assert gold_row.reference_mean == pytest.approx(pool_gold.mean(), abs=1e-5)
    assert gold_row.reference_sd == pytest.approx(pool_gold.std(ddof=1), abs=1e-5)
    words = check.set_index("statistic").loc["words"]   # the length against the proxy's longest training text
    assert 0 <= words.reference_beyond_train <= 1 and 0 <= words.generator_beyond_train <= 1, check

    # one measurement: step 0 of the mean objective on RL seed 0 is the reference's completions of the slots' prompts
    # under the evaluation's seed (training.evaluate_policy), drawn again here; their gold is the gold run's reward
    samples = read_gz(out / "samples.csv.gz")
    assert set(samples.step) == {0, 1, 2} and set(samples.slot) == set(range(16)) and (samples.filler == 0).all()
    row = samples[(samples.step == 0) & (samples.rl_seed == 0) & (samples.objective == "mean")].sort_values("slot")
    assert len(row) == 16 and (row.topic.to_numpy() == np.arange(16) % len(corpora)).all()
    model = AutoModelForCausalLM.from_pretrained(reference).eval()
    tokenizer = AutoTokenizer.from_pretrained(reference)
    found = sample(model, tokenizer, [pair_prompt(corpora[int(t)]) for t in row.topic], 8, seed=1_000_003 * 1 + 0)
    assert row.words.tolist() == [len(t.split()) for t in found.texts]   # the same completions
    np.testing.assert_allclose(row.gold.to_numpy(), gold_of(row.topic, found.texts), rtol=1e-5, atol=1e-5)
    assert not np.allclose(row.gold.to_numpy(), row.reward.to_numpy())   # the gold is not the proxy's reward

    summary = pd.read_csv(out / "summary.csv")
    choices = pd.read_csv(out / "choices.csv")
    k = float(choices[choices.chosen].coef.iloc[0])
    assert set(summary.objective_label) == {"mean", "filter", f"conservative@{k:g}"}
    assert (summary.seeds == 2).all() and summary.gold_final.notna().all()
    comparisons = pd.read_csv(out / "comparisons.csv")
    assert not comparisons.empty and set(comparisons.baseline) == {"mean"}


def test_rl_on_a_vader_run_without_a_gold_run_is_one_line_before_anything_loads(vader_proxy, shared_cache, tmp_path):
    out = tmp_path / "rl"
    proc = downstream(tmp_path, shared_cache, out, f"run={vader_proxy}", *TINY_VADER_RL, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "task.gold_run=" in lines[0], proc.stderr[-2000:]
    assert not (out / "status.json").exists() and not (out / "reference").exists() and not (out / "rl_runs").exists()


@pytest.mark.parametrize("gold", ["synthetic", "missing"])
def test_a_gold_run_that_is_not_a_vader_run_is_one_line(vader_proxy, trained_run, shared_cache, tmp_path, gold):
    _, synthetic = trained_run
    gold_run = synthetic if gold == "synthetic" else tmp_path / "no_such_run"
    message = (f"task.gold_run={gold_run} was not trained on VADER ratings" if gold == "synthetic"
               else f"task.gold_run: run={gold_run} is not a run folder")
    out = tmp_path / "rl"
    proc = downstream(tmp_path, shared_cache, out, f"run={vader_proxy}", f"task.gold_run={gold_run}", *TINY_VADER_RL,
                      check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr[-2000:]
    assert not (out / "status.json").exists() and not (out / "reference").exists()
