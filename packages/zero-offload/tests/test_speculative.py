"""SuperOffload's speculative step is bitwise the plain offloaded step: no clip, clip, overflow."""

import threading

import pytest
import torch

from zero_offload.host_optimizer import HostOptimizer
from zero_offload.speculative import SpeculativeStep

SIZES = (53, 29)


def _make(opt_cls=torch.optim.AdamW, seed=0):
    torch.manual_seed(seed)
    masters = [torch.randn(n) for n in SIZES]
    extra = {"momentum": 0.9} if opt_cls is torch.optim.SGD else {}
    groups = [{"params": [torch.nn.Parameter(m.clone())]} for m in masters]
    user = opt_cls(groups, lr=1e-2, weight_decay=0.05, **extra)
    return HostOptimizer(masters, [0, 1], user, sub_group_size=8)


def _grads(k):
    g = torch.Generator().manual_seed(100 + k)
    return [torch.randn(n, generator=g) * 1024 for n in SIZES]


def _plain(host, grads, overflow, coef):
    host.zero_grad()
    for s, g in enumerate(grads):
        host.receive_grad(s, 0, g)
    if not overflow:
        host.step(coef)


def _speculative(spec, grads, overflow, coef, loss_scale):
    host = spec.host
    host.zero_grad()
    spec.begin(loss_scale)
    for s in reversed(range(len(grads))):  # backward: last shard first, in pieces that straddle sub-groups
        g = grads[s]
        for a in reversed(range(0, g.numel(), 5)):
            spec.on_ready(host.receive_grad(s, a, g[a : a + 5]))
    spec.finish(overflow, coef)


def _bits(host):
    out = [host.master_shard(s) for s in range(len(SIZES))]
    out += [t for s in range(len(SIZES)) for k, t in host.shard_state(s).items() if k != "step"]
    steps = [host.shard_state(s).get("step") for s in range(len(SIZES))]
    return [t.view(torch.int32) for t in out], [None if x is None else float(x) for x in steps]


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_three_cases_bitwise(opt_cls):
    scale = 1024.0
    # (overflow, coef): kept (1/scale), clipped (smaller coefficient), overflow (skipped), then kept again
    schedule = [(False, 1 / scale), (False, 0.3 / scale), (True, 1 / scale), (False, 1 / scale), (False, 0.7 / scale)]
    plain, spec_host = _make(opt_cls), _make(opt_cls)
    spec = SpeculativeStep(spec_host, cores_perc=0.5)
    try:
        for k, (overflow, coef) in enumerate(schedule):
            _plain(plain, _grads(k), overflow, coef)
            _speculative(spec, _grads(k), overflow, coef, scale)
            (a, sa), (b, sb) = _bits(plain), _bits(spec_host)
            assert sa == sb, f"step {k}: step counts differ"
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"step {k} (overflow={overflow}, coef={coef}): bits differ"
    finally:
        spec.close()
    n = len(spec_host.sub_groups)
    assert spec.stats == {"speculated": 5 * n, "kept": 2 * n, "redone": 2 * n, "rolled_back": n, "undone": 0}


def test_speculative_steps_run_in_the_worker_thread():
    host = _make()
    spec = SpeculativeStep(host, cores_perc=1.0)
    seen = set()
    real = host.step_sub_group

    def spy(sg, coef):
        seen.add(threading.current_thread().name.startswith("zero-superoffload"))
        real(sg, coef)

    host.step_sub_group = spy
    _speculative(spec, _grads(0), False, 1.0, 1.0)
    spec.close()
    assert seen == {True}


def test_cores_perc_is_validated():
    with pytest.raises(ValueError, match="cpuadam_cores_perc"):
        SpeculativeStep(_make(), cores_perc=0.0)
