"""Reduction pieces (DDP-sized buckets inside one layout bucket) when backward is called outside
``runtime.backward``: a parameter whose gradient arrives twice before its piece launched is summed, not
overwritten (each stage copies a slot's first gradient since the buffer was cleared and adds the next); stale
values of a lazily cleared stage 0/1 buffer never reach the norm."""

from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import ZeroConfig, ZeroRuntime
from zero_core.grad_reduction import AllReduceAvg, ReduceScatterAvg
from zero_core.reducer import GradReducer


class Two(nn.Module):
    """``a`` always used, ``b`` when ``use_b``, ``c`` never (so the piece is still open after the second backward
    has brought ``a``'s gradient again)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.use_b = True

    def forward(self, x):
        out = self.a(x)
        return out + self.b(x) if self.use_b else out


def _data(rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)


def _local_grads(model: Two, rank: int) -> dict:
    x1, x2 = _data(rank)
    model.zero_grad()
    model.use_b = False
    model(x1).square().mean().backward()
    model.use_b = True
    model(x2).square().mean().backward()
    return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}


def _wrong_comm_error(stage: int) -> str:
    """A collective that does not fit the stage (stage 0 averages in place, 1-3 scatter) is refused at attach."""
    comm = (ReduceScatterAvg if stage == 0 else AllReduceAvg)(dist.group.WORLD, False)
    model = Two()
    try:
        ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=stage),
                    grad_reduction=partial(GradReducer.from_inputs, comm=comm))  # fmt: skip
    except ValueError as e:
        return str(e)
    return "no error"


def _body(stage: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    refused = _wrong_comm_error(stage)
    torch.manual_seed(0)
    model = Two()
    ref = [_local_grads(_copy(model), r) for r in range(world)]
    want = {n: sum(g[n] for g in ref) / world for n in ref[0]}
    reducer = partial(GradReducer.from_inputs, piece_bytes=10_000)  # one piece holds the three layers
    rt = ZeroRuntime(
        model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=stage), grad_reduction=reducer
    )
    x1, x2 = _data(rank)
    model.use_b = False
    rt.module(x1).square().mean().backward()  # plain backward: a's gradient arrives, b's does not
    model.use_b = True
    rt.module(x2).square().mean().backward()  # a's second gradient arrives before the piece launched
    got = {n: rt.full_grad(p) for n, p in model.named_parameters()}
    return len(rt.reducer.pieces), {n: (got[n] - want[n]).abs().max().item() for n in want}, refused


def _copy(model: Two) -> Two:
    clone = Two()
    clone.load_state_dict(model.state_dict())
    return clone


def test_second_gradient_before_the_piece_launched_is_added():
    for stage in (0, 1, 2):
        for pieces, err, refused in run_ranks(_body, 2, stage, timeout=60):
            assert pieces == 1
            assert f"stage {stage} needs" in refused and "as comm" in refused, refused
            assert max(err.values()) < 1e-6, (stage, err)


def _norms_body(stage: int):
    """Stages 0/1 clear their gradient buffers lazily: stale values of the last step must never reach the norm,
    whether a parameter stops getting gradients (frozen) or a step has no backward at all."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Two()
    ref = _copy(model)
    reducer = partial(GradReducer.from_inputs, piece_bytes=200)  # several pieces per bucket
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=stage),
                     grad_reduction=reducer)  # fmt: skip
    got, want = [], []
    for step, freeze in enumerate((False, True, None)):  # None: a step without any backward
        if freeze is not None:
            for m in (model, ref):
                m.b.requires_grad_(not freeze)
            x = _data(10 * step + rank)[0]
            rt.backward(rt.module(x).square().mean(), is_boundary=True)
            ref.zero_grad()
            for r in range(world):
                ref(_data(10 * step + r)[0]).square().mean().div(world).backward()
            grads = [p.grad for p in ref.parameters() if p.grad is not None]
            want.append(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])).item())
        else:
            want.append(0.0)
        got.append(rt.step().grad_norm)
        with torch.no_grad():  # the reference follows the runtime's parameters
            for p, q in zip(model.parameters(), ref.parameters()):
                q.copy_(p)  # stages 0/1: every parameter is dense and current after step()
    return got, want


def test_lazily_cleared_buffers_never_leak_into_the_norm():
    for stage in (0, 1):
        for got, want in run_ranks(_norms_body, 2, stage, timeout=60):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-7), (stage, got, want)


def _builder_body():
    from zero_core import ReductionInputs

    model = Two()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        ZeroRuntime(model, opt, ZeroConfig(stage=2), grad_reduction=object())
    except TypeError as e:
        refused = str(e)
    else:
        refused = "accepted"
    seen = []

    def builder(inputs: ReductionInputs):
        seen.append(inputs)
        return GradReducer.from_inputs(inputs, piece_bytes=64)

    model = Two()
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=2), grad_reduction=builder)
    (inputs,) = seen
    layout = list(inputs.flat_groups) == rt.flat_groups
    given = (inputs.stage, inputs.world, inputs.rank, inputs.group is rt.group, layout, inputs.params is rt.params,
             inputs.master is rt.master, inputs.module is model)  # fmt: skip
    return refused, given, len(rt.reducer.pieces)


def test_grad_reduction_takes_a_builder_of_reduction_inputs():
    refused, given, pieces = run_ranks(_builder_body, 1, timeout=60)[0]
    assert "grad_reduction takes a builder" in refused and "object" in refused
    assert given == (2, 1, 0, True, True, True, True, True)
    assert pieces == 1  # one rank: each bucket is reduced whole (piece_bytes matters on several ranks only)
