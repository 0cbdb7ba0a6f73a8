"""ENS-MLP: an ensemble of K MLP reward heads on frozen backbone features (RewardUQ section 4.1, eqs. 10-11).

The K heads are one module with stacked weights, evaluated with one einsum and batched matmuls; there is no Python
loop over heads (``scripts/bench_heads.py`` measures the difference). Each head is
Linear(d, h)-ReLU-Linear(h, h)-ReLU-Linear(h, 1) with Xavier-uniform init; the output layer has no bias, because a
constant shift cancels in every Bradley-Terry margin and the centring term already pins the reward level.
Diversity comes from the random init alone: every head sees the same minibatch, as in the paper.

Loss (eq. 11): Bradley-Terry NLL averaged over pairs and heads + lambda * mean over heads of the per-parameter mean
squared deviation from the head's initial parameters + gamma * mean of (r_chosen + r_rejected)^2.
reward = mean over heads, u = unbiased standard deviation over heads, bounds reward ± beta * u (eq. 10).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.setting_bounds import WIDTH, Bound
from rewarduq_exp.methods.base import FeatureHeadMethod
from rewarduq_exp.methods.losses import bradley_terry_loss
from rewarduq_exp.methods.settings import AdamWSettings, FeatureHeadSettings, positive, setting
from rewarduq_exp.methods.training import run_training


def squared_deviation(diff: torch.Tensor) -> torch.Tensor:
    """Per head, the sum of squares of ``diff`` (K, ...): one reduction without a squared copy."""
    return torch.linalg.vector_norm(diff, dim=tuple(range(1, diff.dim()))).square()   # no flattened copy


def xavier_uniform(fan_in: int, fan_out: int, generator: torch.Generator | None, *lead: int,
                   gain: float = 1.0) -> torch.Tensor:
    """(*lead, fan_in, fan_out) weights drawn in one call from ``generator``: U(-b, b), b = gain sqrt(6 / (fan_in +
    fan_out)) (Xavier-uniform, per (fan_in, fan_out) matrix; ``lead``: a stack of them, e.g. K heads)."""
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return (torch.rand(*lead, fan_in, fan_out, generator=generator) * 2 - 1) * bound


def mlp_parameters(dims: list[int], generator: torch.Generator | None, *lead: int,
                   gain: float = 1.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(weights, biases) of the reward heads' MLP Linear(dims[0], dims[1])-ReLU-...-Linear(dims[-2], dims[-1]):
    Xavier-uniform weights (:func:`xavier_uniform`), drawn layer by layer from ``generator``, and zero biases for the
    hidden layers only (the output layer has none: a constant shift cancels in every Bradley-Terry margin).
    ``lead``: a leading stack axis (K heads); ENS-MLP's heads, the epinet's base head mu and its epinet g are built
    by it."""
    weights = [xavier_uniform(a, b, generator, *lead, gain=gain) for a, b in zip(dims[:-1], dims[1:])]
    return weights, [torch.zeros(*lead, width) for width in dims[1:-1]]


