"""The five label-ranking learners: Kendall tau of the modal ranking on iris and wine (5-fold CV, as the paper),
against loose bounds around the reference values (notes section 4: PL .81/.86, MM .10/.23, RC .83/.90, PL-RPC
.74/.54 on iris/wine); determinism given the seed; and the pieces that can be checked exactly on synthetic data
(Mallows MLE, the Bradley-Terry conversion, temperature scaling, RPC's single-class pairs, RC's unseen mass)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sklearn.model_selection import KFold

from rewarduq_exp.methods.label_ranking import (
    LEARNERS,
    MallowsLearner,
    PlackettLuceNet,
    PLRPCLearner,
    RankClassifierNet,
    RPCLearner,
    bradley_terry_log_weights,
    fit_temperature,
)
from rewarduq_exp.ranking.categorical import RankCategorical
from rewarduq_exp.ranking.mallows import Mallows, expected_distance
from rewarduq_exp.ranking.pairwise import PairwiseOnly
from rewarduq_exp.ranking.permutations import all_orderings, kendall_distance, orderings_to_ranks
from rewarduq_exp.ranking.plackett_luce import PlackettLuce

DATA_DIR = Path(__file__).parent / "fixtures" / "label_ranking"


def kendall_tau(pred: np.ndarray, true: np.ndarray) -> float:
    """Mean per-sample tau_a between two (n, m) rank arrays (ties would count as discordant; there are none)."""
    dp = np.sign(pred[:, :, None] - pred[:, None, :])
    dt = np.sign(true[:, :, None] - true[:, None, :])
    m = pred.shape[1]
    return float(((dp * dt).sum(axis=(1, 2)) / (m * (m - 1))).mean())


def test_kendall_tau_helper():
    r = np.array([[1, 2, 3, 4]])
    assert kendall_tau(r, r) == 1.0 and kendall_tau(r, r[:, ::-1]) == -1.0
    assert kendall_tau(r, np.array([[2, 1, 3, 4]])) == pytest.approx(4 / 6)


@pytest.fixture(scope="module", params=["iris", "wine"])
def cv_taus(request):
    if not (DATA_DIR / f"{request.param}.csv").is_file():
        pytest.skip(f"{DATA_DIR} is not available")
    from rewarduq_exp.data.label_ranking import load_label_ranking

    data = load_label_ranking(request.param, DATA_DIR)
    taus = {name: [] for name in LEARNERS}
    folds = KFold(5, shuffle=True, random_state=42).split(data.X)
    for fold, (train, test) in enumerate(folds):
        x_train, x_test = data.fold(train, test)
        rpc = RPCLearner(seed=fold).fit(x_train, data.ranks[train])
        for name, cls in LEARNERS.items():
            if name == "pl_rpc":  # the same trees as RPC: reuse the fitted pairs instead of fitting them again
                learner = PLRPCLearner()
                learner.__dict__.update({k: v for k, v in rpc.__dict__.items() if k in ("m", "pairs", "models")})
            elif name == "rpc":
                learner = rpc
            else:
                learner = cls(seed=fold).fit(x_train, data.ranks[train])
            dist = learner.predict_distribution(x_test)
            assert dist.n == len(test) and dist.m == data.m
            taus[name].append(kendall_tau(dist.mode_ranks(), data.ranks[test]))
    return request.param, {k: float(np.mean(v)) for k, v in taus.items()}


def test_learner_kendall_tau_in_reference_range(cv_taus):
    name, tau = cv_taus
    print(name, {k: round(v, 3) for k, v in tau.items()})
    assert tau["plackett_luce"] > 0.6, tau
    assert tau["rank_classifier"] > 0.6, tau
    assert tau["rpc"] > 0.6, tau
    assert tau["pl_rpc"] > 0.35, tau
    assert tau["mallows"] < 0.45, tau  # unconditional: one ranking for everybody
    for conditional in ("plackett_luce", "rank_classifier", "rpc", "pl_rpc"):
        assert tau["mallows"] < tau[conditional], tau


def _toy(n=90, m=4, seed=0):
    """Features that shift PL weights linearly, and rankings sampled from that PL model."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3))
    lw = X @ rng.normal(size=(3, m)) * 2
    orderings = PlackettLuce(lw).sample(rng, 1)[:, 0]
    return X, orderings_to_ranks(orderings)


@pytest.mark.parametrize("name", sorted(LEARNERS))
def test_learners_are_deterministic_given_the_seed(name):
    X, ranks = _toy()
    kwargs = {"num_epochs": 3} if name in ("plackett_luce", "rank_classifier") else {}
    a = LEARNERS[name](seed=7, **kwargs).fit(X, ranks).predict_distribution(X[:20])
    b = LEARNERS[name](seed=7, **kwargs).fit(X, ranks).predict_distribution(X[:20])
    np.testing.assert_array_equal(a.pairwise(), b.pairwise())
    np.testing.assert_array_equal(a.mode_ranks(), b.mode_ranks())


