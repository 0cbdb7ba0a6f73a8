"""The Laplace approximation of the log marginal likelihood (the evidence) of a model with an isotropic Gaussian prior
theta ~ N(0, I / lambda) on d parameters, and the lambda that maximises it (MacKay 1992; Daxberger et al. 2021,
"Laplace Redux", eq. 4; Immer et al. 2021).

With theta* the mode, ``log_lik`` = log p(D | theta*) and G the curvature of the negative log-likelihood at theta*
(its Hessian, or the generalised Gauss-Newton approximation of it), the posterior precision is H = G + lambda I and

    log p(D | lambda) ~= log p(D | theta*) - lambda/2 ||theta*||^2 + d/2 log lambda - 1/2 log det(G + lambda I)

(the prior's and the Gaussian integral's (2 pi)^(d/2) cancel). Everything here is generic in the likelihood: the
caller gives log p(D | theta*) and the eigenvalues g_j of G, so each lambda costs O(d) after one eigendecomposition,
log det(G + lambda I) = sum_j log(g_j + lambda). For a Gaussian likelihood that is linear in theta, with theta* the
exact posterior mean at this lambda, the approximation is exact (the posterior is Gaussian), which is how it is
tested (tests/test_bay_lin_laplace.py).

Fitting lambda with theta* held fixed ("post hoc", as laplace-torch's ``optimize_prior_precision(method="marglik")``
does): in t = log lambda,

    d/dt log p(D | e^t) = (gamma(lambda) - lambda ||theta*||^2) / 2,   gamma(lambda) = sum_j g_j / (g_j + lambda),

gamma being the effective number of parameters the data determine. gamma falls and lambda ||theta*||^2 rises with t,
so the derivative has exactly one root (the evidence is strictly concave in lambda as soon as some g_j > 0: its
second derivative is sum_j 1 / (2 (g_j + lambda)^2) - d / (2 lambda^2) < 0). MacKay's update
lambda <- gamma(lambda) / ||theta*||^2 is the fixed-point form of that root; it converges only linearly. We solve
the same equation with Brent's method (``scipy.optimize.brentq``) in log lambda, inside a bracket known in closed
form (:func:`fit_prior_precision`), which reaches it to machine precision in a few dozen O(d) evaluations.
"""

from __future__ import annotations

import math

import numpy as np

# Where the root is outside this range (no curvature at all: lambda -> 0; theta* = 0: lambda -> infinity), the
# evidence is monotone over it and the end is returned.
LAMBDA_MIN, LAMBDA_MAX = 1e-10, 1e10


def _eigenvalues(curvature_eigenvalues) -> np.ndarray:
    # G is positive semi-definite; eigenvalues of a few ulp below 0 are round-off of an exact 0.
    return np.clip(np.asarray(curvature_eigenvalues, dtype=np.float64), 0.0, None)


def log_evidence(log_lik: float, theta_sq_norm: float, curvature_eigenvalues, prior_precision: float) -> float:
    """log p(D | lambda) in the Laplace approximation (module docstring), for ``prior_precision`` = lambda > 0,
    ``theta_sq_norm`` = ||theta*||^2 and the d eigenvalues of the curvature G at theta*."""
    g = _eigenvalues(curvature_eigenvalues)
    lam = float(prior_precision)
    return float(log_lik - 0.5 * lam * theta_sq_norm + 0.5 * len(g) * math.log(lam) - 0.5 * np.log(g + lam).sum())


def effective_parameters(curvature_eigenvalues, prior_precision: float) -> float:
    """gamma = sum_j g_j / (g_j + lambda): how many directions the data determine rather than the prior."""
    g = _eigenvalues(curvature_eigenvalues)
    return float((g / (g + float(prior_precision))).sum())


def fit_prior_precision(theta_sq_norm: float, curvature_eigenvalues, lower: float = LAMBDA_MIN,
                        upper: float = LAMBDA_MAX) -> float:
    """The lambda in [``lower``, ``upper``] that maximises :func:`log_evidence` with theta* held fixed: the root of
    gamma(lambda) = lambda ||theta*||^2 (module docstring), found by Brent's method in log lambda.

    The bracket is closed form. At the root, gamma <= d gives lambda <= d / ||theta*||^2; and for lambda <= g_max,
    gamma >= g_max / (g_max + lambda) >= 1/2, so the root is >= min(g_max, 1 / (2 ||theta*||^2)). Where there is no
    root (theta* = 0 or G = 0), or it is outside [lower, upper], the nearer end is returned: the evidence is
    monotone towards it."""
    from scipy.optimize import brentq

    g = _eigenvalues(curvature_eigenvalues)
    norm = float(theta_sq_norm)
    if not (norm >= 0 and math.isfinite(norm)) or not np.isfinite(g).all():
        raise ValueError(f"fit_prior_precision needs a finite ||theta||^2 and curvature (got {norm!r})")
    g_max = float(g.max(initial=0.0))
    if g_max == 0.0:
        return float(lower)      # no data curvature: the evidence only falls with lambda
    if norm == 0.0:
        return float(upper)      # theta* = 0: the evidence only rises with lambda

    def slope(t: float) -> float:  # 2 d/dt log p(D | e^t)
        lam = math.exp(t)
        return float((g / (g + lam)).sum()) - lam * norm

    # The root is in [root_lo, root_hi] (docstring); clipped to [lower, upper], the sign of the slope at an end that
    # was clipped says on which side of the range the root lies.
    root_lo, root_hi = 0.5 * min(g_max, 0.5 / norm), 2.0 * len(g) / norm
    lo, hi = math.log(max(lower, root_lo)), math.log(min(upper, root_hi))
    if lo >= hi:
        return float(lower if lower >= root_hi else upper)
    if slope(lo) <= 0:
        return float(math.exp(lo))   # only when lo = log(lower): the root is below it
    if slope(hi) >= 0:
        return float(math.exp(hi))   # only when hi = log(upper): the root is above it
    return float(math.exp(brentq(slope, lo, hi, xtol=1e-12, rtol=4 * np.finfo(float).eps, maxiter=200)))
