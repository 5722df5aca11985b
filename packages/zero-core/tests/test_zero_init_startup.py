"""Start-up under zero_init does the work once: wrapping a model built under ``zero_init`` costs
at most one collective per bucket (here: one all-gather each, no broadcast), at stage 3 and at a dense stage, and
the wrapped values equal those of the same model built without ``zero_init`` from the same seed."""

import torch
from torch import nn

from zero_comm import CommsLogger
from zero_comm.testing import run_ranks
from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime, zero_init


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 13)  # uneven sizes: per-parameter chunks and bucket chunks differ
        self.mid = nn.Sequential(nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 9))
        self.norm = nn.LayerNorm(9)  # small parameters: a persistent bucket
        self.out = nn.Linear(9, 3, bias=False)

    def forward(self, x):
        return self.out(self.norm(self.mid(torch.tanh(self.inp(x)))))


def _wrap(under_zero_init: bool, precision: PrecisionPolicy, stage: int):
    torch.manual_seed(0)
    if under_zero_init:
        with zero_init():
            model = Net()
    else:
        model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = ZeroConfig(stage=stage, stage3_param_persistence_threshold=20, reduce_bucket_size=150)
    with CommsLogger() as log:
        rt = ZeroRuntime(model, opt, cfg, precision)
    return rt, [r.name for r in log.records]


def _body(precision_name, stage):
    precision = getattr(PrecisionPolicy, precision_name)()
    out = {}
    for under in (True, False):
        rt, calls = _wrap(under, precision, stage)
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            rt.backward(rt.module(x).square().mean())
            rt.step()
        units = sum(len(g.buckets) for g in rt.flat_groups)
        persistent = sum(b.persistent for g in rt.flat_groups for b in g.buckets) if stage == 3 else 1
        out[under] = (calls, units, persistent, rt.full_parameters())
        rt.close()
    return out


def test_zero_init_start_up_is_one_all_gather_per_bucket_and_matches_a_plain_build():
    for precision, stage in (("fp32", 3), ("bf16", 3), ("fp32", 1)):
        for out in run_ranks(_body, 2, precision, stage, timeout=120):
            (calls, units, persistent, params), (plain_calls, _, _, plain) = out[True], out[False]
            assert units >= (5 if stage == 3 else 3) and persistent >= 1, (stage, units)
            # what was partitioned at construction is re-laid with one all-gather per bucket, nothing broadcast
            assert calls.count("all_gather_into_tensor") == units, (precision, calls)
            assert "broadcast" not in calls, (precision, calls)
            assert len(calls) == units, (precision, calls)
            # a model whole on each rank is broadcast from rank 0 once per bucket instead
            assert plain_calls.count("broadcast") == units and len(plain_calls) == units, (precision, plain_calls)
            assert params.keys() == plain.keys()
            for name, value in params.items():  # same seed, same weights, same two steps: bitwise
                assert torch.equal(value, plain[name]), (precision, name)