def test_learner_output_types():
    X, ranks = _toy()
    types = {"plackett_luce": PlackettLuce, "mallows": Mallows, "rank_classifier": RankCategorical,
             "rpc": PairwiseOnly, "pl_rpc": PlackettLuce}
    for name, cls in LEARNERS.items():
        kwargs = {"num_epochs": 1} if name in ("plackett_luce", "rank_classifier") else {}
        dist = cls(seed=0, **kwargs).fit(X, ranks).predict_distribution(X[:5])
        assert isinstance(dist, types[name]) and (dist.n, dist.m) == (5, 4)
    with pytest.raises(RuntimeError, match="not fitted"):
        PlackettLuceNet().predict_distribution(X)


def test_plackett_luce_net_learns_a_pl_model():
    X, ranks = _toy(n=600, seed=1)
    net = PlackettLuceNet(hidden=(32,), num_epochs=30, learning_rate=3e-3, log_every=8).fit(X[:500], ranks[:500])
    assert net.history[-1]["loss"] < net.history[0]["loss"] and net.history[-1]["step"] == 30 * 8
    assert kendall_tau(net.predict_ranks(X[500:]), ranks[500:]) > 0.5


# ---------------------------------------------------------------------------------------------------- Mallows
def test_mallows_learner_recovers_center_and_theta():
    center, theta = np.array([4, 1, 5, 0, 2, 3]), 0.7
    orderings = Mallows(center, theta).sample(np.random.default_rng(0), 4000)
    ranks = orderings_to_ranks(orderings)
    learner = MallowsLearner(seed=0).fit(np.zeros((len(ranks), 1)), ranks)
    np.testing.assert_array_equal(learner.center, center)
    assert abs(learner.theta - theta) < 0.05
    d = learner.mean_distance_
    assert expected_distance(learner.theta, 6) == pytest.approx(d, rel=1e-9)


def test_mallows_learner_local_search_moves_from_the_mean_rank_start():
    """Mean ranks can disagree with the Kemeny center: here 'a' has the best mean rank, yet most rankings put 'b'
    before 'a' and 'b' before 'c'; the search must end at the minimum total distance of all 3! centers."""
    orderings = np.array([[1, 2, 0]] * 4 + [[0, 1, 2]] * 3 + [[2, 0, 1]] * 2)
    ranks = orderings_to_ranks(orderings)
    learner = MallowsLearner().fit(np.zeros((9, 1)), ranks)
    cands = all_orderings(3)
    totals = kendall_distance(orderings[None, :, :], cands[:, None, :]).sum(axis=1)
    assert totals[(cands == learner.center).all(1)][0] == totals.min()


def test_mallows_theta_edges():
    assert MallowsLearner.mle_theta(0.0, 5) == 50.0
    assert MallowsLearner.mle_theta(5.0, 5) == 0.0  # uniform: E[d] = m(m-1)/4 = 5
    theta = MallowsLearner.mle_theta(2.0, 5)
    orderings = all_orderings(5)
    d = kendall_distance(orderings, orderings[:1])
    p = np.exp(-theta * d)
    assert (p * d).sum() / p.sum() == pytest.approx(2.0, rel=1e-9)  # E_theta[d] = 2 by enumeration


# ---------------------------------------------------------------------------------------------------- RPC, PL-RPC
def test_bradley_terry_weights_recover_the_weights_of_a_bradley_terry_matrix():
    s = np.array([0.2, 0.5, 0.3])
    P = s[:, None] / (s[:, None] + s[None, :])
    np.fill_diagonal(P, 0)
    w = np.exp(bradley_terry_log_weights(P[None]))[0]
    np.testing.assert_allclose(w, s, atol=1e-6)


def test_rpc_handles_single_class_pairs():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 2))
    rest = np.array([rng.permutation(3) + 2 for _ in range(40)])  # ranks 2..4 of items 1, 2, 3
    swap = rest[:, 0] > rest[:, 2]
    rest[swap, 0], rest[swap, 2] = rest[swap, 2], rest[swap, 0]  # item 1 before item 3 ...
    rest[0] = [4, 3, 2]  # ... except in one row: pair (1, 3) has fewer than cv = 2 rows of one class
    ranks = np.concatenate([np.ones((40, 1), dtype=int), rest], axis=1)  # item 0 always first: single class
    rpc = RPCLearner(eps=1e-4, seed=0).fit(X, ranks)
    P = rpc.predict_pairwise(X[:5])
    np.testing.assert_allclose(P[:, 0, 1:], 1 - 1e-4)
    np.testing.assert_allclose(P[:, 1, 3], np.clip(39 / 40, 1e-4, 1 - 1e-4))
    np.testing.assert_array_equal(rpc.predict_ranks(X[:5])[:, 0], 1)


