"""Stage 3: ``stage3_max_live_parameters`` bounds the gathered elements (counted at every gather, forward and
backward) and ``stage3_max_reuse_distance`` keeps a unit gathered until a near reuse; results match plain PyTorch."""

import torch
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import ShardState, ZeroConfig, ZeroRuntime
from zero_core.stage3 import lookup

UNIT = 6 * 6 + 6  # elements of one Linear(6, 6) unit (even: no padding on 2 ranks)


class Shared(nn.Module):
    """``shared`` runs first and again after ``a`` and ``b``: its reuse distance is 2 units (84 elements)."""

    def __init__(self):
        super().__init__()
        self.shared, self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        return self.shared(self.b(self.a(torch.tanh(self.shared(x)))))


def _reference(make, steps):
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        model(torch.full((3, 6), 0.1 * (step + 1))).square().mean().backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(make, steps, **cfg):
    torch.manual_seed(0)
    model = make()
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     ZeroConfig(stage=3, stage3_param_persistence_threshold=0, **cfg))  # fmt: skip
    store, gather, live = rt.params, rt.params.units.gather, []

    def counted(b, **kw):
        gather(b, **kw)
        live.append(store.live_numel())
        # the running count equals the sum over units it replaced
        units = [u for g in rt.flat_groups for u in g.buckets if not u.persistent]
        assert live[-1] == sum(u.padded_numel for u in units if store.state_of(u) is not ShardState.SHARDED)

    store.units.gather = counted  # every gather the hooks issue (demand and prefetch) goes through here
    return rt, model, live


def _live_body(max_live):
    def make():
        return nn.Sequential(*[nn.Linear(6, 6) for _ in range(6)])

    rt, model, live = _train(make, 3, stage3_prefetch_bucket_size=10**6, stage3_max_live_parameters=max_live)
    for step in range(3):
        rt.backward(rt.module(torch.full((3, 6), 0.1 * (step + 1))).square().mean())
        rt.step()
    return max(live), rt.full_parameters()


def test_max_live_parameters_bounds_gathered_elements():
    want = _reference(lambda: nn.Sequential(*[nn.Linear(6, 6) for _ in range(6)]), 3)
    for max_live, bound in ((2 * UNIT + 1, 2 * UNIT), (10**9, 6 * UNIT)):
        for peak, params in run_ranks(_live_body, 2, max_live, timeout=60):
            assert peak <= bound, (max_live, peak)
            for name, value in want.items():
                torch.testing.assert_close(params[name], value, atol=1e-6, rtol=1e-5)
        if max_live == 10**9:
            assert peak > 2 * UNIT  # unbounded, prefetch does gather more: the bound above is what held it


def _state(entry):
    store, unit = entry
    return store.state_of(unit)


def _reuse_body(distance):
    rt, model, _ = _train(Shared, 3, stage3_prefetch_bucket_size=1, stage3_max_reuse_distance=distance)
    seen = []  # the shared unit's state while ``a`` runs (between its two uses)
    model.a.register_forward_pre_hook(lambda m, args: seen.append(_state(lookup(model.shared.weight))))
    for step in range(3):
        rt.backward(rt.module(torch.full((3, 6), 0.1 * (step + 1))).square().mean())
        rt.step()
    return seen, rt.full_parameters()


def test_max_reuse_distance_keeps_a_unit_for_a_near_reuse():
    want = _reference(Shared, 3)
    for distance, kept in ((2 * UNIT, ShardState.GATHERED), (2 * UNIT - 1, ShardState.SHARDED)):
        for seen, params in run_ranks(_reuse_body, 2, distance, timeout=60):
            # step 0 records the sequence (released after use); later steps keep it when the reuse is near enough
            assert seen == [ShardState.SHARDED, kept, kept], (distance, seen)
            for name, value in want.items():
                torch.testing.assert_close(params[name], value, atol=1e-6, rtol=1e-5)
