"""The curvature of the Bradley-Terry likelihood over a model's ``nn.Linear`` layers as Kronecker factors (K-FAC, the
generalised Gauss-Newton), and each text's Jacobian of its reward w.r.t. those layers' weights, from forward hooks and
hooks on the layers' output gradients.

Why not laplace-torch's own ``fit`` (its curvlinops / ASDL / BackPACK backends): they count every position of a
padded batch as a token, so padding enters the input factors (a reward model's batches are padded to their longest
text), they take a pair as one input of the model and hold both texts' activations for backward at once (at 4B, a pair
of 2,048-token texts is 25 GB of activations, more than an 80 GB device has left beside the factors), and their
``la(x)`` Jacobians are a (texts x parameters) matrix from ``torch.func.jacrev`` (33M parameters per text at 4B). What
is computed here is what laplace-torch computes (``hessian_structure="kron"``, curvlinops' K-FAC "expand", the
default), on the real tokens only: tests/test_la_lora.py checks the factors equal laplace-torch's on unpadded texts.
That parity holds with laplace-torch called with a non-default argument, ``Laplace(..., asdl_fisher_kwargs=
{"num_per_example_loss_terms": 1})`` (passed on to curvlinops' KFAC: one loss term per example, and an example is a
text here); with its default (None: curvlinops infers the terms per example from the labels) its factors are scaled
otherwise and are not these.

K-FAC of the BT likelihood. A pair's log-likelihood is 2-class cross-entropy on the logits (r_rejected, r_chosen),
whose Hessian in the logits is p (1 - p) [[1, -1], [-1, 1]] (p = sigmoid(r_c - r_r)): the GGN of a pair is
p (1 - p) (J_c - J_r)^T (J_c - J_r). K-FAC "expand" treats every token position of every text as an example of its
own (cross terms between positions, and so between the two texts, dropped), so the sign of J_r does not matter and
each text contributes alone, with the weight w^2 = p (1 - p) (times the pair's weight): for a Linear with input a_t
and output gradient g_t of the reward at position t,

    G = sum over texts and positions of w^2 g_t g_t^T,     A = sum over texts and positions of a_t a_t^T / T,

T the number of positions (real tokens; for the head, which sees one position per text: texts), the curvature block
being G (x) A. One backward of sum_rows w_row r_row gives every row's w g_t at once (rows are independent). Pad
positions follow the last real token and never reach it (causal attention), so their g_t is exactly 0; their inputs
are not, and are masked out of A and T here.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch import nn


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """The Linear layers of ``model`` whose weight is trained (requires grad), in module order: laplace-torch's order
    of its Kronecker blocks (and of the parameters, for a model whose trained parameters are all such weights)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and m.weight.requires_grad}



@contextlib.contextmanager
def forward_hooks(layers: dict[str, nn.Linear], hook):
    """``hook(name, module, inputs, output)`` on every layer's forward while the block runs, removed after it."""
    handles = [m.register_forward_hook(partial(hook, name)) for name, m in layers.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()

class KroneckerFactors:
    """Running sums of each layer's K-FAC factors (module docstring): ``G[name]`` (out x out), ``A[name]``
    (in x in), ``positions[name]``, float32 on the layers' device."""

    def __init__(self, layers: dict[str, nn.Linear]):
        self.layers = layers
        self.G, self.A, self.positions = {}, {}, {}
        for name, m in layers.items():
            kw = {"device": m.weight.device, "dtype": torch.float32}
            self.G[name] = torch.zeros(m.out_features, m.out_features, **kw)
            self.A[name] = torch.zeros(m.in_features, m.in_features, **kw)
            self.positions[name] = torch.zeros((), dtype=torch.float64, device=m.weight.device)
        self._mask: torch.Tensor | None = None

    @contextlib.contextmanager
    def recording(self, mask: torch.Tensor):
        """Accumulate over the forwards and backwards run inside; ``mask`` (rows, positions) marks the real tokens of
        the batch (a layer fed one vector per row, the head, counts every row)."""
        self._mask = mask.bool()
        try:
            with forward_hooks(self.layers, self._forward):
                yield self
        finally:
            self._mask = None

    def _real(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of ``x`` (rows, [positions,] features) at real tokens, float32, as (n, features)."""
        if x.dim() == 3:
            x = x[self._mask]
        return x.reshape(-1, x.shape[-1]).float()

    def _forward(self, name: str, module, inputs, output) -> None:
        x = self._real(inputs[0].detach())
        self.A[name].addmm_(x.T, x)
        self.positions[name] += x.shape[0]
        if output.requires_grad:
            output.register_hook(partial(self._backward, name, self._mask))

    def _backward(self, name: str, mask: torch.Tensor, grad: torch.Tensor) -> None:
        g = grad.detach()
        if g.dim() == 3:
            g = g[mask]
        g = g.reshape(-1, g.shape[-1]).float()
        self.G[name].addmm_(g.T, g)

    def sum_over_processes(self) -> None:
        """Add up every process's sums (each ran its share of the texts), one all-reduce per tensor."""
        import torch.distributed as dist

        for store in (self.G, self.A, self.positions):
            for t in store.values():
                dist.all_reduce(t)

    def factors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{layer: (G, A)} with A divided by its positions (module docstring), laplace-torch's ``Kron`` order. The
        running sums are given up (the factors take their memory)."""
        out = {}
        for name in list(self.layers):
            a = self.A.pop(name)
            a /= max(float(self.positions[name]), 1.0)
            out[name] = (self.G.pop(name), a)
        return out


class RowJacobians:
    """Each row's gradient of its own output w.r.t. every layer's weight, (rows, out, in), handed to
    ``consume(name, jacobian)`` as backward reaches the layer, so no (rows x parameters) Jacobian is ever held.

    For a forward of independent rows and one backward of the sum of their outputs, row b's gradient of a Linear's
    weight is sum over positions of g_bt a_bt^T (pad positions: g = 0, module docstring): one batched matmul of the
    output gradients with the inputs, which the forward hook keeps (autograd keeps them anyway for the weight's
    gradient)."""

    def __init__(self, layers: dict[str, nn.Linear], consume):
        self.layers, self.consume = layers, consume

    @contextlib.contextmanager
    def recording(self):
        with forward_hooks(self.layers, self._forward):
            yield self

    def _forward(self, name: str, module, inputs, output) -> None:
        if output.requires_grad:
            output.register_hook(partial(self._backward, name, inputs[0].detach()))

    def _backward(self, name: str, x: torch.Tensor, grad: torch.Tensor) -> None:
        g, x = grad.detach().float(), x.float()
        if g.dim() == 2:   # one vector per row (the head)
            g, x = g[:, None], x[:, None]
        self.consume(name, torch.bmm(g.transpose(1, 2), x))
