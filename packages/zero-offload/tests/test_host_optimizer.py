"""HostOptimizer against torch's optimizers on the same flat fp32 tensors (no process group needed)."""

import pytest
import torch

from zero_kernels import CPUAdam
from zero_offload.host_optimizer import HostOptimizer
from zero_offload.subgroups import plan_sub_groups

SIZES = (37, 101)  # odd sizes: sub-groups of 16 leave a ragged last one in each shard


def _reference(opt_cls, kwargs, masters, grads_per_step, coefs):
    params = [torch.nn.Parameter(m.clone()) for m in masters]
    opt = opt_cls([{"params": [p]} for p in params], **kwargs)
    for grads, coef in zip(grads_per_step, coefs):
        for p, g in zip(params, grads):
            p.grad = g * coef
        opt.step()
    return [p.detach() for p in params]


def _run(opt_cls, kwargs, *, ratio=1.0, sub_group_size=16, coefs=(1.0, 0.5, 0.25), out_dtype=torch.float32):
    torch.manual_seed(0)
    masters = [torch.randn(n) for n in SIZES]
    steps = [[torch.randn(n) for n in SIZES] for _ in coefs]
    expect = _reference(opt_cls, kwargs, masters, steps, coefs)
    user = opt_cls([{"params": [torch.nn.Parameter(m.clone())]} for m in masters], **kwargs)
    host = HostOptimizer(masters, [0, 1], user, sub_group_size=sub_group_size, ratio=ratio, out_dtype=out_dtype)
    for grads, coef in zip(steps, coefs):
        host.zero_grad()
        for s, g in enumerate(grads):
            host.receive_grad(s, 0, g)
        host.step(coef)
    return host, expect


@pytest.mark.parametrize(
    "opt_cls,kwargs",
    [
        (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
        (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
        (CPUAdam, dict(lr=1e-2, weight_decay=0.1)),
        (torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
        (torch.optim.Adagrad, dict(lr=1e-2)),
    ],
)
def test_matches_torch_step(opt_cls, kwargs):
    host, expect = _run(opt_cls, kwargs)
    for s, e in enumerate(expect):
        torch.testing.assert_close(host.master_shard(s), e, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_twin_flow_ratio_matches(ratio):
    host, expect = _run(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), ratio=ratio)
    on_host = sum(sg.on_host for sg in host.sub_groups)
    assert on_host == round(ratio * len(host.sub_groups) + 0.49)
    assert not host.sub_groups[0].on_host  # the first sub-group (last gradients) stays on the device
    for s, e in enumerate(expect):
        torch.testing.assert_close(host.master_shard(s), e, rtol=1e-6, atol=1e-7)


def test_plan_sub_groups_cover_each_shard_once():
    plan = plan_sub_groups([37, 0, 5], 16, ratio=0.5)
    assert [(sg.shard, sg.start, sg.end) for sg in plan] == [(0, 0, 16), (0, 16, 32), (0, 32, 37), (2, 0, 5)]
    assert [sg.on_host for sg in plan] == [False, False, True, True]
    with pytest.raises(ValueError, match="sub_group_size"):
        plan_sub_groups([4], 0)
    with pytest.raises(ValueError, match="offload_optimizer.ratio"):
        plan_sub_groups([4], 4, ratio=1.5)


def test_bf16_write_back_is_the_rounded_master():
    host, _ = _run(torch.optim.AdamW, dict(lr=1e-2), out_dtype=torch.bfloat16)
    for s, n in enumerate(SIZES):
        out = torch.empty(n, dtype=torch.bfloat16)
        host.write_back(s, out)
        assert torch.equal(out, host.master_shard(s).to(torch.bfloat16))


def test_state_round_trips_in_torch_layout():
    host, _ = _run(torch.optim.AdamW, dict(lr=1e-2))
    state = host.shard_state(1)
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 3.0
    assert state["exp_avg"].shape == (SIZES[1],)
    user = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)  # one group for both shards
    other = HostOptimizer([torch.zeros(n) for n in SIZES], [0, 0], user, sub_group_size=7)
    other.load_shard_state(1, state)
    back = other.shard_state(1)
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(back[k], state[k])
    with pytest.raises(ValueError, match="shard 1 has 101 elements"):
        other.load_master_shard(1, torch.zeros(5))


def test_receive_grad_reports_complete_sub_groups():
    host = HostOptimizer([torch.zeros(40)], [0], torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]),
                         sub_group_size=16)  # fmt: skip
    assert host.receive_grad(0, 24, torch.ones(16)) == [host.sub_groups[2]]  # [32, 40) complete, [16, 32) half
    assert host.receive_grad(0, 0, torch.ones(24)) == host.sub_groups[:2]
    with pytest.raises(ValueError, match="outside master shard 0"):
        host.receive_grad(0, 30, torch.ones(20))


def test_pin_memory_is_pageable_without_a_word_on_a_cpu_only_machine(recwarn):
    from zero_offload import host_memory

    host_memory._warned.discard("k.pin_memory")
    t = host_memory.host_empty(10, torch.float32, pin_memory=True, key="k.pin_memory")
    host_memory.host_empty(10, torch.float32, pin_memory=True, key="k.pin_memory")
    if torch.cuda.is_available():
        assert t.is_pinned()
    else:  # nothing to speed up without an accelerator: a standard offload config says nothing here
        assert not [w for w in recwarn if "k.pin_memory" in str(w.message)]
        assert not t.is_pinned() and t.numel() == 10
