"""Laplace posteriors: one class per structure of the posterior precision behind one API, in the manner of
laplace-torch (Daxberger et al. 2021, "Laplace Redux"), written for the Bradley-Terry reward models here.

A posterior is N(theta*, P^-1) over trained weights theta*, P = G + lambda I, G the curvature of the negative
log-likelihood at theta* (the Gauss-Newton of the Bradley-Terry likelihood), lambda the precision of the zero-mean
prior N(0, I / lambda). Every structure (:class:`LaplacePosterior`) offers

* **fit**: the curvature from the training data (:meth:`FullPosterior.fit` / :meth:`FullPosterior.accumulate` from
  rows and their Hessian weights; :meth:`KronPosterior.from_factors` from the K-FAC factors that
  :mod:`rewarduq_exp.methods.lora.kfac` accumulates over a network's Linear layers);
* **the prior precision**: :meth:`~LaplacePosterior.set_prior_precision`, or
  :meth:`~LaplacePosterior.optimise_prior_precision`, the lambda that maximises the Laplace evidence with theta* held
  fixed (post hoc; found exactly from G's spectrum, :mod:`~rewarduq_exp.methods.posteriors.evidence`), and
  :meth:`~LaplacePosterior.apply_prior_precision`, which does what a ``prior_precision`` setting says;
* **the evidence**: :meth:`~LaplacePosterior.log_evidence` and :meth:`~LaplacePosterior.effective_parameters`;
* **the linearised predictive**: the variance J P^-1 J^T of a reward whose Jacobian in the weights is J
  (:meth:`FullPosterior.predictive_variance` of rows, for a model linear in its weights;
  :meth:`KronPosterior.predictive_variance` of per-layer Jacobians);
* **saving**: ``tensors()`` (safetensors, the prior precision with them), ``expected(...)`` (the shapes a loader
  accepts) and ``from_tensors(...)``.

Structures: :class:`FullPosterior` (a d x d precision: BAY-LIN's head, SNGP's random-feature output layer),
:class:`KronPosterior` (Kronecker-factored blocks per Linear layer: LA-LoRA). A diagonal one would be a third class
with the same API.

**``prior_precision``, one meaning in every method's settings**: the precision lambda of the prior, either a number
> 0 (used as it is) or ``marglik`` (lambda maximises the Laplace evidence at the trained weights, post hoc; the
search is an exact bracketed root-finding, so there is no starting value to set, unlike laplace-torch's 100 Adam steps
from ``prior_precision=1``). :func:`prior_precision_setting` is the one check. BAY-LIN keeps one word of its own,
``fixed`` (its default): lambda = ``reg_lambda``, the same lambda as its MAP fit's L2 term, as the paper ties them
(eqs. 14-15); ``fixed`` is the number ``reg_lambda``, so Table 1's tuned files and the sweeps, which set
``reg_lambda``, keep their meaning, and ``prior_precision=<number>`` decouples the posterior's lambda from the MAP's.
"""

from rewarduq_exp.methods.posteriors.base import MARGLIK, LaplacePosterior, prior_precision_setting
from rewarduq_exp.methods.posteriors.full import FullPosterior
from rewarduq_exp.methods.posteriors.kron import KronPosterior, require_laplace

__all__ = ["MARGLIK", "FullPosterior", "KronPosterior", "LaplacePosterior", "prior_precision_setting",
           "require_laplace"]
