"""Edge cases of ZeroRuntime: empty / frozen-only param groups, bad input errors."""

import pytest
import torch
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import ZeroConfig, ZeroRuntime


def _frozen_group_body(stage):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    model[0].requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1)
    rt = ZeroRuntime(model, opt, ZeroConfig(stage=stage, stage3_param_persistence_threshold=0))
    for _ in range(2):
        rt.backward(rt.module(torch.ones(2, 5)).square().mean(), is_boundary=True)
        result = rt.step()
    full = rt.full_parameters()
    return result.stepped, torch.equal(full["0.weight"], frozen), [g.numel for g in rt.flat_groups]


@pytest.mark.parametrize("world", [1, 2])
def test_frozen_only_param_group(world):
    for stage in (0, 1, 2, 3):
        for stepped, unchanged, numels in run_ranks(_frozen_group_body, world, stage, timeout=60):
            assert stepped and unchanged
            assert numels == [42, 24]  # group 0 holds its frozen parameters (they may be unfrozen later)


def _bad_input_body():
    errors = []
    model = nn.Linear(3, 3)
    other = nn.Parameter(torch.zeros(2))
    for make in (
        lambda: ZeroRuntime(model, torch.optim.SGD([model.weight, model.bias, other], lr=0.1)),
        lambda: ZeroRuntime(model, torch.optim.SGD([model.weight], lr=0.1)),
        lambda: ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), gradient_clipping=-1.0),
    ):
        try:
            make()
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_bad_input_is_named():
    errors = run_ranks(_bad_input_body, 1, timeout=60)[0]
    assert "not a parameter of the module" in errors[0] and "shape (2,)" in errors[0]
    assert "'bias'" in errors[1] and "no optimizer param group" in errors[1]
    assert "gradient_clipping must be >= 0, got -1.0" in errors[2]


def _int_param_body(stage):
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    model.ids = nn.Parameter(torch.arange(4) + dist.get_rank(), requires_grad=False)
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=stage))
    rt.backward(rt.module(torch.ones(1, 3)).sum())
    rt.step()
    return model.ids.dtype, model.ids.tolist()


def test_integer_parameter_left_alone_and_broadcast():
    for stage in (0, 3):
        for dtype, ids in run_ranks(_int_param_body, 2, stage, timeout=60):
            assert dtype == torch.int64 and ids == [0, 1, 2, 3]
