"""The five label-ranking learners of the calibrated-label-ranking paper (section 3, appendix C), as methods.

Every learner keeps the method contract (:class:`~rewarduq_exp.methods.base.LabelRankingMethod`): it is built with
its hyperparameters and ``seed``, ``fit(X, ranks) -> self`` (X (n, d) float features, ranks (n, m) ranks-per-item with
1 = best), ``predict_distribution(X) -> RankingDistribution`` (``predict_ranks(X)`` is its mode), and
``save(dir)`` / ``load(dir)`` in formats that never execute code on load. Fitting is deterministic given the seed
(torch initialisation and minibatch order, scikit-learn ``random_state``, the calibration split).

* ``PlackettLuceNet`` (PL): MLP d -> hidden -> m item log-weights, PL negative log-likelihood, Adam.
* ``MallowsLearner`` (MM): unconditional Mallows/Kendall model; center by best-improvement local search over swaps of
  two positions, started from the mean-rank ordering; theta by the maximum-likelihood equation given the center.
* ``RankClassifierNet`` (RC): MLP over the distinct training rankings plus a uniform remainder for the unseen
  rankings (see the class docstring for the unseen mass), optional temperature scaling on a held-out 20 %.
* ``RPCLearner`` (RPC): one Platt-calibrated decision tree per item pair; a pairwise-only distribution, Borda mode.
* ``PLRPCLearner`` (PL-RPC): RPC, then per-sample Plackett-Luce weights from the pairwise matrix: the Bradley-Terry
  maximum-likelihood weights (Newton's method), or the reference code's 100 improved-Zermelo steps (Newman 2023).

The two networks train with the one training loop of every method (:func:`~rewarduq_exp.methods.base.run_training`):
Adam (AdamW with no weight decay is the same update; a weight decay > 0 is AdamW's decoupled one), a constant
learning rate, no gradient clipping, one seeded permutation of the rows per epoch.

Modules, one concept each (every name below is importable from this package, as before it became one):

* :mod:`.nets`: PL and RC (the MLP learners);
* :mod:`.mallows`: MM;
* :mod:`.rpc`: RPC;
* :mod:`.pl_rpc`: PL-RPC and the pairwise-to-Plackett-Luce aggregations;
* :mod:`.temperature`: temperature scaling, RC's own and the post-hoc recalibration of any learner's distribution
  (:func:`fit_distribution_temperature`) that the label-ranking run fits on a calibration share of each fold.
"""

from __future__ import annotations

from rewarduq_exp.methods.label_ranking.mallows import MallowsLearner
from rewarduq_exp.methods.label_ranking.nets import PlackettLuceNet, RankClassifierNet, plackett_luce_nll
from rewarduq_exp.methods.label_ranking.pl_rpc import (
    PL_RPC_AGGREGATIONS,
    ZERMELO_REFERENCE_SEED,
    PLRPCLearner,
    bradley_terry_log_likelihood,
    bradley_terry_log_weights,
    zermelo_reference_log_weights,
)
from rewarduq_exp.methods.label_ranking.rpc import RPC_MODELS_FILE, RPC_TRUSTED_TYPES, RPCLearner
from rewarduq_exp.methods.label_ranking.temperature import (
    TEMPERATURE_BOUNDS,
    TemperatureFit,
    fit_distribution_temperature,
    fit_temperature,
)

LEARNERS = {cls.name: cls for cls in (PlackettLuceNet, MallowsLearner, RankClassifierNet, RPCLearner, PLRPCLearner)}

# The learners' public path: a saved learner's method.json records "<module>.<class>", which the method registry maps
# back to a method, and run folders saved before this module became a package name this path.
for _learner in LEARNERS.values():
    _learner.__module__ = __name__
del _learner

__all__ = [
    "LEARNERS", "PL_RPC_AGGREGATIONS", "RPC_MODELS_FILE", "RPC_TRUSTED_TYPES", "TEMPERATURE_BOUNDS",
    "ZERMELO_REFERENCE_SEED", "MallowsLearner", "PLRPCLearner", "PlackettLuceNet", "RPCLearner", "RankClassifierNet",
    "TemperatureFit", "bradley_terry_log_likelihood", "bradley_terry_log_weights", "fit_distribution_temperature",
    "fit_temperature", "plackett_luce_nll", "zermelo_reference_log_weights",
]
