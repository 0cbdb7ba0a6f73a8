"""LA-LoRA's posterior: the Laplace approximation N(theta*, P^-1) over the trained weights (the LoRA adapter's and
the head's), P = H + delta I with H the Kronecker-factored GGN of the Bradley-Terry likelihood at theta*
(:mod:`~rewarduq_exp.methods.lora.kfac`), and the linearised (GLM) predictive of a text's reward: mean r(theta*),
variance J P^-1 J^T with J the reward's gradient w.r.t. the weights.

The algebra is laplace-torch's: each block's factors G (out x out) and A (in x in) are eigendecomposed, the blocks
form a ``laplace.utils.matrix.KronDecomposed`` (what ``KronLaplace`` holds as ``H`` after ``fit``), ``H + delta`` is
its posterior precision and ``inv_square_form`` its functional variance, taken block by block here (P is block
diagonal, so the sum over blocks is ``KronLaplace.functional_variance`` of the whole Jacobian, which is never held).
What is not taken from laplace-torch, and why:

* no ``KronLaplace`` object: it allocates zero factors for every trained weight when built and keeps the raw factors
  beside their eigendecompositions (three times the factors' memory; they are 49 GiB at Qwen3-4B with LoRA on every
  Linear), and its ``state_dict`` is saved with pickle. The eigendecompositions here replace the factors one at a
  time and are saved as safetensors;
* the prior precision: ``optimize_prior_precision(method="marglik")`` maximises laplace-torch's log marginal
  likelihood log p(D | theta*) - 1/2 (log det P - log det(delta I) + delta ||theta* - 0||^2) (a zero prior mean) by
  100 Adam steps on log delta from 1. The same objective is maximised exactly here: a block's eigenvalues are the
  products of its factors' eigenvalues, so the whole spectrum is known and the root of the evidence's derivative is
  found by :func:`rewarduq_exp.methods.posteriors.evidence.fit_prior_precision` (BAY-LIN's evidence, the same formula),
  wherever it lies (Adam's 100 steps of ~0.1 reach at most e^10 from delta = 1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from rewarduq_exp.core.errors import UserError, first_line
from rewarduq_exp.core.payload_bounds import Expected

INSTALL = "pip install 'rewarduq_exp[laplace]'"
PRIOR_KEY = "prior_precision"
PARTS = ("out_vectors", "out_values", "in_vectors", "in_values")


def require_laplace():
    """laplace-torch's Kronecker algebra (``KronDecomposed``), or one line saying how to install it."""
    root = logging.getLogger()
    level = root.level
    # laplace-torch logs at import, on the root logger, that a backend we never use (asdfghjkl) is not installed
    root.setLevel(max(level, logging.WARNING))
    try:
        from laplace.utils.matrix import KronDecomposed
    except Exception as err:  # noqa: BLE001 (a missing package, or one of its imports failing: the same advice)
        raise UserError(f"method=la_lora needs laplace-torch, which cannot be imported here ({first_line(err, 120)}); "
                        f"install it with: {INSTALL}") from None
    finally:
        root.setLevel(level)
    return KronDecomposed