class BatchedMLPHeads(nn.Module):
    """K independent MLPs sharing nothing but the input, as (K, fan_in, fan_out) weight stacks.

    The first stack is held in memory as (fan_in, K, fan_out), a permuted view: every head reads the same input, so
    the first layer is one (B, d) x (d, K h) matrix product, and einsum reads the weights in that layout without
    copying them. Stored (K, d, h)-contiguous, einsum copied the d x K h weights into that layout on every forward
    and its gradient back on every backward (two 10 MB copies a step at K = 20, d = 1024, h = 128, about a fifth of
    the step); the product itself, and so every number, is the same. Saved files keep the (K, fan_in, fan_out)
    layout (the saver makes tensors contiguous).
    """

    def __init__(self, num_heads: int, in_dim: int, hidden_dim: int = 128, num_hidden_layers: int = 2,
                 gain: float = 1.0, generator: torch.Generator | None = None):
        super().__init__()
        self.num_heads = num_heads
        weights, biases = mlp_parameters([in_dim] + [hidden_dim] * num_hidden_layers + [1], generator, num_heads,
                                         gain=gain)
        # the shared-input layer: (fan_in, K, fan_out) in memory (class docstring)
        weights[0] = weights[0].permute(1, 0, 2).contiguous().permute(1, 0, 2)
        self.weights = nn.ParameterList([nn.Parameter(w) for w in weights])
        self.biases = nn.ParameterList([nn.Parameter(b) for b in biases])
        self.params_per_head = sum(p[0].numel() for p in self.parameters())

    def separate_heads(self) -> nn.ModuleList:
        """The same K heads as separate ``nn.Sequential`` modules (the naive layout, for tests and benchmarks)."""
        heads = nn.ModuleList()
        for k in range(self.num_heads):
            layers: list[nn.Module] = []
            for i, w in enumerate(self.weights):
                lin = nn.Linear(w.shape[1], w.shape[2], bias=i < len(self.biases), device=w.device)
                with torch.no_grad():
                    lin.weight.copy_(w[k].T)
                    if lin.bias is not None:
                        lin.bias.copy_(self.biases[i][k])
                layers += [lin, nn.ReLU()]
            heads.append(nn.Sequential(*layers[:-1]))
        return heads

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Rewards (K, B) of features ``z`` (B, d)."""
        h = torch.relu(torch.einsum("bd,kdh->kbh", z, self.weights[0]) + self.biases[0][:, None, :])
        for w, b in zip(self.weights[1:-1], self.biases[1:]):
            h = torch.relu(torch.baddbmm(b[:, None, :], h, w))
        return torch.bmm(h, self.weights[-1]).squeeze(-1)


@dataclass(kw_only=True)
class EnsMLPSettings(FeatureHeadSettings, AdamWSettings, config="ens_mlp"):
    """Defaults and comments: ``conf/method/ens_mlp.yaml``."""

    num_heads: int = setting(bound=Bound(2, 1024, "heads", "the paper's K is 20; each head is an MLP trained with its "
                                         "gradients, AdamW states and anchor copy; their memory is checked against "
                                         "the device's too"), doc="K")
    hidden_dim: int = setting(bound=Bound(1, WIDTH, "units", "the paper's heads have 128; K heads of this width are "
                                          "checked against the device's memory too"))
    num_hidden_layers: int = setting(bound=Bound(1, 256, "layers", "the paper's heads have 2; each layer is a "
                                                 "hidden_dim^2 matrix per head"))
    init_gain: float = setting(check=positive(), doc="Xavier-uniform gain")
    reg_lambda: float = setting(check=positive(inclusive=True), doc="lambda: anchor to the initial parameters")
    center_gamma: float = setting(check=positive(inclusive=True), doc="gamma: mean (r_c + r_r)^2")
    beta: float = setting(check=positive(), doc="bounds reward +- beta * u")


class EnsMLP(FeatureHeadMethod):
    name = "ens_mlp"
    settings_class = EnsMLPSettings

    def __init__(self, encoder=None, **values):
        super().__init__(encoder, **values)
        self.heads: BatchedMLPHeads | None = None
        self.initial: list[torch.Tensor] = []
        self._anchor_diff: list[torch.Tensor] = []   # p - p0 of each parameter, reused every step

    @classmethod
    def head_memory(cls, ctx, feature_dim: int, batch: int):
        """K stacked MLPs with gradients, AdamW states and the anchor copy, and with an anchor its p - p0 buffers
        (kept, :meth:`add_anchor_gradient`); each hidden layer's ReLU output kept for backward and two more (K, 2B, h)
        tensors alive in the forward; after the backward pass has freed them, AdamW's square-root denominators of
        every parameter at once (foreach)."""
        from rewarduq_exp.models.memory_plan import HeadMemory

        m, d = ctx.method, feature_dim
        k, h, nh = int(m.num_heads), int(m.hidden_dim), int(m.num_hidden_layers)
        trainable = k * (d * h + (nh - 1) * h * h + h + nh * h)
        parts = {"ENS-MLP heads (weights, grads, AdamW x2, anchor copy)": 5 * trainable * 4}
        if float(m.reg_lambda) > 0:
            parts["anchor differences (p - p0, kept)"] = trainable * 4
        parts["head activations"] = activations = 2 * batch * (d + k * h * (nh + 2)) * 4
        # after the backward pass has freed the activations: only what exceeds them raises the peak
        parts["AdamW denominators (beyond the freed activations)"] = max(0, trainable * 4 - activations)
        return HeadMemory(trainable, parts, 6 * trainable * 2 * ctx.n_train * float(m.num_epochs))

    @classmethod
    def check_fits(cls, settings, feature_dim: int, device_bytes: float) -> None:
        """K x hidden_dim x num_hidden_layers, each bounded alone, must also fit together: the heads with their
        gradients, two AdamW states and the anchor's copy (and its p - p0 buffers with an anchor), as
        :meth:`head_memory` counts them, within ``device_bytes``. Settings the constructor refuses are left to it."""
        k, h, nh = settings.get("num_heads"), settings.get("hidden_dim"), settings.get("num_hidden_layers")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (k, h, nh)):
            return
        trainable = k * (feature_dim * h + (nh - 1) * h * h + h + nh * h)
        anchor = trainable * 4 if (settings.get("reg_lambda") or 0) > 0 else 0
        need = 5 * trainable * 4 + anchor
        if need > device_bytes:
            gib = 2**30
            raise UserError(f"method.num_heads={k} x method.hidden_dim={h} x method.num_hidden_layers={nh} is too "
                            f"large: the ENS-MLP heads on {feature_dim}-dim features need {need / gib:.1f} GiB "
                            "(weights, gradients, AdamW states, anchor copy), more than the device's "
                            f"{device_bytes / gib:.1f} GiB (as the planner takes it: plan.device_memory_gib); lower "
                            "one of them")

    def _build(self, feature_dim: int) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        self.heads = BatchedMLPHeads(self.num_heads, feature_dim, self.hidden_dim, self.num_hidden_layers,
                                     self.init_gain, generator).to(self.device)
        self._anchor_diff = []
        # The anchor of eq. 11: each head is pulled towards its own initial parameters.
        self.initial = [p.detach().clone() for p in self.heads.parameters()]

    def anchor_penalty(self) -> torch.Tensor:
        """Mean over heads of the per-parameter mean squared deviation from the initial parameters (eq. 11's anchor):
        a value without a graph, since training adds its gradient directly (:meth:`add_anchor_gradient`)."""
        with torch.no_grad():
            sq = sum(squared_deviation(p - p0) for p, p0 in zip(self.heads.parameters(), self.initial))
            return (sq / self.heads.params_per_head).mean()

    def add_anchor_gradient(self, value: bool = True) -> torch.Tensor | None:
        """Add lambda times the anchor's gradient to every parameter's ``.grad``; returns the anchor's value (None
        with ``value=False``: the training loop asks for it only on the steps it logs).

        anchor = (1/K) sum_k (1/P) sum_i (p_ki - p0_ki)^2 (:meth:`anchor_penalty`, P parameters per head), so
        d anchor / d p_ki = 2 (p_ki - p0_ki) / (K P): one subtraction and one in-place add per parameter tensor,
        where autograd of the anchor built a second graph (subtract, square, sum, mean) over every parameter and
        kept every p - p0 alive through the backward pass (the autograd path took 8-10 ms of a 26 ms step). Called
        after the backward pass of the other terms and before clipping, so the step is today's to float rounding
        (tests/test_ens_mlp_anchor_gradient.py). Each p - p0 lives only while its own tensor is handled.
        """
        scale = 2.0 * self.reg_lambda / (self.num_heads * self.heads.params_per_head)
        if len(self._anchor_diff) != len(self.initial):   # one buffer per parameter, in its layout, kept: a fresh
            self._anchor_diff = [torch.empty_like(p0) for p0 in self.initial]   # 10 MB each step cost page faults
        sq = 0.0
        with torch.no_grad():
            for p, p0, diff in zip(self.heads.parameters(), self.initial, self._anchor_diff):
                torch.sub(p, p0, out=diff)
                if value:
                    sq = sq + squared_deviation(diff)
                if p.grad is None:
                    p.grad = diff.mul(scale)
                else:
                    p.grad.add_(diff, alpha=scale)
        return (sq / self.heads.params_per_head).mean() if value else None

    def _fit_terms(self, zc: torch.Tensor, zr: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Bradley-Terry and centring terms of eq. 11 (differentiable)."""
        n = zc.shape[0]
        rewards = self.heads(torch.cat([zc, zr]))  # one pass for chosen and rejected: (K, 2B)
        rc, rr = rewards[:, :n], rewards[:, n:]
        return bradley_terry_loss(rc, rr, weight, normalise=True, mean_over_members=True)

    def _total(self, bt: torch.Tensor, anchor: torch.Tensor, center: torch.Tensor) -> tuple[torch.Tensor, dict]:
        total = bt.detach() + self.reg_lambda * anchor + self.center_gamma * center.detach()
        return total, {"loss_bt": bt.detach(), "loss_anchor": anchor, "loss_center": center.detach()}

    def loss(self, zc: torch.Tensor, zr: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The value of eq. 11 on a batch and its three terms, without a graph (training: :meth:`_fit_features`)."""
        with torch.no_grad():
            bt, center = self._fit_terms(zc, zr, weight)
        anchor = self.anchor_penalty() if self.reg_lambda > 0 else torch.zeros((), device=zc.device)
        return self._total(bt, anchor, center)

    def _fit_features(self, zc, zr, weight) -> None:
        """AdamW on eq. 11 by :func:`~rewarduq_exp.methods.training.run_training`: each step runs backward on the BT
        and centring terms, then adds the anchor's gradient directly (:meth:`add_anchor_gradient`) before the loop
        clips the total gradient norm over the K heads together and steps."""
        def step(index: torch.Tensor, record: bool) -> dict:
            index = index.to(self.device)
            bt, center = self._fit_terms(zc[index], zr[index], weight[index])
            (bt + self.center_gamma * center).backward()
            if self.reg_lambda > 0:
                anchor = self.add_anchor_gradient(value=record)
            else:
                anchor = torch.zeros((), device=zc.device)
            if not record:   # the loop logs every log_every steps: the anchor's value is one more pass when it is
                return {}
            total, parts = self._total(bt, anchor, center)
            return {"loss": total, **parts}

        run_training(self.heads.parameters(), len(zc), self.schedule, step, seed=self.seed,
                     desc=f"{self.name} training", history=self.history, show_progress=self.show_progress,
                     log_every=self.log_every, step_knows_records=True)
        # AdamW's fused kernel made a step about 10 ms faster on a CPU, but it rounds differently: over the default
        # run the drift moved the demo table's recalibrated rows past its tolerance, so the default loop stays.

    def _score_features(self, z):
        rewards = self.heads(z)  # (K, B)
        return rewards.mean(0), rewards.std(0, unbiased=True)

    def _sample_features(self, z: torch.Tensor) -> torch.Tensor:
        return self.heads(z)  # the K members are the draws

    def member_rewards(self, z: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.heads(z.to(self.device)).cpu()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        state = {f"heads.{k}": v for k, v in self.heads.state_dict().items()}
        # The anchor is part of the trained state: continuing training must pull towards the same point.
        state.update({f"initial.{i}": p for i, p in enumerate(self.initial)})
        return state

    def expected_state(self, feature_dim, why: str) -> dict:
        """The tensors of :meth:`state_tensors`: per layer a (K, fan_in, fan_out) weight stack and a (K, hidden)
        bias stack, and the anchor's copy of each parameter (``initial.i``, in ``parameters()`` order: weights, then
        biases), for K = num_heads, the hidden width and depth of the hyperparameters and ``feature_dim``."""
        from rewarduq_exp.core.payload_bounds import Expected

        k, h = self.num_heads, self.hidden_dim
        why = f"num_heads={k}, hidden_dim={h}, num_hidden_layers={self.num_hidden_layers}, {why}"
        dims = [feature_dim] + [h] * self.num_hidden_layers + [1]
        shapes = [(k, a, b) for a, b in zip(dims[:-1], dims[1:])]
        biases = [(k, h)] * self.num_hidden_layers
        out = {f"heads.weights.{i}": shape for i, shape in enumerate(shapes)}
        out |= {f"heads.biases.{i}": shape for i, shape in enumerate(biases)}
        out |= {f"initial.{i}": shape for i, shape in enumerate(shapes + biases)}
        return {name: Expected(shape, "f", why) for name, shape in out.items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        feature_dim = tensors["heads.weights.0"].shape[1]
        num_heads = tensors["heads.weights.0"].shape[0]
        if num_heads != self.num_heads:
            raise UserError(f"saved model has {num_heads} heads but method.num_heads={self.num_heads}")
        self._build(feature_dim)
        self.heads.load_state_dict({k[len("heads."):]: v for k, v in tensors.items() if k.startswith("heads.")})
        # in each parameter's own memory layout, so that p - p0 runs over both in one order
        self.initial = [torch.empty_like(p).copy_(tensors[f"initial.{i}"])
                        for i, p in enumerate(self.heads.parameters())]