# ---------------------------------------------------------------------------------------------------- RankClassifier
def test_fit_temperature_recovers_a_known_temperature():
    rng = np.random.default_rng(0)
    true = rng.normal(scale=1.5, size=(4000, 6))
    p = np.exp(true) / np.exp(true).sum(1, keepdims=True)
    labels = (p.cumsum(1) > rng.random((4000, 1))).argmax(1)
    assert fit_temperature(3.0 * true, labels) == pytest.approx(3.0, rel=0.1)


def test_rank_classifier_unseen_mass_and_classes_from_training_only():
    X, ranks = _toy(n=60)
    rc = RankClassifierNet(num_epochs=2, seed=0).fit(X[:40], ranks[:40])
    classes, counts = np.unique(ranks[:40], axis=0, return_counts=True)
    assert len(rc.classes) == len(classes)
    assert rc.unseen_mass_ == pytest.approx((np.sum(counts == 1) + 1) / 41)
    dist = rc.predict_distribution(X[40:])
    np.testing.assert_allclose(dist.unseen_mass, rc.unseen_mass_)
    assert rc.temperature != 1.0  # fitted on the held-out 20 %
    fixed = RankClassifierNet(num_epochs=2, calibrate=False, unseen_mass=0.05, seed=0).fit(X[:40], ranks[:40])
    assert fixed.temperature == 1.0 and fixed.predict_distribution(X[:3]).unseen_mass[0] == pytest.approx(0.05)
    from rewarduq_exp.core.errors import UserError

    with pytest.raises(UserError, match="method.unseen_mass=1.5"):
        RankClassifierNet(unseen_mass=1.5)
    with pytest.raises(UserError, match="method.hidden"):
        RankClassifierNet(hidden=[])
    with pytest.raises(UserError, match="method.learning_rate"):
        PlackettLuceNet(learning_rate=0)
    with pytest.raises(UserError, match="method.num_epochs"):
        PlackettLuceNet(num_epochs=2.5)


# ---------------------------------------------------------------------------------------------------- persistence
@pytest.mark.parametrize("name", sorted(LEARNERS))
def test_learners_save_and_load_without_pickle(name, tmp_path):
    """The method contract of every learner: fit returns the learner, save writes method.json + safetensors (+ skops
    for RPC's trees), load_method rebuilds an equal learner from the folder alone; no file unpickles on load."""
    from rewarduq_exp.methods.base import load_method

    X, ranks = _toy()
    kwargs = {"num_epochs": 2} if name in ("plackett_luce", "rank_classifier") else {}
    fitted = LEARNERS[name](seed=3, **kwargs)
    assert fitted.fit(X, ranks) is fitted and fitted.fit_summary["train_rows"] == len(X)
    fitted.save(tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"method.json", "state.safetensors"} | ({"pairs.skops"} if "rpc" in name else set())
    loaded = load_method(tmp_path)
    assert type(loaded) is type(fitted) and loaded.hyperparameters() == fitted.hyperparameters()
    a, b = fitted.predict_distribution(X[:10]), loaded.predict_distribution(X[:10])
    np.testing.assert_array_equal(a.pairwise(), b.pairwise())
    np.testing.assert_array_equal(a.mode_ranks(), b.mode_ranks())


def test_rpc_refuses_a_model_file_with_other_types(tmp_path):
    """A pairs.skops file that names any type beyond the calibrated trees is refused with one line, before loading."""
    import skops.io

    from rewarduq_exp.core.errors import UserError
    from rewarduq_exp.methods.base import load_method

    X, ranks = _toy()
    RPCLearner(seed=0).fit(X, ranks).save(tmp_path)
    (tmp_path / "pairs.skops").write_bytes(skops.io.dumps([KFold(3)]))
    with pytest.raises(UserError, match="types an RPC model never has.*KFold"):
        load_method(tmp_path)



@pytest.mark.parametrize("name", ["plackett_luce", "rank_classifier"])
def test_networks_fit_on_one_thread_by_default_with_the_numbers_of_more(name):
    """One intra-op thread is the default (small networks; extra threads spin on a busy machine), and it changes no
    number: the same fit on two threads gives the same distributions."""
    X, ranks = _toy()
    one = LEARNERS[name](seed=3, num_epochs=3)
    assert one.num_threads == 1
    two = LEARNERS[name](seed=3, num_epochs=3, num_threads=2)
    a, b = one.fit(X, ranks).predict_distribution(X[:20]), two.fit(X, ranks).predict_distribution(X[:20])
    np.testing.assert_array_equal(a.pairwise(), b.pairwise())
