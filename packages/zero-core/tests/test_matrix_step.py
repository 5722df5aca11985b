"""The whole-matrix step seam (``zero_core.matrix_step``): an optimizer whose update needs each whole matrix gets it
at every stage, even where a shard boundary cuts the matrix, and its sharded state checkpoints in the shard layout.

The toy optimizer's update is the Frobenius-normalised running sum of gradients, ``W -= lr * S / ||S||``: the norm
of a piece differs from the norm of the whole matrix, so a step that finished pieces alone would move the weights
differently (the test checks that it would). The reference applies the same rule to whole tensors in one process.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import ZeroConfig, ZeroRuntime
from zero_core.matrix_step import WholeMatrixOptimizer, load_pieces_state, pieces_state

LR = 0.1


class NormalisedSum(torch.optim.Optimizer):
    """``S += G``; ``W -= lr * S / ||S||`` over whole tensors (one param group, ``whole`` true)."""

    def __init__(self, params):
        super().__init__([{"params": list(params), "whole": True}], {"lr": LR})

    def whole_matrix_group(self, group):
        return group["whole"]

    def blend(self, param, grad, group):
        state = self.state[param]
        if "sum" not in state:
            state["sum"] = torch.zeros_like(param)
        state["sum"].add_(grad.reshape(param.shape))
        return state["sum"].clone()

    def finish(self, matrix, group):
        return matrix / matrix.norm()

    def apply(self, param, update, group):
        param.add_(update.reshape(param.shape), alpha=-group["lr"])

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.param_groups[0]["params"]:
            if p.grad is not None:
                self.apply(p, self.finish(self.blend(p, p.grad, self.param_groups[0]), None), self.param_groups[0])


def _net():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(10, 10, bias=False), nn.Tanh(), nn.Linear(10, 7, bias=False))  # 85 a rank


def _data(step, world):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4 * world, 10, generator=g), torch.randn(4 * world, 7, generator=g)


def _body(stage, bucket):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _net()
    rt = ZeroRuntime(model, NormalisedSum(model.parameters()), ZeroConfig(stage=stage, reduce_bucket_size=bucket,
                     stage3_param_persistence_threshold=0))  # fmt: skip
    for step in range(3):
        x, y = _data(step, world)
        sl = slice(4 * rank, 4 * rank + 4)
        rt.backward(nn.functional.mse_loss(rt.module(x[sl]), y[sl]))
        rt.step()
    g = next(g for g in rt.flat_groups if g.group_index is not None)
    state = pieces_state(rt.optimizer, g, rt.master.pieces[g.index])
    load_pieces_state(rt.optimizer, g, rt.master.pieces[g.index], state)
    again = pieces_state(rt.optimizer, g, rt.master.pieces[g.index])
    return rt.full_parameters(), torch.equal(state["sum"], again["sum"]), g.shard_numel


def _reference(world, piecewise_at=None):
    model = _net()
    opt = NormalisedSum(model.parameters())
    for step in range(3):
        x, y = _data(step, world)
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if piecewise_at is None:
            opt.step()
            continue
        with torch.no_grad():  # what finishing two pieces of the first matrix separately would do
            w = model[0].weight
            opt.state[w].setdefault("sum", torch.zeros_like(w)).add_(w.grad)
            s = opt.state[w]["sum"].reshape(-1)
            upd = torch.cat([s[:piecewise_at] / s[:piecewise_at].norm(), s[piecewise_at:] / s[piecewise_at:].norm()])
            w.sub_(LR * upd.view_as(w))
            w2, group = model[2].weight, opt.param_groups[0]
            opt.apply(w2, opt.finish(opt.blend(w2, w2.grad, group), group), group)
    return {n: p.detach() for n, p in model.named_parameters()}


def test_the_toy_optimizer_is_a_whole_matrix_optimizer():
    assert isinstance(NormalisedSum([nn.Parameter(torch.zeros(2, 2))]), WholeMatrixOptimizer)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("bucket", [500_000_000, 100])  # 100: one bucket per matrix, each assembled on its own
def test_whole_matrices_across_the_shard_boundary(stage, bucket):
    results = run_ranks(_body, 2, stage, bucket, timeout=120)
    ref, piecewise = _reference(2), _reference(2, piecewise_at=85)
    for got, state_round_trips, shard_numel in results:
        assert state_round_trips and shard_numel == (170 if stage == 0 else 85)
        for n, want in ref.items():
            torch.testing.assert_close(got[n], want, rtol=1e-5, atol=1e-6)
    assert (piecewise["0.weight"] - ref["0.weight"]).abs().max() > 1e-3, "piecewise would look the same"
    for n in ref:
        assert torch.equal(results[0][0][n], results[1][0][n]), f"{n}: ranks differ"
