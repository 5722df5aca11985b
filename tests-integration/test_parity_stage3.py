"""Stage-3 specific cases: activation-checkpoint recompute with frozen params, GatheredParameters, zero_init with
buffers and with nested / mixin classes. fp32 tolerance atol 1e-6 / rtol 1e-5."""

import pathlib
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zero_comm.testing import run_ranks

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import parity_models as pm  # noqa: E402

TOL = dict(atol=1e-6, rtol=1e-5)


def _stage3(model, opt, **zero):
    from zero_core import ZeroConfig, ZeroRuntime

    zero.setdefault("stage3_param_persistence_threshold", 0)
    return ZeroRuntime(model, opt, ZeroConfig(stage=3, **zero))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.ln.weight.requires_grad_(False)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(self.ln(x))


class CkptNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return x


def _ckpt_data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(2 * 2 * 3, 8, generator=g), torch.randn(2 * 2 * 3, 8, generator=g)


def _recompute_frozen_body(input_grad):
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(pm.SEED)
    model = CkptNet()
    rt = _stage3(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    released = []
    for step in range(2):
        x, t = _ckpt_data(step)
        for k in range(2):  # gas 2: micro-batch k is 6 samples, this rank takes 3
            lo = k * 6 + rank * 3
            xs = x[lo : lo + 3].clone().requires_grad_(input_grad)
            rt.backward(F.mse_loss(rt.module(xs), t[lo : lo + 3]) / 2)
            released.append(pm.all_released(rt))
        rt.step()
    return rt.full_parameters(), released


def test_checkpoint_recompute_with_frozen_params():
    torch.manual_seed(pm.SEED)
    ref = CkptNet()
    frozen0 = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):
        x, t = _ckpt_data(step)
        opt.zero_grad()
        for k in range(2):
            (F.mse_loss(ref(x[k * 6 : k * 6 + 6]), t[k * 6 : k * 6 + 6]) / 2).backward()
        opt.step()
    for input_grad in (True, False):
        for params, released in run_ranks(_recompute_frozen_body, 2, input_grad, timeout=60):
            assert all(released), "a unit stayed gathered after backward"
            for name, p in ref.named_parameters():
                torch.testing.assert_close(params[name], p.detach(), **TOL, msg=name)
            for name, p in frozen0.items():
                assert torch.equal(params[name], p), name


def _gathered_edit_body():
    import torch.distributed as dist

    from zero_core import GatheredParameters

    model = pm.build()
    rt = _stage3(model, torch.optim.SGD(model.parameters(), lr=0.1))
    w = model.l1.weight
    unit = next(b for g in rt.flat_groups for b in g.buckets if any(s.param is w for s in b.slots))
    with GatheredParameters([w]):  # (c) read-only
        read = w.detach().clone()
    states = [rt.params.state_of(unit)]
    with GatheredParameters([w], modifier_rank=0):  # (a) rank 0 edits, everyone keeps it
        if dist.get_rank() == 0:
            w.data.fill_(1.0)
    states.append(rt.params.state_of(unit))
    with GatheredParameters([w]):
        after_a = w.detach().clone()
    out = rt.module(torch.ones(2, 8)).detach()
    error = None
    try:  # (b) in-place edit without a modifier rank
        with GatheredParameters([w]):
            w.data.mul_(2)
    except RuntimeError as exc:
        error = str(exc)
    states.append(rt.params.state_of(unit))
    with GatheredParameters([w]):
        after_b = w.detach().clone()
    return read, after_a, out, error, after_b, states, rt.full_parameters()["l1.weight"]


def test_gathered_parameters_modifier_rank():
    ref = pm.build()
    results = run_ranks(_gathered_edit_body, 2, timeout=60)
    initial = ref.l1.weight.detach().clone()
    with torch.no_grad():
        ref.l1.weight.fill_(1.0)
    want_out = ref(torch.ones(2, 8))
    for read, after_a, out, error, after_b, states, master in results:
        assert torch.equal(read, initial)
        assert torch.equal(after_a, torch.ones(13, 8)) and torch.equal(master, torch.ones(13, 8))
        torch.testing.assert_close(out, want_out, **TOL)
        assert error is not None and "without modifier_rank" in error
        assert torch.equal(after_b, torch.ones(13, 8))
        assert [s.name for s in states] == ["SHARDED"] * 3


class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("pos", torch.arange(0, 64))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)))
        self.register_buffer("mask", torch.arange(8) % 2 == 0)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x * self.inv_freq * self.mask) + self.pos[:8].float()


def _init_buffers_body():
    from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime, zero_init

    torch.manual_seed(pm.SEED)
    plain = Rotary()
    torch.manual_seed(pm.SEED)
    with zero_init(dtype=torch.bfloat16):
        part = Rotary()
    bufs = {n: b.clone() for n, b in part.named_buffers()}
    outs = []
    for m in (plain, part):
        rt = ZeroRuntime(m, torch.optim.SGD(m.parameters(), lr=0.1), ZeroConfig(stage=3), PrecisionPolicy.bf16())
        outs.append(rt.module(torch.ones(2, 8)).detach())
    return {n: b for n, b in plain.named_buffers()}, bufs, {n: b for n, b in part.named_buffers()}, outs


