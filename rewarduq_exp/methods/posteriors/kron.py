"""A Laplace posterior whose precision is Kronecker-factored per Linear layer (:class:`KronPosterior`): LA-LoRA's,
over the trained weights of a network (the LoRA adapter's and the head's). P = H + lambda I, H the Kronecker-factored
GGN of the Bradley-Terry likelihood (:mod:`~rewarduq_exp.methods.lora.kfac`), block diagonal over the layers with
block G (x) A; the linearised (GLM) predictive of a text's reward has variance J P^-1 J^T, J the reward's gradient in
the weights.

The algebra is laplace-torch's: each block's factors G (out x out) and A (in x in) are eigendecomposed, the blocks
form a ``laplace.utils.matrix.KronDecomposed`` (what ``KronLaplace`` holds as ``H`` after ``fit``), ``H + lambda`` is
its posterior precision and ``inv_square_form`` its functional variance, taken block by block here (P is block
diagonal, so the sum over blocks is ``KronLaplace.functional_variance`` of the whole Jacobian, which is never held).
What is not taken from laplace-torch, and why:

* no ``KronLaplace`` object: it allocates zero factors for every trained weight when built and keeps the raw factors
  beside their eigendecompositions (three times the factors' memory; they are 49 GiB at Qwen3-4B with LoRA on every
  Linear), and its ``state_dict`` is saved with pickle. The eigendecompositions here replace the factors one at a
  time and are saved as safetensors;
* the prior precision: ``optimize_prior_precision(method="marglik")`` maximises laplace-torch's log marginal
  likelihood log p(D | theta*) - 1/2 (log det P - log det(lambda I) + lambda ||theta* - 0||^2) (a zero prior mean) by
  100 Adam steps on log lambda from 1. The same objective is maximised exactly here: a block's eigenvalues are the
  products of its factors' eigenvalues, so the whole spectrum is known and the root of the evidence's derivative is
  found by :func:`~rewarduq_exp.methods.posteriors.evidence.fit_prior_precision` (the formula every posterior here
  shares), wherever it lies (Adam's 100 steps of ~0.1 reach at most e^10 from lambda = 1).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from rewarduq_exp.core.errors import UserError, first_line
from rewarduq_exp.core.payload_bounds import Expected
from rewarduq_exp.methods.posteriors.base import LaplacePosterior

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


class KronPosterior(LaplacePosterior):
    """Per block (a trained Linear, by module path): the eigendecompositions of its factors, laplace-torch's
    ``KronDecomposed`` order ([G, A]); the prior precision (a scalar)."""

    def __init__(self, blocks: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                 prior_precision: float):
        self.blocks = blocks   # name -> (out_vectors, out_values, in_vectors, in_values)
        self.prior_precision = float(prior_precision)
        self._spectrum = None

    @classmethod
    def from_factors(cls, factors: dict[str, tuple[torch.Tensor, torch.Tensor]],
                     prior_precision: float = 1.0) -> KronPosterior:
        """The fit: eigendecompose the K-FAC ``factors`` ({block: (G, A)}), each replacing its factor as it is done
        (the dict is emptied), so memory holds the factors or their decompositions, not both."""
        blocks = {}
        for name in list(factors):
            g, a = factors.pop(name)
            out_val, out_vec = eigen(g)
            del g
            in_val, in_vec = eigen(a)
            del a
            blocks[name] = (out_vec, out_val, in_vec, in_val)
        return cls(blocks, prior_precision)

    def _curvature_eigenvalues(self) -> np.ndarray:
        """Block G (x) A has the products of G's and A's eigenvalues."""
        return np.concatenate([torch.outer(b[1].double(), b[3].double()).flatten().cpu().numpy()
                               for b in self.blocks.values()])

    def _prior_changed(self) -> None:
        """Nothing is factorised ahead: ``KronDecomposed`` adds lambda to the eigenvalues when it is used."""

    @property
    def num_parameters(self) -> int:
        return int(sum(b[1].numel() * b[3].numel() for b in self.blocks.values()))

    # ------------------------------------------------------------------ the linearised predictive
    def _deltas(self, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor([self.prior_precision], dtype=like.dtype, device=like.device)

    def block_precision(self, name: str):
        """Block ``name`` of the posterior precision H + lambda as laplace-torch's ``KronDecomposed``."""
        kron_decomposed = require_laplace()
        out_vec, out_val, in_vec, in_val = self.blocks[name]
        return kron_decomposed([[out_vec, in_vec]], [[out_val, in_val]], deltas=self._deltas(out_val))

    def block_variance(self, name: str, jacobian: torch.Tensor) -> torch.Tensor:
        """(rows,) J P^-1 J^T of block ``name`` for per-row Jacobians (rows, out, in) of its weight: the block's share
        of the predictive variance (LA-LoRA takes each block as backward reaches it, so no whole J is held)."""
        rows = jacobian.shape[0]
        return self.block_precision(name).inv_square_form(jacobian.reshape(rows, 1, -1))[:, 0, 0]

    def predictive_variance(self, jacobians: dict[str, torch.Tensor]) -> torch.Tensor:
        """(rows,) J P^-1 J^T for per-row Jacobians of every block ({name: (rows, out, in)}), summed in block
        order."""
        return torch.stack([self.block_variance(name, jacobians[name]) for name in self.blocks]).sum(0)

    @property
    def precision(self):
        """The whole posterior precision as one ``KronDecomposed`` (the tests compare it with laplace-torch's)."""
        kron_decomposed = require_laplace()
        vectors = [[b[0], b[2]] for b in self.blocks.values()]
        values = [[b[1], b[3]] for b in self.blocks.values()]
        return kron_decomposed(vectors, values, deltas=self._deltas(next(iter(self.blocks.values()))[1]))

    # ------------------------------------------------------------------ safetensors
    def tensors(self) -> dict[str, torch.Tensor]:
        out = {PRIOR_KEY: torch.tensor([self.prior_precision], dtype=torch.float64)}
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
        prior = float(tensors[PRIOR_KEY][0])
        blocks = {name: tuple(tensors[f"{name}.{part}"].to(device) for part in PARTS) for name in names}
        return cls(blocks, prior)
