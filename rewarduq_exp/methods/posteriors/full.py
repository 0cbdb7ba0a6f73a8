"""A Laplace posterior with a full precision matrix over a weight vector (:class:`FullPosterior`): BAY-LIN's linear
head over backbone features, SNGP's output layer over random features.

For a model linear in its weights, r(x) = theta^T x, trained with the Bradley-Terry likelihood on pairs, the data
term of the precision is G = sum_i c_i dx_i dx_i^T, dx_i = x_chosen_i - x_rejected_i, with c_i = w_i s_i (1 - s_i)
(s_i = sigmoid(theta^T dx_i), w_i the pair's weight: the Gauss-Newton curvature, here the exact Hessian) or c_i = w_i
(BAY-LIN's unweighted form, the paper's). It is accumulated in float64, a chunk of rows at a time
(:meth:`FullPosterior.accumulate`), so no float64 copy of all rows and no per-row Python loop exists. P = G + lambda I
is factorised once, P = L L^T; the linearised predictive of r(x) has variance x^T P^-1 x = ||L^-1 x||^2, computed for
a batch of rows by one triangular solve (never an inverse, never a B x B matrix).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from rewarduq_exp.methods.posteriors.base import LaplacePosterior

CHUNK = 8192   # rows per float64 block while accumulating G


def curvature_sum(x: torch.Tensor, coef: torch.Tensor, out: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """``out`` += sum_i coef_i x_i x_i^T in float64, ``chunk`` rows at a time (in place; returned)."""
    for i in range(0, len(x), chunk):
        rows = x[i:i + chunk].double()
        out += rows.T @ (rows * coef[i:i + chunk].double()[:, None])
    return out


def posterior_precision(x: torch.Tensor, coef: torch.Tensor, prior_precision: float,
                        chunk: int = CHUNK) -> torch.Tensor:
    """lambda I + sum_i coef_i x_i x_i^T in float64 (BAY-LIN's eq. 15)."""
    d = x.shape[1]
    g = curvature_sum(x, coef, torch.zeros(d, d, dtype=torch.float64, device=x.device), chunk)
    return g + prior_precision * torch.eye(d, dtype=torch.float64, device=x.device)


def quadratic_form_sqrt(cholesky_lower: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sqrt(x_b^T P^-1 x_b) for every row b of ``x``, with P = L L^T: the norm of L^-1 x_b (float64)."""
    v = torch.linalg.solve_triangular(cholesky_lower, x.double().T, upper=False)  # (d, B)
    return v.pow(2).sum(0).sqrt()


class FullPosterior(LaplacePosterior):
    """N(theta*, P^-1) over d weights with P = G + lambda I held as a d x d float64 matrix and its Cholesky factor.

    Build it from rows and their curvature weights (:meth:`fit`, or an empty one and :meth:`accumulate` chunk by
    chunk, then :meth:`set_prior_precision` / :meth:`optimise_prior_precision`), or from a saved precision
    (:meth:`from_precision`, :meth:`from_tensors`). ``predictive_variance(x)`` is x^T P^-1 x per row."""

    def __init__(self, dim: int, device=None):
        self.dim = int(dim)
        self.curvature: torch.Tensor | None = torch.zeros(self.dim, self.dim, dtype=torch.float64, device=device)
        self.prior_precision = math.nan
        self.precision: torch.Tensor | None = None
        self.cholesky: torch.Tensor | None = None
        self._spectrum = None

    # ------------------------------------------------------------------ fit
    @torch.no_grad()
    def accumulate(self, x: torch.Tensor, coef: torch.Tensor, chunk: int = CHUNK) -> FullPosterior:
        """Add sum_i coef_i x_i x_i^T (rows ``x`` (n, d), weights ``coef`` (n,)) to G."""
        if self.curvature is None:
            raise RuntimeError("this posterior was loaded from its precision: there is no curvature to add to")
        curvature_sum(x, coef, self.curvature, chunk)
        self._spectrum = None
        return self

    @classmethod
    def fit(cls, x: torch.Tensor, coef: torch.Tensor, prior_precision: float | None = None,
            chunk: int = CHUNK) -> FullPosterior:
        """G from rows ``x`` (n, d) and their curvature weights ``coef`` (module docstring); with a
        ``prior_precision``, P and its factor too (else set it later)."""
        posterior = cls(x.shape[1], device=x.device).accumulate(x, coef, chunk)
        if prior_precision is not None:
            posterior.set_prior_precision(prior_precision)
        return posterior

    @classmethod
    def from_precision(cls, precision: torch.Tensor, prior_precision: float = math.nan) -> FullPosterior:
        """A posterior from its precision P (as saved); G = P - lambda I where lambda is known (for the evidence),
        never needed for the predictive."""
        posterior = cls.__new__(cls)
        posterior.dim = precision.shape[0]
        posterior.curvature, posterior.prior_precision, posterior._spectrum = None, float(prior_precision), None
        posterior._factorise(precision.double())
        return posterior

    def _factorise(self, precision: torch.Tensor) -> None:
        self.precision = precision
        self.cholesky, info = torch.linalg.cholesky_ex(precision)
        if int(info) != 0:
            raise RuntimeError(f"the posterior precision G + lambda I (lambda = {self.prior_precision:g}) is not "
                               "positive definite; raise the prior precision")

    def _prior_changed(self) -> None:
        g = self._curvature()
        self._factorise(g + self.prior_precision * torch.eye(self.dim, dtype=g.dtype, device=g.device))

    def _curvature(self) -> torch.Tensor:
        if self.curvature is not None:
            return self.curvature
        if not math.isfinite(self.prior_precision):
            raise RuntimeError("this posterior was loaded without its prior precision: its curvature is unknown")
        return self.precision - self.prior_precision * torch.eye(self.dim, dtype=self.precision.dtype,
                                                                 device=self.precision.device)

    def _curvature_eigenvalues(self) -> np.ndarray:
        return torch.linalg.eigvalsh(self._curvature()).cpu().numpy()   # one d x d float64 eigendecomposition

    @property
    def num_parameters(self) -> int:
        return self.dim

    # ------------------------------------------------------------------ the linearised predictive
    def _require_factor(self) -> torch.Tensor:
        if self.cholesky is None:
            raise RuntimeError("the posterior has no prior precision yet: call set_prior_precision or "
                               "optimise_prior_precision")
        return self.cholesky

    def predictive_sd(self, x: torch.Tensor) -> torch.Tensor:
        """sqrt(x_b^T P^-1 x_b) per row of ``x`` (B, d), float64: the standard deviation of theta^T x."""
        return quadratic_form_sqrt(self._require_factor(), x)

    def predictive_variance(self, x: torch.Tensor) -> torch.Tensor:
        """x_b^T P^-1 x_b per row of ``x`` (B, d), float64: the variance of theta^T x under the posterior."""
        v = torch.linalg.solve_triangular(self._require_factor(), x.double().T, upper=False)
        return v.pow(2).sum(0)

    def sample_offsets(self, x: torch.Tensor, samples: int, seed: int) -> torch.Tensor:
        """(samples, B) draws of (theta - theta*)^T x_b, theta ~ N(theta*, P^-1): theta - theta* = L^-T eps, so the
        offset is (L^-1 x_b)^T eps. Seeded on the CPU: the same draws on every call (chosen and rejected share them)."""
        v = torch.linalg.solve_triangular(self._require_factor(), x.double().T, upper=False)  # (d, B)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        eps = torch.randn(samples, v.shape[0], generator=gen, dtype=torch.float64).to(v.device)
        return eps @ v

    # ------------------------------------------------------------------ saved
    def tensors(self) -> dict[str, torch.Tensor]:
        """The precision P (d, d) float64 and the prior precision (1,)."""
        return {"precision": self.precision, "prior_precision": torch.tensor([self.prior_precision],
                                                                            dtype=torch.float64)}

    @staticmethod
    def expected(dim, why: str) -> dict:
        """{tensor: Expected} of :meth:`tensors` for ``dim`` weights (an int or an ``AtMost`` bound)."""
        from rewarduq_exp.core.payload_bounds import Expected

        return {"precision": Expected((dim, dim), "f", why),
                "prior_precision": Expected((1,), "f", "the prior precision, one number")}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], device=None) -> FullPosterior:
        lam = float(tensors["prior_precision"].reshape(-1)[0])
        if not 0 < lam < math.inf:
            raise ValueError(f"prior_precision is {lam!r}, not a number > 0")
        return cls.from_precision(tensors["precision"].to(device).double(), lam)
