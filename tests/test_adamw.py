"""The training loop's AdamW (rewarduq_exp/methods/adamw.py) is torch.optim.AdamW to the bit, and its state moves
between the two in torch's state_dict format (so a checkpoint written before it loads)."""

import pytest
import torch

from rewarduq_exp.methods.adamw import FunctionalAdamW

SETTINGS = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    stack = torch.randn(3, 5, 4, generator=g).permute(1, 0, 2).contiguous().permute(1, 0, 2)   # ENS-MLP's layout
    return [torch.nn.Parameter(t) for t in (stack, torch.randn(3, 4, generator=g), torch.randn(7, generator=g))]


def _gradients(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        # the last parameter has no gradient on odd steps: neither optimizer touches it (nor creates its moments)
        p.grad = None if i == 2 and step % 2 else torch.randn(p.shape, generator=g)


def _lr(step: int) -> float:
    return SETTINGS["lr"] * (0.5 + 0.5 * step / 10)


def _torch_steps(params, steps: range, optimizer=None) -> torch.optim.AdamW:
    optimizer = optimizer or torch.optim.AdamW(params, foreach=True, **SETTINGS)
    for step in steps:
        _gradients(params, step)
        for group in optimizer.param_groups:
            group["lr"] = _lr(step)
        optimizer.step()
    return optimizer


def _our_steps(params, steps: range, optimizer=None) -> FunctionalAdamW:
    optimizer = optimizer or FunctionalAdamW(params, **SETTINGS)
    for step in steps:
        _gradients(params, step)
        optimizer.step(_lr(step))
    return optimizer


def _assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_steps_equal_torch_adamw_to_the_bit():
    ours, theirs = _params(), _params()
    mine, torch_opt = _our_steps(ours, range(10)), _torch_steps(theirs, range(10))
    _assert_equal(ours, theirs)
    assert ours[0].stride() == theirs[0].stride()   # the permuted layout is kept, as in torch
    sd_ours, sd_torch = mine.state_dict(), torch_opt.state_dict()
    assert sd_ours["param_groups"][0] == sd_torch["param_groups"][0]
    assert sd_ours["state"].keys() == sd_torch["state"].keys()
    for index, values in sd_torch["state"].items():
        assert values.keys() == sd_ours["state"][index].keys()
        _assert_equal(list(values.values()), list(sd_ours["state"][index].values()))


@pytest.mark.parametrize("direction", ["torch to ours", "ours to torch"])
def test_a_saved_state_continues_in_the_other_optimizer(direction):
    reference = _params()
    _torch_steps(reference, range(10))
    params = _params()
    if direction == "torch to ours":
        first = _torch_steps(params, range(4))
        second = FunctionalAdamW(params, **SETTINGS)
        second.load_state_dict(first.state_dict())
        _our_steps(params, range(4, 10), second)
    else:
        first = _our_steps(params, range(4))
        second = torch.optim.AdamW(params, foreach=True, **SETTINGS)
        second.load_state_dict(first.state_dict())
        _torch_steps(params, range(4, 10), second)
    _assert_equal(params, reference)


def test_a_state_of_other_parameters_is_refused():
    saved = _our_steps(_params(), range(2)).state_dict()
    with pytest.raises(ValueError, match="does not fit this one of 2"):
        FunctionalAdamW(_params()[:2], **SETTINGS).load_state_dict(saved)
