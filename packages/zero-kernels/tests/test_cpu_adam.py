"""CPU Adam/AdamW against torch.optim.AdamW/Adam and the pure-torch reference, on every ISA path."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import zero_kernels as zk
from zero_kernels import adam_step, adam_step_reference

SIZES = (1, 7, 1000, 4097)  # scalar, sub-vector, vector body, body + tail of the SIMD loops
# Tolerance: the SIMD paths round like torch's vectorised kernels (fma where torch uses fma); torch's own scalar
# tails and our portable path differ by 1-2 ulp, well inside 1e-6 relative (atol for values that cross zero).
TOL = dict(rtol=1e-6, atol=1e-6)


# The ISA paths this CPU can run, decided at collection time (the op's own CPUID check, best first): each is
# tested and none is skipped; "generic" is always among them.
ISAS = [i for i in ("avx512", "avx2", "generic") if i in zk.load("cpu_adam").supported_isas()]


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    monkeypatch.setenv("ZERO_KERNELS_ISA", request.param)
    assert zk.cpu_isa() == request.param
    return request.param


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in SIZES]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(n, generator=g) for n in SIZES]


@pytest.mark.parametrize("adamw", [True, False])
def test_matches_torch_over_100_steps(isa, adamw):
    ours = [p.clone().requires_grad_() for p in _params()]
    ref = [p.clone().requires_grad_() for p in _params()]
    opt = zk.CPUAdam(ours, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, adamw_mode=adamw, use_op=True)
    ref_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref_opt = ref_cls(ref, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, foreach=False)
    for step in range(100):
        for a, b, g in zip(ours, ref, _grads(step)):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a.detach(), b.detach(), **TOL, msg=lambda m, s=step: f"step {s}: {m}")
    for a, b in zip(ours, ref):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[a][key], ref_opt.state[b][key], **TOL)
        assert opt.state[a]["step"].item() == ref_opt.state[b]["step"].item() == 100


@pytest.mark.parametrize("adamw", [True, False])
def test_without_bias_correction_matches_reference(isa, adamw):
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=adamw, bias_correction=False)
    ours, ref = _params(), _params()
    state = [[torch.zeros(n) for n in SIZES] for _ in range(4)]
    for step in range(1, 101):
        for i, g in enumerate(_grads(step)):
            adam_step(ours[i], g, state[0][i], state[1][i], step=step, use_op=True, **kw)
            adam_step_reference(ref[i], g, state[2][i], state[3][i], step=step, **kw)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, **TOL)
    # Exact math for one element after one step from zero state: m = (1-b1) g, v = (1-b2) g^2,
    # update = lr * m / (sqrt(v) + eps) = lr * 0.1 * g / (sqrt(0.001) |g| + eps).
    p, g, m, v = torch.tensor([0.5]), torch.tensor([2.0]), torch.zeros(1), torch.zeros(1)
    adam_step(p, g, m, v, step=1, use_op=True, **{**kw, "weight_decay": 0.0})
    expected = 0.5 - 1e-3 * 0.1 * 2.0 / (0.001**0.5 * 2.0 + 1e-8)
    assert p.item() == pytest.approx(expected, rel=1e-6)


def test_bf16_copy_equals_fp32_result_cast(isa):
    params, out = _params(), [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    opt = zk.CPUAdam(params, lr=1e-2, weight_decay=0.1, use_op=True)
    for step in range(3):
        for p, g in zip(params, _grads(step)):
            p.grad = g
        opt.step(bf16_out=dict(zip(params, out)))
        for p, o in zip(params, out):
            assert torch.equal(o, p.to(torch.bfloat16)), "bf16 copy must be the RNE cast of the fp32 result"
    # Rounding corner cases: ties to even, NaN, inf, signed zero, tiny values.
    special = torch.tensor([1.00390625, 1.01171875, float("nan"), float("inf"), -0.0, 1e-40, -3.4e38])
    p, m, v = special.clone(), torch.zeros(7), torch.zeros(7)
    o = torch.empty(7, dtype=torch.bfloat16)
    adam_step(p, torch.zeros(7), m, v, step=1, lr=0.0, weight_decay=0.0, bf16_out=o, use_op=True)
    want = special.to(torch.bfloat16)
    finite = ~torch.isnan(want)
    assert torch.equal(o.view(torch.int16)[finite], want.view(torch.int16)[finite])
    assert torch.isnan(o[2])  # NaN stays NaN (torch's vectorised cast and c10's scalar cast differ in payload)


def test_fused_offload_step_equals_composed_torch(isa):
    """grad_scale (unscale x clip) inside the loop equals grad.mul_ then torch AdamW then copy_ to bf16."""
    scale = (1.0 / 1024.0) * 0.37
    ours = [p.clone() for p in _params()]
    ref = [p.clone().requires_grad_() for p in _params()]
    out = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    opt = zk.CPUAdam(ours, lr=1e-3, weight_decay=0.1, use_op=True)
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.1, foreach=False)
    for step in range(10):
        grads = [g * 1024.0 for g in _grads(step)]
        for a, b, g in zip(ours, ref, grads):
            a.grad, b.grad = g.clone(), g.clone().mul_(scale)
        opt.step(grad_scale=scale, bf16_out=dict(zip(ours, out)))
        ref_opt.step()
        for a, g in zip(ours, grads):
            assert torch.equal(a.grad, g), "the gradient must not be modified"
    for a, b, o in zip(ours, ref, out):
        torch.testing.assert_close(a, b.detach(), **TOL)
        assert torch.equal(o, a.to(torch.bfloat16))


def test_threads_give_identical_results():
    n = 300_001  # above the parallel threshold, odd split
    results = []
    for threads in (1, 2, 3):
        p, g = torch.randn(n, generator=torch.Generator().manual_seed(3)), torch.ones(n)
        m, v = torch.zeros(n), torch.zeros(n)
        for step in range(1, 4):
            adam_step(p, g * step, m, v, step=step, lr=1e-2, num_threads=threads, use_op=True)
        results.append(p)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.smoke
def test_reference_fallback_matches_torch():
    ours = [p.clone().requires_grad_() for p in _params()]
    ref = [p.clone().requires_grad_() for p in _params()]
    opt = zk.CPUAdam(ours, lr=1e-3, weight_decay=0.1, use_op=False)
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.1, foreach=False)
    for step in range(20):
        for a, b, g in zip(ours, ref, _grads(step)):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


def test_mode_flag_spellings_and_defaults():
    runs = []
    for kwargs in (dict(adamw_mode=False), dict(adam_w_mode=False)):
        p = _params()[2].clone()
        opt = zk.CPUAdam([p], lr=1e-2, weight_decay=0.1, **kwargs)
        assert opt.param_groups[0]["adamw_mode"] is False
        for step in range(3):
            p.grad = _grads(step)[2]
            opt.step()
        runs.append(p)
    assert torch.equal(runs[0], runs[1])
    with pytest.raises(ValueError, match="adamw_mode=True and adam_w_mode=False disagree"):
        zk.CPUAdam([torch.zeros(1)], adamw_mode=True, adam_w_mode=False)
    # Defaults follow torch: AdamW decays 0.01, Adam 0.0, never silently the other's.
    assert zk.CPUAdam([torch.zeros(1)]).defaults["weight_decay"] == 0.01
    assert zk.CPUAdam([torch.zeros(1)], adamw_mode=False).defaults["weight_decay"] == 0.0


def test_state_dict_interoperates_with_torch_adamw():
    ours = [p.clone() for p in _params()]
    ref = [p.clone() for p in _params()]
    opt = zk.CPUAdam(ours, lr=1e-3, weight_decay=0.1)
    for step in range(5):
        for a, g in zip(ours, _grads(step)):
            a.grad = g.clone()
        opt.step()
    # ours -> torch, and torch -> ours, then both continue identically.
    torch_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.1, foreach=False)
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # state_dict() shares tensors; as in torch
    with torch.no_grad():
        for a, b in zip(ours, ref):
            b.copy_(a)
    back = zk.CPUAdam([p.clone() for p in ours], lr=5.0)
    back.load_state_dict(torch.optim.AdamW(back.param_groups[0]["params"], lr=1e-3).state_dict())
    back.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert back.param_groups[0]["lr"] == 1e-3 and back.param_groups[0]["adamw_mode"] is True
    for step in range(5, 10):
        for a, b, g in zip(ours, ref, _grads(step)):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        torch_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, **TOL)
    assert torch_opt.state[ref[0]]["step"].item() == 10


def test_torch_state_dict_loads_into_cpu_adam():
    p = _params()[3]
    t = torch.optim.AdamW([p.clone().requires_grad_()], lr=1e-3)
    t.param_groups[0]["params"][0].grad = _grads(0)[3]
    t.step()
    ours = zk.CPUAdam([p.clone()], lr=1e-3)
    ours.load_state_dict(t.state_dict())  # lacks adamw_mode / bias_correction: filled from defaults
    assert ours.param_groups[0]["bias_correction"] is True
    mine, theirs = ours.param_groups[0]["params"][0], t.param_groups[0]["params"][0]
    assert torch.equal(ours.state[mine]["exp_avg"], t.state[theirs]["exp_avg"])


def test_bad_input_is_named():
    p = torch.zeros(4, dtype=torch.bfloat16)
    p.grad = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"group 0 param 0 must be an fp32 CPU tensor.*bfloat16"):
        zk.CPUAdam([p]).step()
    x = torch.zeros(5)
    with pytest.raises(ValueError, match=r"bf16_out must be a contiguous CPU torch.bfloat16 tensor of 5 elements"):
        adam_step(x, x.clone(), x.clone(), x.clone(), step=1, lr=1.0, bf16_out=torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"exp_avg must be .* of 5 elements; got torch.float64"):
        adam_step(x, x.clone(), torch.zeros(5, dtype=torch.float64), x.clone(), step=1, lr=1.0)
    with pytest.raises(ValueError, match="step must be >= 1, got 0"):
        adam_step(x, x.clone(), x.clone(), x.clone(), step=0, lr=1.0)
    with pytest.raises(ValueError, match="betas must be two floats"):
        zk.CPUAdam([x], betas=(0.9, 1.0))


def test_hugepage_buffers():
    t = zk.empty_hugepage(3_000_000)
    assert t.shape == (3_000_000,) and t.dtype == torch.float32
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if sys.platform.startswith("linux") and thp.exists() and "[never]" not in thp.read_text():
        assert zk.advise_hugepages(t) is True
    assert zk.advise_hugepages(torch.empty(10)) is False  # too small to matter
    with pytest.raises(ValueError, match="numel must be >= 0, got -1"):
        zk.empty_hugepage(-1)
    # CPUAdam's moments live there; values are as with torch.zeros.
    p = torch.randn(2_000_000)
    p.grad = torch.ones_like(p)
    opt = zk.CPUAdam([p])
    opt.step()
    assert opt.state[p]["exp_avg"].shape == p.shape and torch.allclose(opt.state[p]["exp_avg"], torch.tensor(0.1))