def eigen(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(eigenvalues >= 0, eigenvectors) of a symmetric PSD factor, in float64 and back to float32 (a factor of a few
    thousand rows loses its small eigenvalues to float32 round-off). Not laplace-torch's ``symeig``, which calls
    ``exit()`` when it fails twice."""
    values, vectors = torch.linalg.eigh(factor.double())
    # contiguous, as the saved ones load: eigh's column-major layout takes other BLAS paths (other last bits of u)
    return values.clamp_min(0).float(), vectors.float().contiguous()


@dataclass
class KronPosterior:
    """Per block (a trained Linear, by module path): the eigendecompositions of its factors, laplace-torch's
    ``KronDecomposed`` order ([G, A]); the prior precision ``delta`` (scalar)."""

    blocks: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]  # out_vec, out_val, in_vec, in_val
    delta: float

    @classmethod
    def from_factors(cls, factors: dict[str, tuple[torch.Tensor, torch.Tensor]], delta: float = 1.0) -> KronPosterior:
        """Eigendecompose ``factors`` ({block: (G, A)}), each replacing its factor as it is done (the dict is
        emptied), so memory holds the factors or their decompositions, not both."""
        blocks = {}
        for name in list(factors):
            g, a = factors.pop(name)
            out_val, out_vec = eigen(g)
            del g
            in_val, in_vec = eigen(a)
            del a
            blocks[name] = (out_vec, out_val, in_vec, in_val)
        return cls(blocks, float(delta))

    def spectrum(self) -> np.ndarray:
        """The eigenvalues of H (all blocks), float64: block G (x) A has the products of G's and A's."""
        return np.concatenate([torch.outer(b[1].double(), b[3].double()).flatten().cpu().numpy()
                               for b in self.blocks.values()])

    def fit_prior_precision(self, theta_sq_norm: float) -> float:
        """The delta that maximises the Laplace evidence (module docstring) with theta* held fixed; sets it."""
        from rewarduq_exp.methods.posteriors.evidence import fit_prior_precision

        self.delta = float(fit_prior_precision(theta_sq_norm, self.spectrum()))
        return self.delta

    def log_evidence(self, log_lik: float, theta_sq_norm: float) -> tuple[float, float]:
        """(log marginal likelihood, effective number of parameters) at the current delta."""
        from rewarduq_exp.methods.posteriors.evidence import effective_parameters, log_evidence

        g = self.spectrum()
        return log_evidence(log_lik, theta_sq_norm, g, self.delta), effective_parameters(g, self.delta)

    def block_precision(self, name: str):
        """Block ``name`` of the posterior precision H + delta as laplace-torch's ``KronDecomposed``."""
        kron_decomposed = require_laplace()
        out_vec, out_val, in_vec, in_val = self.blocks[name]
        delta = torch.tensor([self.delta], dtype=out_val.dtype, device=out_val.device)
        return kron_decomposed([[out_vec, in_vec]], [[out_val, in_val]], deltas=delta)

    def variance(self, name: str, jacobian: torch.Tensor) -> torch.Tensor:
        """(rows,) J P^-1 J^T of block ``name`` for per-row Jacobians (rows, out, in) of its weight."""
        rows = jacobian.shape[0]
        return self.block_precision(name).inv_square_form(jacobian.reshape(rows, 1, -1))[:, 0, 0]

    def precision(self):
        """The whole posterior precision as one ``KronDecomposed`` (the tests compare it with laplace-torch's)."""
        kron_decomposed = require_laplace()
        vectors = [[b[0], b[2]] for b in self.blocks.values()]
        values = [[b[1], b[3]] for b in self.blocks.values()]
        first = next(iter(self.blocks.values()))[1]
        return kron_decomposed(vectors, values, deltas=torch.tensor([self.delta], dtype=first.dtype,
                                                                    device=first.device))

    # ------------------------------------------------------------------ safetensors
    def tensors(self) -> dict[str, torch.Tensor]:
        out = {PRIOR_KEY: torch.tensor([self.delta], dtype=torch.float64)}
        for name, block in self.blocks.items():
            for part, t in zip(PARTS, block):
                out[f"{name}.{part}"] = t.detach().cpu().contiguous()
        return out

    @staticmethod
    def expected(shapes: dict[str, tuple[int, int]], why: str) -> dict[str, Expected]:
        """{tensor: Expected} of :meth:`tensors` for blocks of weight shapes {name: (out, in)}."""
        out = {PRIOR_KEY: Expected((1,), "f", "the prior precision, one number")}
        for name, (n_out, n_in) in shapes.items():
            for part, shape in zip(PARTS, ((n_out, n_out), (n_out,), (n_in, n_in), (n_in,))):
                out[f"{name}.{part}"] = Expected(shape, "f", f"{why}: the {n_out} x {n_in} weight of {name}",
                                                 max_itemsize=4)
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], names, device) -> KronPosterior:
        delta = float(tensors[PRIOR_KEY][0])
        blocks = {name: tuple(tensors[f"{name}.{part}"].to(device) for part in PARTS) for name in names}
        return cls(blocks, delta)
