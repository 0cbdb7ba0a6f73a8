"""Downstream uses of uncertainty, measured against the synthetic world's true reward: best-of-n overoptimization
(:mod:`.best_of_n`, :mod:`.best_of_n_task`) and uncertainty-guided active learning (:mod:`.active_learning`)."""
