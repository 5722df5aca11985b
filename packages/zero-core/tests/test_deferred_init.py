"""``defer_init``: a model built on the meta device trains at stage 3 exactly like the same model built whole
with the same starting values (fp32, 1e-6 relative), tied parameters stay tied, and no unit is materialised
before the runtime asks for it."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime, defer_init


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(13, 8)
        self.fc = nn.Linear(8, 9)
        self.out = nn.Linear(9, 13, bias=False)
        self.tied = nn.Linear(8, 13, bias=False)
        self.tied.weight = self.emb.weight


def _forward(m, x):
    h = torch.tanh(m.fc(m.emb(x)))
    return m.out(h) + m.tied(m.emb(x))


def _value(name, shape, dtype):
    g = torch.Generator().manual_seed(sum(map(ord, name)))  # deterministic per name, the same on every rank
    return torch.randn(shape, generator=g, dtype=dtype) * 0.1


def _train(rt):
    losses = []
    for step in range(3):
        x = torch.randint(0, 13, (4, 5), generator=torch.Generator().manual_seed(step * 7 + dist.get_rank()))
        loss = nn.functional.cross_entropy(_forward(rt.module, x).flatten(0, 1), x.flatten())
        rt.backward(loss)
        rt.step()
        losses.append(loss.item())
    return losses


def _body():
    calls = []
    with torch.device("meta"):
        lazy = Net()
    n = defer_init(lazy, lambda name, shape, dtype: calls.append(name) or _value(name, shape, dtype))
    assert lazy.tied.weight is lazy.emb.weight and not calls  # nothing computed before the runtime
    assert n == sum(p.numel() for p in Net().parameters())
    eager = Net()
    with torch.no_grad():
        for name, p in eager.named_parameters():
            p.copy_(_value(name, p.shape, p.dtype))
    cfg = ZeroConfig(stage=3, stage3_param_persistence_threshold=0, reduce_bucket_size=64)
    rts = [
        ZeroRuntime(m, torch.optim.AdamW(m.parameters(), lr=1e-2), cfg, PrecisionPolicy.fp32()) for m in (lazy, eager)
    ]
    assert sorted(calls) == sorted(n for n, _ in lazy.named_parameters())  # one init per parameter
    la, ea = _train(rts[0]), _train(rts[1])
    torch.testing.assert_close(la, ea, rtol=1e-6, atol=0)
    a, b = rts[0].full_parameters(), rts[1].full_parameters()
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)
    return True


def test_deferred_model_trains_like_the_eager_one():
    assert all(run_ranks(_body, 2, timeout=120, threads=1))


def test_meta_buffer_is_named():
    with torch.device("meta"):
        m = nn.BatchNorm1d(4)
    with pytest.raises(ValueError, match="running_mean"):
        defer_init(m, _value)
