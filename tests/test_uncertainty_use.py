"""The fair use of u in best-of-n (k on held-out prompts, one unit for every method, two rivals) and the cells of the
overoptimization table (one world each, never pooled across worlds)."""

import numpy as np
import pandas as pd
import pytest

from rewarduq_exp.downstream.best_of_n import kl_best_of_n, picked_per_prompt, powers_of_two
from rewarduq_exp.downstream.overoptimization import overoptimization_table, paired_statistics
from rewarduq_exp.downstream.uncertainty_use import (
    choose_k,
    knn_distance,
    prompt_split,
    standardised_u,
    use_curves,
)

NS = powers_of_two(64)
KL = kl_best_of_n(NS)
GRID = [0.0, 0.25, 0.5, 1.0, 2.0]


def _world(prompts=24, m=64, seed=0):
    """A proxy that loves a shortcut: 1 candidate in 8 is 'stuffed', the proxy adds 3 to it, its gold is no
    better. The informative u is high exactly on the stuffed ones; the noise u is unrelated."""
    rng = np.random.default_rng(seed)
    gold = rng.normal(size=(prompts, m))
    stuffed = rng.random((prompts, m)) < 0.125
    reward = gold + rng.normal(0, 0.5, size=gold.shape) + 3.0 * stuffed
    informative = 0.2 + stuffed + rng.normal(0, 0.05, size=gold.shape)
    return reward, gold, stuffed, informative, rng.random(gold.shape)


def test_standardised_u_gives_every_method_the_same_unit():
    reward, gold, _, u, _ = _world()
    picks = [use_curves(reward, c * u, gold, None, NS, KL, GRID, 0.5, 0)["model"] for c in (1e-3, 1.0, 237.0)]
    np.testing.assert_allclose(picks[0], picks[1])
    np.testing.assert_allclose(picks[1], picks[2])
    assert np.allclose(standardised_u(reward, np.full_like(u, 233.0)), 0.0)  # a flat u cannot rank anything


def test_prompt_split_is_a_partition():
    select, report = prompt_split(10, 0.5, seed=3)
    assert len(select) == 5 and len(report) == 5
    assert sorted(np.concatenate([select, report]).tolist()) == list(range(10))
    assert len(prompt_split(2, 0.99, 0)[1]) == 1 and len(prompt_split(2, 0.01, 0)[0]) == 1
    with pytest.raises(ValueError):
        prompt_split(1, 0.5, 0)


def test_k_is_chosen_on_the_selection_prompts_and_zero_for_a_flat_u():
    reward, gold, _, u, _ = _world()
    select, _ = prompt_split(len(gold), 0.5, 0)
    weights = np.full(len(NS), 1 / len(NS))
    k, scores = choose_k(reward, standardised_u(reward, u), gold, select, NS, weights, GRID)
    assert k > 0 and scores[GRID.index(k)] == scores.max()
    k_flat, scores_flat = choose_k(reward, np.zeros_like(u), gold, select, NS, weights, GRID)
    assert k_flat == 0.0 and np.ptp(scores_flat) == 0  # a tie: the smallest k, u earns no weight


def test_an_informative_u_and_the_filter_beat_the_mean_and_a_noise_u_does_not():
    reward, gold, stuffed, informative, noise = _world(prompts=40, m=64, seed=1)
    good = use_curves(reward, informative, gold, stuffed, NS, KL, GRID, 0.5, 0, knn_u=noise)
    stats = paired_statistics([{("mean", 0.0): good["mean"], ("conservative", 1.0): good["mean"],
                                ("optimistic", 1.0): good["mean"], "use": good}], KL, NS, 1.0, 500, 0)
    assert stats["model_vs_mean_lo"] > 0 and stats["filter_vs_mean_lo"] > 0
    assert stats["knn_vs_mean_lo"] <= 0 <= stats["knn_vs_mean_hi"] or good["k_knn"] == 0
    assert stats["report_prompts"] == 20
    # the filter ranks every candidate beyond the range last: with few enough beyond, the best of all never is one
    filtered = reward - stuffed * 100.0
    np.testing.assert_allclose(good["filter"][:, -1], gold[good["report_prompts"]][
        np.arange(20), np.argmax(filtered[good["report_prompts"]], axis=1)])


def test_knn_distance_by_hand():
    train = np.array([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 2.0]])
    candidates = np.array([[1.0, 1.0], [10.0, 10.0]])
    z_train = (train - train.mean(0)) / train.std(0)
    z_cand = (candidates - train.mean(0)) / train.std(0)
    expected = np.sort(np.linalg.norm(z_cand[:, None] - z_train[None], axis=2), axis=1)[:, :2].mean(1)
    np.testing.assert_allclose(knn_distance(train, candidates, 2), expected)
    assert knn_distance(train, candidates, 2)[1] > knn_distance(train, candidates, 2)[0]


def test_runs_of_two_worlds_are_never_pooled():
    rng = np.random.default_rng(0)
    per_prompt, rows = {}, []
    for world in (0, 7):
        for seed in (0, 1):
            label = f"ens_mlp/world={world},seed={seed}"
            reward, gold = rng.normal(size=(8, 64)), rng.normal(size=(8, 64)) + world
            picks = {key: g for key, (g, _) in picked_per_prompt(reward, rng.random((8, 64)), gold, [1.0], NS).items()}
            per_prompt[(label, "eval")] = picks
            rows.append({"run": label, "method": "ens_mlp", "split": "eval", "world": world, "seed": seed,
                         "filler_bias": 1.0, "gold_best": gold.max(), "gold_nmax": 0.0, "best_n": 64})
    table = overoptimization_table(pd.DataFrame(rows), per_prompt, "filler_bias", KL, NS, 1.0, 300, 0)
    assert table.world.tolist() == [0, 7] and table.runs.tolist() == [2, 2]
    # the world-7 cell's level is its own: about 7 above world 0's (gold was shifted by the world)
    assert table.gold_best.iloc[1] - table.gold_best.iloc[0] > 5
    assert (table.largest_drop_lo <= table.largest_drop).all() and (table.largest_drop <= table.largest_drop_hi).all()
