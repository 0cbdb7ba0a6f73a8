"""What every Laplace posterior offers (:class:`LaplacePosterior`) and the one check of the ``prior_precision`` setting
(:func:`prior_precision_setting`); the package docstring says what they mean."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.posteriors.evidence import (
    LAMBDA_MAX,
    LAMBDA_MIN,
    effective_parameters,
    fit_prior_precision,
    log_evidence,
)

MARGLIK = "marglik"


def prior_precision_setting(*aliases: str, meaning: str = ""):
    """The check of a method's ``prior_precision`` setting: ``marglik`` or a number > 0 (as a float), and the method's
    own ``aliases`` (BAY-LIN's ``fixed``, whose ``meaning`` the message gives)."""
    words = (MARGLIK, *aliases)

    def check(value, key):
        if isinstance(value, str) and value in words:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            extra = f", or {', '.join(aliases)}{f' ({meaning})' if meaning else ''}" if aliases else ""
            raise UserError(f"{key}={value!r} is invalid; allowed: marglik or a number > 0{extra}")
        return float(value)
    return check


class LaplacePosterior(ABC):
    """A Gaussian N(theta*, P^-1) over a model's trained weights theta* (a flat vector of ``num_parameters``),
    P = G + lambda I: G the curvature of the negative log-likelihood at theta* (the generalised Gauss-Newton of the
    Bradley-Terry likelihood, or the paper's unweighted form), lambda the precision of the zero-mean isotropic prior
    (``prior_precision``). Subclasses differ in how G is held (:class:`~rewarduq_exp.methods.posteriors.full.
    FullPosterior`: a d x d matrix; :class:`~rewarduq_exp.methods.posteriors.kron.KronPosterior`: Kronecker factors
    per layer) and so in how the linearised predictive's variance J P^-1 J^T is taken (``predictive_variance``).

    The evidence side is shared: G's eigenvalues (:meth:`spectrum`, computed once) give the log marginal likelihood
    (:meth:`log_evidence`), the effective number of parameters, and the lambda that maximises the evidence
    (:meth:`optimise_prior_precision`; :mod:`~rewarduq_exp.methods.posteriors.evidence`)."""

    prior_precision: float
    _spectrum: np.ndarray | None = None

    # ------------------------------------------------------------------ what a structure implements
    @abstractmethod
    def _curvature_eigenvalues(self) -> np.ndarray:
        """The eigenvalues of G (all ``num_parameters`` of them), float64."""

    @abstractmethod
    def _prior_changed(self) -> None:
        """Refresh what depends on the prior precision (a factorisation of P), after it was set."""

    @property
    @abstractmethod
    def num_parameters(self) -> int: ...

    @abstractmethod
    def tensors(self) -> dict:
        """What is saved (safetensors): the posterior and its prior precision, as the structure holds them."""

    # ------------------------------------------------------------------ the prior precision and the evidence
    def spectrum(self) -> np.ndarray:
        """The eigenvalues of the curvature G, float64, computed once."""
        if self._spectrum is None:
            self._spectrum = self._curvature_eigenvalues()
        return self._spectrum

    def set_prior_precision(self, value: float) -> float:
        value = float(value)
        if not 0 < value < math.inf:
            raise ValueError(f"a prior precision must be a number > 0, not {value!r}")
        self.prior_precision = value
        self._prior_changed()
        return value

    def optimise_prior_precision(self, theta_sq_norm: float, lower: float = LAMBDA_MIN,
                                 upper: float = LAMBDA_MAX) -> float:
        """Set and return the lambda in [lower, upper] that maximises the evidence with theta* held fixed (post hoc,
        laplace-torch's ``optimize_prior_precision(method="marglik")``), found exactly
        (:func:`~rewarduq_exp.methods.posteriors.evidence.fit_prior_precision`). ``theta_sq_norm`` = ||theta*||^2
        (the prior's mean is 0)."""
        return self.set_prior_precision(fit_prior_precision(theta_sq_norm, self.spectrum(), lower, upper))

    def apply_prior_precision(self, setting, theta_sq_norm: float) -> float:
        """Set the prior precision a ``prior_precision`` setting asks for: the number, or for ``marglik`` the maximiser
        of the evidence (:meth:`optimise_prior_precision`). Returns it."""
        if setting == MARGLIK:
            return self.optimise_prior_precision(theta_sq_norm)
        return self.set_prior_precision(setting)

    def log_evidence(self, log_lik: float, theta_sq_norm: float, prior_precision: float | None = None) -> float:
        """log p(D | lambda) ~= log p(D | theta*) - lambda/2 ||theta*||^2 + d/2 log lambda - 1/2 log det(G + lambda I)
        at ``prior_precision`` (default: the posterior's own), ``log_lik`` = log p(D | theta*)."""
        lam = self.prior_precision if prior_precision is None else prior_precision
        return log_evidence(log_lik, theta_sq_norm, self.spectrum(), lam)

    def effective_parameters(self, prior_precision: float | None = None) -> float:
        """gamma = sum_j g_j / (g_j + lambda): how many directions the data determine rather than the prior."""
        return effective_parameters(self.spectrum(), self.prior_precision if prior_precision is None
                                    else prior_precision)
