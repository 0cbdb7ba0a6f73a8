"""Calibration and accuracy of probabilistic label ranking ("Calibrated Preference Learning: The Case of Label
Ranking", section 4, appendices D and E), as numpy functions of marginals and true rankings.

Conventions (as in :mod:`rewarduq_exp.ranking.permutations`): ``true_ranks`` is an int array (n, m) of ranks per
item, 1 = best, 0-based item ids; an *event* is an ordered k-tuple of distinct items (E, k). Predicted probabilities
enter through a *marginals* callable ``tuples (E, k) -> (n, E)`` (e.g. ``RankingDistribution.sub_k`` or ``.top_k``),
so the metric functions never see a model; :func:`ranking_evaluation` / :func:`ranking_metrics` wire a
:class:`~rewarduq_exp.ranking.distribution.RankingDistribution` to them and return the flat ``rank/...`` dict.

The modules, one concept each:

- ``events``: the argument checks, which events are evaluated and their labels, and the order of events;
- ``binary_ece``: the binned ECE of many binary problems at once, and the ways to combine per-event ECEs;
- ``rankwise``: rank-wise sub-k / top-k ECE (Definitions 6 and 7);
- ``kernel``: the Dirichlet-kernel estimator of canonical calibration error;
- ``full_rank``: full-rank sub-k / top-k calibration (Definitions 4 and 5), kernel or simplex binning;
- ``restrict``: appendix E's label-dependent restriction to the most frequent rankings;
- ``accuracy``: Kendall tau, footrule and top-1 accuracy of the modal ranking;
- ``evaluation``: every metric of one distribution, the flat ``rank/...`` dict.

Everything is importable from here. Submodules import each other, never this file.

The metrics
-----------
* **Rank-wise sub-k / top-k ECE** (Definitions 6 and 7): one binary calibration problem per event, label 1 where the
  true ranking contains the event (sub-k: a1 > ... > ak with the other items anywhere; top-k: positions 1..k are
  a1..ak), probability = the predicted marginal of the event. Each problem's ECE is the binned estimator of
  :func:`binary_ece`; the total is the plain mean over events (``aggregate="uniform"``, the paper's and the
  reference's default) or a prevalence / predicted-mass weighted mean.
* **Full-rank sub-k / top-k calibration** (Definitions 4 and 5): one multiclass problem per unordered k-subset
  (classes = the k! orderings of the subset; mean over subsets) or a single problem over the top-k prefixes,
  scored with the Dirichlet-kernel estimator of Popordanoska et al. (2022) that appendix E uses
  (:func:`dirichlet_kernel_ece`).
* **Accuracy of the modal ranking**: Kendall tau, Spearman footrule, top-1 accuracy.

Reward models scored on K-wise data (appendix D) are calibrated in :mod:`rewarduq_exp.metrics.kwise`.

Which events are evaluated (appendix E)
---------------------------------------
``events="auto"`` (default) enumerates every event (all P(m,k) ordered k-tuples, all k! classes per subset, all
P(m,k) prefixes) when m < 8, and otherwise restricts to the events *observed in the test labels* (the paper's
restriction to observed rankings; P(8,k) already reaches 40320 at k = 7 and m! grows beyond reach). The rule is
"m >= 8" for every dataset: the reference code restricts by a hard-coded dataset list whose entry "pendigit" never
matches "pendigits", so there pendigits (m = 10) would enumerate 10! rankings; here pendigits (m = 10), yeast
(10), vowel (11), movies and libras (15) and letter (26) are all restricted. ``events="all"`` / ``"observed"``
force either behaviour.

Differences from the reference code, whose metric definitions are otherwise reproduced:

* marginals come from the distribution itself (closed forms or full enumeration), so they are properly normalised;
  the reference sums the probabilities of a restricted candidate list of rankings, which loses the mass outside it;
* in restricted full-rank problems the classes are the observed sub-orderings / prefixes **plus one "other" class**
  holding the remaining predicted mass, so every predicted vector stays on the probability simplex (the reference
  drops that mass);
* events and classes are always in lexicographic order. The reference's order is the same for m < 8 (it
  enumerates them with ``itertools.permutations``); from m = 8 on it iterates a Python set of the observed ones.
  The order matters only where ``aggregate="most_confident"`` meets tied masses and for simplex binning of a
  restricted problem (e.g. 0.2000 here against 0.2308 there for one m = 8 case; "Order of events and classes" in
  :mod:`~rewarduq_exp.metrics.ranking.events`).

The reference's further options are available for comparison with its tables (issue 26): the discrepancies
``log_ratio`` / ``rel_p`` / ``rel_q`` (:func:`binary_ece`), the ``most_confident`` weighting (:func:`aggregate_ece`;
here for sub-k too, where the reference raises), simplex binning as full-rank estimator (:func:`simplex_binning_ece`,
2 or 3 classes only) and the label-dependent restriction to the most frequent test rankings
(:func:`restrict_to_frequent_rankings`, ``restrict="prob_mass_95"`` / ``"top_10"``), which removes predicted mass
exactly as the reference does (no renormalisation, no "other" class).
"""