def test_zero_init_leaves_buffers_alone():
    for plain, during, after, (out_plain, out_part) in run_ranks(_init_buffers_body, 2, timeout=60):
        for name, b in plain.items():
            assert during[name].dtype == b.dtype and torch.equal(during[name], b), name
            assert after[name].dtype == b.dtype and torch.equal(after[name], b), name
        assert plain["pos"].dtype == torch.int64 and plain["mask"].dtype == torch.bool
        torch.testing.assert_close(out_part, out_plain, atol=0, rtol=0)  # same bf16 weights -> same output


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(6, 6)


class Mixin:
    def __init__(self):
        super().__init__()
        self.extra = nn.Parameter(torch.ones(5))


class Child(Mixin, Base):
    def __init__(self):
        super().__init__()
        with torch.no_grad():
            self.w.weight.fill_(0.5)
            self.w.bias.zero_()

    def forward(self, x):
        return self.w(x) * self.extra.sum()


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.lin = Child(), Child(), nn.Linear(6, 6)
        # the children are partitioned by now: what follows reads and writes their weights as a dense build does
        with torch.no_grad():
            torch.nn.init.trunc_normal_(self.c2.w.weight, std=0.3)  # random draws, then reads of the drawn values
            self.lin.weight.data.mul_(0.5)  # through a view
            self.lin.bias[:2] = self.c1.w.bias[:2] + 1.0  # a slice written from another partitioned parameter
        self.sizes = (self.lin.weight.shape[1], self.c2.w.weight.size(0), self.c1.extra.numel())

    def forward(self, x):
        return self.c1(x) + self.c2(torch.tanh(x)) + self.lin(x)


def _nested_init_body():
    from zero_core import GatheredParameters, zero_init

    counts = {}
    torch.manual_seed(pm.SEED)
    with zero_init(on_partition=lambda p: counts.__setitem__(id(p), counts.get(id(p), 0) + 1)):
        model = Outer()
    per_param = [counts.get(id(p), 0) for p in model.parameters()]
    with GatheredParameters(list(model.c1.parameters())):
        seen = {n: p.detach().clone() for n, p in model.c1.named_parameters()}
    with GatheredParameters(list(model.parameters())):
        built = {n: p.detach().clone() for n, p in model.named_parameters()}
    rt = _stage3(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    import torch.distributed as dist

    r = dist.get_rank()
    for step in range(2):
        x = torch.linspace(-1, 1, 24).view(4, 6) * (step + 1)
        rt.backward(rt.module(x[r * 2 : r * 2 + 2]).square().mean())
        rt.step()
    return per_param, seen, rt.full_parameters(), built, model.sizes


def test_zero_init_nested_and_mixin_partition_once():
    """Each module is partitioned as its ``__init__`` returns, once; writes and reads of its weights in the
    enclosing ``__init__`` give the dense build's values bitwise (random draws included) and its shapes."""
    results = run_ranks(_nested_init_body, 2, timeout=60)
    torch.manual_seed(pm.SEED)
    ref = Outer()
    built = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        opt.zero_grad()
        ref(torch.linspace(-1, 1, 24).view(4, 6) * (step + 1)).square().mean().backward()
        opt.step()
    for per_param, seen, params, built_here, sizes in results:
        assert per_param == [1] * 8
        assert sizes == (6, 6, 5)
        for name, value in built.items():
            assert torch.equal(built_here[name], value), name
        assert torch.equal(seen["w.weight"], torch.full((6, 6), 0.5)) and torch.equal(seen["w.bias"], torch.zeros(6))
        assert torch.equal(seen["extra"], torch.ones(5))
        for name, p in ref.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), **TOL, msg=name)


class WithEmpty(pm.TinyNet):
    """TinyNet plus a zero-element parameter that takes part in the forward."""

    def __init__(self):
        super().__init__()
        self.nothing = nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return super().forward(x) + self.nothing.sum()


def _released_body():
    import warnings

    torch.manual_seed(pm.SEED)
    model = WithEmpty()
    rt = _stage3(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = pm.batch(0, 2, 1)
    rt.backward(F.cross_entropy(rt.module(x[:3]), y[:3]))
    rt.step()
    numels = [p.numel() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.state_dict()
    return numels, [str(w.message) for w in caught], rt.full_parameters()


def test_released_parameters_are_empty_and_state_dict_warns():
    """A released stage-3 parameter reads as an empty tensor (never freed memory); state_dict() says so;
    a zero-element parameter trains through every stage-3 path."""
    for numels, warned, params in run_ranks(_released_body, 2, timeout=60):
        assert numels == [0] * 7
        assert len(warned) == 1 and "released parameters" in warned[0]
        assert params["nothing"].shape == (0,) and params["l1.weight"].shape == (13, 8)
