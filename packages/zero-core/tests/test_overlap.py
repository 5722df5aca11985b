"""Stages 1/2 with ``overlap_comm`` and several buckets: the parameter all-gathers of a step are all finished when
``step()`` returns (nothing, e.g. a read outside the module, may observe one in flight); values always equal a
single-process reference."""

import pytest
import torch
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import ZeroConfig, ZeroRuntime


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5), nn.Tanh(), nn.Linear(5, 3))


def _data(step, world):
    g = torch.Generator().manual_seed(step)
    return torch.randn(world, 4, 6, generator=g), torch.randn(world, 4, 3, generator=g)


def _reference(world, steps):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses, evals = [], []
    for step in range(steps):
        x, y = _data(step, world)
        loss = sum(nn.functional.mse_loss(model(x[r]), y[r]) for r in range(world)) / world
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        with torch.no_grad():
            evals.append(nn.functional.mse_loss(model(x[0]), y[0]).item())
    return losses, evals, {n: p.detach().clone() for n, p in model.named_parameters()}


def _body(stage, steps):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    cfg = ZeroConfig(stage=stage, overlap_comm=True, reduce_bucket_size=40)  # several buckets
    rt = ZeroRuntime(model, torch.optim.AdamW(model.parameters(), lr=0.05), cfg)
    losses, evals, in_flight = [], [], []
    for step in range(steps):
        x, y = _data(step, world)
        loss = nn.functional.mse_loss(rt.module(x[rank]), y[rank])
        rt.backward(loss, is_boundary=True)
        rt.step()
        # read every parameter right after step(), before any forward: already the stepped values
        in_flight.append({n: p.detach().clone() for n, p in rt.module.named_parameters()})
        out = torch.tensor([loss.item()])
        dist.all_reduce(out)
        losses.append(out.item() / world)
        if step < steps - 1:
            with torch.no_grad():
                evals.append(nn.functional.mse_loss(rt.module(x[0]), y[0]).item())
    return losses, evals, in_flight[-1], rt.full_parameters(), len(rt.flat_groups[0].buckets)


@pytest.mark.parametrize("stage", [1, 2])
def test_param_gather_finished_when_step_returns(stage):
    ref_losses, ref_evals, ref_params = _reference(2, 4)
    for losses, evals, read_after_step, params, buckets in run_ranks(_body, 2, stage, 4, timeout=60):
        assert buckets > 2
        for name, want in ref_params.items():  # a plain read right after the last step() sees its result
            torch.testing.assert_close(read_after_step[name], want, rtol=1e-6, atol=1e-7)
        assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
        assert evals == pytest.approx(ref_evals[:-1], rel=1e-6, abs=1e-7)
        assert params.keys() == ref_params.keys()
        for name, want in ref_params.items():
            torch.testing.assert_close(params[name], want, rtol=1e-6, atol=1e-7)
