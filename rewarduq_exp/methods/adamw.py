"""AdamW for :func:`~rewarduq_exp.methods.training.run_training`: torch's own AdamW arithmetic (the functional
``torch.optim.adamw.adamw``, the kernel ``torch.optim.AdamW.step`` calls), with the state held here.

Why not ``torch.optim.AdamW`` itself: every ``torch.optim.Optimizer`` wraps ``add_param_group`` and ``zero_grad`` in
``torch._disable_dynamo``, which imports ``torch._dynamo`` on the first call: 0.8 s on a 2-core CPU, as long as the
whole training epoch of ENS-MLP on cached features, in every process that trains. The functional kernel imports
nothing more. The step is the same call with the same arguments (foreach, decoupled weight decay, float learning
rate, no AMSGrad), so every parameter is equal to the bit (``tests/test_adamw.py``), and ``state_dict`` /
``load_state_dict`` use torch's format, so a training checkpoint written by either loads into the other.
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw


def _step_dtype() -> torch.dtype:
    """The dtype torch keeps a step count in (``torch.optim.optimizer._get_scalar_dtype``)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class FunctionalAdamW:
    """AdamW over ``params`` (one group): moments created on a parameter's first gradient, as torch creates them."""

    def __init__(self, params, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        self.params = list(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.state: list[dict[str, torch.Tensor]] = [{} for _ in self.params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One AdamW step at learning rate ``lr`` over the parameters that have a gradient."""
        with_grad = [(p, s) for p, s in zip(self.params, self.state) if p.grad is not None]
        for p, s in with_grad:
            if not s:
                s["step"] = torch.tensor(0.0, dtype=_step_dtype())
                s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if not with_grad:
            return
        params = [p for p, _ in with_grad]
        adamw(params, [p.grad for p in params], [s["exp_avg"] for _, s in with_grad],
              [s["exp_avg_sq"] for _, s in with_grad], [], [s["step"] for _, s in with_grad],
              foreach=True, capturable=False, differentiable=False, fused=None, grad_scale=None, found_inf=None,
              has_complex=any(torch.is_complex(p) for p in params), amsgrad=False, beta1=self.betas[0],
              beta2=self.betas[1], lr=lr, weight_decay=self.weight_decay, eps=self.eps, maximize=False)
        self.lr = lr

    def state_dict(self) -> dict:
        """``torch.optim.AdamW.state_dict()``'s layout: state by parameter index, one parameter group."""
        group = {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                 "amsgrad": False, "foreach": True, "maximize": False, "capturable": False, "differentiable": False,
                 "fused": None, "decoupled_weight_decay": True, "params": list(range(len(self.params)))}
        return {"state": {i: dict(s) for i, s in enumerate(self.state) if s}, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Moments in each parameter's dtype and device, the step count as saved (torch's own loading rules)."""
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(f"a saved optimizer state of {[len(g['params']) for g in groups]} parameters does not "
                             f"fit this one of {len(self.params)}")
        self.state = [{} for _ in self.params]
        for index, values in state_dict["state"].items():
            p = self.params[int(index)]
            self.state[int(index)] = {key: value if key == "step" else value.to(dtype=p.dtype, device=p.device)
                                      for key, value in values.items()}
        self.lr = groups[0]["lr"]