from rewarduq_exp.metrics.ranking.accuracy import (
    footrule_samples,
    kendall_tau_samples,
    max_footrule,
    ranking_accuracy,
    top1_correct,
)
from rewarduq_exp.metrics.ranking.binary_ece import (
    AGGREGATES,
    BIN_DECIMALS,
    DISCREPANCIES,
    DISCREPANCY_EPS,
    MOST_CONFIDENT_EVENTS,
    SPACINGS,
    BinaryECE,
    aggregate_ece,
    bin_edges,
    bin_index,
    binary_ece,
)
from rewarduq_exp.metrics.ranking.evaluation import (
    DEFAULT_KERNEL_MAX_SAMPLES,
    DEFAULT_MAX_K,
    DEFAULT_MAX_SUBSETS,
    FULL_RANKING_MAX_EVENTS,
    RankingEvaluation,
    default_top_ks,
    ranking_evaluation,
    ranking_metrics,
)
from rewarduq_exp.metrics.ranking.events import (
    EVENT_MODES,
    MAX_EXACT_EVENTS,
    RESTRICT_FROM_M,
    Marginals,
    all_prefixes,
    check_k,
    check_true_ranks,
    event_labels,
    observed_prefixes,
    observed_sub_orderings,
    sample_subsets,
    sub_k_events,
    top_k_events,
)
from rewarduq_exp.metrics.ranking.events import _all_subsets as _all_subsets  # private; scripts/bench_ranking.py
from rewarduq_exp.metrics.ranking.full_rank import (
    FULL_RANK_ESTIMATORS,
    SIMPLEX_BINS,
    BinningUndefined,
    FullRankECE,
    FullRankProblem,
    full_rank_sub_k_ece,
    full_rank_top_k_ece,
    simplex_binning_ece,
    simplex_bins,
    sub_k_full_rank_problems,
    top_k_full_rank_problem,
)
from rewarduq_exp.metrics.ranking.kernel import _ONEHOT_MAX_CLASSES as _ONEHOT_MAX_CLASSES  # private; tests use it
from rewarduq_exp.metrics.ranking.kernel import (
    KERNEL_DENOM_EPS,
    KERNEL_LOG_FLOOR,
    check_kernel_args,
    dirichlet_kernel_ece,
    dirichlet_kernel_errors,
)
from rewarduq_exp.metrics.ranking.rankwise import RankwiseECE, rankwise_ece, rankwise_sub_k_ece, rankwise_top_k_ece
from rewarduq_exp.metrics.ranking.restrict import (
    PROB_MASS_SHARE,
    RESTRICTIONS,
    TOP_RANKINGS,
    RestrictedRankings,
    frequent_rankings,
    restrict_to_frequent_rankings,
)

__all__ = [
    "AGGREGATES", "BIN_DECIMALS", "DEFAULT_KERNEL_MAX_SAMPLES", "DEFAULT_MAX_K", "DEFAULT_MAX_SUBSETS",
    "DISCREPANCIES", "DISCREPANCY_EPS", "EVENT_MODES", "FULL_RANKING_MAX_EVENTS", "FULL_RANK_ESTIMATORS",
    "KERNEL_DENOM_EPS", "KERNEL_LOG_FLOOR", "MAX_EXACT_EVENTS", "MOST_CONFIDENT_EVENTS", "PROB_MASS_SHARE",
    "RESTRICTIONS", "RESTRICT_FROM_M", "SIMPLEX_BINS", "SPACINGS", "TOP_RANKINGS",
    "BinaryECE", "BinningUndefined", "FullRankECE", "FullRankProblem", "Marginals", "RankingEvaluation",
    "RankwiseECE", "RestrictedRankings",
    "aggregate_ece", "all_prefixes", "bin_edges", "bin_index", "binary_ece", "check_k", "check_kernel_args",
    "check_true_ranks", "default_top_ks", "dirichlet_kernel_ece", "dirichlet_kernel_errors", "event_labels",
    "footrule_samples", "frequent_rankings", "full_rank_sub_k_ece", "full_rank_top_k_ece", "kendall_tau_samples",
    "max_footrule", "observed_prefixes", "observed_sub_orderings", "ranking_accuracy", "ranking_evaluation",
    "ranking_metrics", "rankwise_ece", "rankwise_sub_k_ece", "rankwise_top_k_ece", "restrict_to_frequent_rankings",
    "sample_subsets", "simplex_binning_ece", "simplex_bins", "sub_k_events", "sub_k_full_rank_problems",
    "top1_correct", "top_k_events", "top_k_full_rank_problem",
]
