"""Stage 3 with a parameter that gets a gradient on some ranks only, inside a module every rank runs (unused
parameters: the missing gradient counts as zero). Its unit's reduction is complete during backward on rank 0 and only
at the end on rank 1; reductions run on a group of their own (``grad_reduction.reduction_group``), so the ranks'
all-gathers of that backward still meet in the same order. Found by review: before, rank 0's reduce-scatter met
rank 1's all-gather and both timed out. Checked against one process summing every rank's loss (SGD, fp32)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime

VOCAB, DIN, STEPS = 11, 6, 3


class _TwoParams(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(7, DIN) * 0.3)
        self.w2 = nn.Parameter(torch.randn(7, DIN) * 0.3)
        self.use2 = True

    def forward(self, h):
        return h @ self.w1 + h @ self.w2 if self.use2 else h @ self.w1


class _Net(nn.Module):
    """A tied embedding / head, a non-contiguous root parameter and ``mid.w2``, used as ``use2`` says."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIN)
        self.w = nn.Parameter(torch.randn(7, DIN).t())
        self.one = nn.Parameter(torch.randn(1))
        self.mid = _TwoParams()
        self.head = nn.Linear(DIN, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(torch.tanh(self.emb(x) @ self.w) * self.one)))


def _loss(model, step: int, rank: int) -> torch.Tensor:
    model.mid.use2 = rank == 0
    x = torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(100 * step + rank))
    return nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())


def _body(reduce_bucket_size: int) -> dict:
    torch.manual_seed(0)
    model = _Net()
    cfg = ZeroConfig(stage=3, stage3_param_persistence_threshold=0, reduce_bucket_size=reduce_bucket_size,
                     overlap_comm=True)  # fmt: skip
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg, PrecisionPolicy.fp32())
    for step in range(STEPS):
        rt.backward(_loss(rt.module, step, dist.get_rank()))
        rt.step()
    out = dict(rt.full_parameters())
    rt.close()
    return out


@pytest.mark.parametrize("reduce_bucket_size", [8, 500_000_000])
def test_gradient_on_some_ranks_only_matches_the_reference(reduce_bucket_size):
    world = 2
    torch.manual_seed(0)
    ref = _Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        (sum(_loss(ref, step, r) for r in range(world)) / world).backward()
        opt.step()
    for got in run_ranks(_body, world, reduce_bucket_size, timeout=120, threads=1):
        for name, want in ref.named_parameters():
            torch.testing.assert_close(got[name], want.detach(), atol=1e-6, rtol=1e-5, msg=name)
