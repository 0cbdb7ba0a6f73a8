"""Label ranking (the calibrated-label-ranking paper): permutations, ranking distributions and their marginals.

Layer: depends only on numpy/scipy and ``rewarduq_exp.core.errors``. Learners (``rewarduq_exp.methods.label_ranking``)
produce distributions; ranking metrics (``rewarduq_exp.metrics.ranking``) consume marginals and true ranks only.
"""
